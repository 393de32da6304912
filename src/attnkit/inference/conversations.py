"""Conversations as data: a JSONL file of chats, each laid out by the run's chat template, and which of its tokens
are the assistant's (``data.documents: chat``; ``attnkit evaluate RUN --data FILE.jsonl`` of such a run).

One conversation a line, as the usual instruction-tuning files are written::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

A line that is not such an object, or whose conversation has no assistant message (nothing to learn from), is a
one-line error naming ``file:line``; blank lines are skipped.

**The loss is on the assistant's tokens only** (instruction tuning: the model learns to answer, not to write
questions). They are found by rendering prefixes of the conversation, as FastChat and axolotl do for templates
without ``{% generation %}`` marks. For the assistant message ``i``::

    before_i  = render(messages[:i], add_generation_prompt=True)   # up to where its text begins
    through_i = render(messages[:i + 1])                           # and through its end of turn
    whole     = render(messages)

``before_i`` and ``through_i`` must each be the beginning of ``whole`` (a template that rewrites earlier turns
when more follow is an error naming the line); the characters between them are the message's, its end of turn
included (the model must learn to stop). In tokens: ``whole`` is encoded once, as a chat prompt is
(:func:`~attnkit.inference.chat.encode_rendered`), and message ``i``'s tokens are those after the tokens that the
encoding of ``before_i`` shares with it, up to those that the encoding of ``through_i`` shares (a token across a
boundary counts with the text after it). Training then scores position ``t`` when token ``t + 1`` is the
assistant's: every other position adds nothing to the loss, nor to its gradient.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..common.errors import UserError
from ..data.chat_template import ChatTemplate
from ..data.documents import is_held_out
from ..data.readers import ReadStats, iter_lines
from ..data.tokenizer import PAD_ID, Tokenizer
from ..runs.load import LoadedRun
from .chat import encode_rendered, run_template
from .language_model import LMScore

__all__ = ["Conversation", "conversation_messages", "encode_conversation", "read_conversations",
           "score_conversation_file", "score_conversations"]

#: The role whose turns the loss is on.
ASSISTANT = "assistant"


@dataclass
class Conversation:
    """A rendered, encoded conversation: ``ids`` and, per token, whether it is the assistant's (``scored``)."""

    ids: list[int]
    scored: list[bool]
    characters: int  # the characters of the assistant's text, end of turn included

    def __len__(self) -> int:
        return len(self.ids)


def conversation_messages(line: str, where: str) -> list[dict[str, str]]:
    """The messages of one JSONL line (module doc).

    :raises UserError: not JSON, not ``{"messages": [...]}``, a message without a string ``role`` and ``content``,
        or no assistant message; naming ``where`` (``file:line``).
    """
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UserError(f"{where}: not a JSON object ({e.msg}); write one conversation a line: "
                        f'{{"messages": [{{"role": "user", "content": "..."}}, ...]}}') from None
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: expected {{"messages": [...]}}, a list of {{"role", "content"}} objects')
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: message {k + 1} is {json.dumps(m, ensure_ascii=False)[:80]}; each message "
                            f'is {{"role": "...", "content": "..."}} with strings')
    if not any(m["role"] == ASSISTANT for m in messages):
        raise UserError(f"{where}: the conversation has no assistant message, so nothing to learn from; give each "
                        f"conversation at least one answer")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_conversations(path: str | Path, *, held_out: bool | None = None, fraction: float = 0.0, seed: int = 1,
                       stats: ReadStats | None = None) -> Iterator[tuple[str, str]]:
    """``(file:line, the line)`` of each conversation of a JSONL file (blank lines skipped), or of those on one side
    of ``fraction`` (``held_out`` True: the held-out lines, False: the rest; a stable hash of ``seed`` and the line
    number, as :func:`~attnkit.data.documents.is_held_out` holds out rows). The lines are checked by
    :func:`conversation_messages` where they are encoded."""
    for n, line in enumerate(iter_lines(path, stats), start=1):
        if line is None or not line.strip():
            continue
        if held_out is not None and fraction > 0 and is_held_out(str(n), fraction, seed) != held_out:
            continue
        yield f"{path}:{n}", line


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_conversation(template: ChatTemplate, tok: Tokenizer, messages: list[dict[str, str]], where: str,
                        limit: int) -> Conversation:
    """The ids of a conversation rendered by ``template`` and which are the assistant's (module doc), cut to
    ``limit`` tokens.

    :raises UserError: the template cannot render it, or renders a prefix of it otherwise than inside the whole.
    """
    whole = template.render(messages, add_generation_prompt=False)
    ids = encode_rendered(tok, whole)
    scored = [False] * len(ids)
    characters = 0
    for i, m in enumerate(messages):
        if m["role"] != ASSISTANT:
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (whole.startswith(before) and whole.startswith(through) and len(before) <= len(through)):
            raise UserError(f"{where}: the chat template writes the conversation up to message {i + 1} otherwise "
                            f"than inside the whole conversation, so the assistant's tokens cannot be found by "
                            f"rendering prefixes; give a template that writes each turn once (data.chat_template)")
        start = _shared(ids, encode_rendered(tok, before))
        end = _shared(ids, encode_rendered(tok, through))
        scored[start:end] = [True] * max(end - start, 0)
        characters += len(through) - len(before)
    return Conversation(ids[:limit], scored[:limit], characters)


@torch.inference_mode()
def score_conversations(model: nn.Module, conversations: Sequence[Conversation], max_tokens: int,
                        device: torch.device | None = None) -> LMScore:
    """The mean cross-entropy of the assistant's tokens (each predicted from everything before it in its
    conversation), batched up to ``max_tokens`` tokens."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    conversations = [c for c in conversations if len(c) > 1]  # one token predicts nothing
    order = np.argsort([len(c) for c in conversations], kind="stable")  # shortest first: little padding
    total, n, characters, start = 0.0, 0, 0, 0
    while start < len(order):
        end = start + 1  # a batch: as many as fit max_tokens at the length of its longest (its last)
        while end < len(order) and (end - start + 1) * len(conversations[order[end]]) <= max_tokens:
            end += 1
        group = [conversations[i] for i in order[start:end]]
        start, longest = end, len(group[-1])
        ids = torch.full((len(group), longest), PAD_ID, dtype=torch.long)
        scored = torch.zeros(len(group), longest, dtype=torch.bool)
        for r, c in enumerate(group):
            ids[r, : len(c)] = torch.tensor(c.ids)
            scored[r, : len(c)] = torch.tensor(c.scored)
        targets = torch.where(scored[:, 1:], ids[:, 1:], -100)  # (B, T - 1): the assistant's tokens only
        logits = model(ids[:, :-1].to(device)).float()  # (B, T - 1, V)
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten().to(device), ignore_index=-100,
                                 reduction="sum").item()
        n += int(scored[:, 1:].sum())
        characters += sum(c.characters for c in group)
    model.train(was_training)
    return LMScore(total / max(n, 1), n, characters)


def score_conversation_file(run: LoadedRun, path: str | Path, name: str) -> LMScore:
    """:func:`score_conversations` of a JSONL file of conversations (``attnkit evaluate --data`` of a run trained on
    them), laid out by the run's chat template (``name``: the run as the user named it)."""
    template = run_template(run, name)
    limit = run.model.context or sys.maxsize  # a table of positions: the conversation's first max_len tokens
    conversations = [encode_conversation(template, run.tok, conversation_messages(line, where), where, limit)
                     for where, line in read_conversations(path)]
    if not conversations:
        raise UserError(f"{path}: no conversation to score")
    return score_conversations(run.model, conversations, run.cfg.train.max_tokens)
