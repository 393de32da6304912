"""Chatting with a language model: the conversation laid out by the run's chat template, each answer streamed.

A :class:`Chat` keeps one conversation: an optional system message, then questions and answers. For each new
question:

1. the conversation and the question are rendered by the run's chat template (:mod:`attnkit.data.chat_template`)
   up to the header of the assistant's turn (``add_generation_prompt``), and encoded as transformers'
   ``apply_chat_template`` encodes it: the template writes any start token itself (:func:`encode_rendered`);
2. while that prompt and the answer's budget (``max_new_tokens``) exceed the model's positions, the oldest turn (a
   question and its answer) is dropped; the system message stays. Without a ``max_new_tokens`` the budget is 256
   tokens, or what the positions leave after the question alone (a default never asks for more than fits);
3. the model continues the prompt (:func:`~attnkit.inference.language_model.continue_text`) until it ends its
   turn: ``</s>``, a piece of ``data.end_of_turn`` (``<|im_end|>``), or text of it, or the budget;
4. the answer's text joins the conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from ..common.errors import UserError
from ..data.chat_template import ChatTemplate, end_of_turn, special_tokens
from ..data.tokenizer import Tokenizer
from ..runs.load import LoadedRun
from ..sampling import StepModel, choose_next
from .language_model import DEFAULT_NEW_TOKENS, ContextLimit, check_characters, context_limit, continue_text, new_tokens

#: The question :meth:`Chat.check` renders to try the template before the first real one.
PROBE = "Hello"


def run_template(run: LoadedRun, name: str) -> ChatTemplate:
    """The chat template of ``run`` (named ``name`` in errors), with its tokenizer's special pieces.

    :raises UserError: the run has none (saying how to give one), or it does not parse.
    """
    text = run.cfg.data.chat_template
    if not text:
        raise UserError(f"{name} has no chat template: set data.chat_template (a Jinja template, or a file holding "
                        f"one) in its config.yaml, or import a checkpoint that ships one (`attnkit generate` "
                        f"continues plain text)")
    if run.run_dir is None:
        raise ValueError("a chat needs the run's directory (its tokenizer files)")
    return ChatTemplate(text, f"{name}: data.chat_template", special_tokens(run.tok, run.run_dir))


def encode_rendered(tok: Tokenizer, text: str) -> list[int]:
    """The ids of a rendered conversation, without what the tokenizer adds to every text (Llama's ``<s>`` in
    front): the template writes those itself (``{{ bos_token }}``), and transformers encodes the rendered text with
    ``add_special_tokens=False``."""
    ids = tok.encode_src([text])[0]
    added = tok.encode_src([""])[0]  # what the tokenizer puts around any text: at most a start token (attnkit's)
    return ids[len(added):] if added and ids[:len(added)] == added else ids


def conversation_ids(tok: Tokenizer, template: ChatTemplate, messages: Sequence[Mapping[str, str]],
                     limit: ContextLimit | None, max_new_tokens: int | None = None, *, beyond_context: bool = False,
                     default: int = DEFAULT_NEW_TOKENS) -> tuple[list[int], int]:
    """The ids the model continues to answer the last message of ``messages`` (rendered up to the assistant's turn,
    :func:`encode_rendered`), and the tokens to generate (:func:`~attnkit.inference.language_model.new_tokens`): the
    whole conversation, or an error; what to leave out is the caller's choice (:class:`Chat` drops old turns).

    :raises UserError: the template cannot render it, it renders to nothing, a character is not in a character
        vocabulary, or it does not fit ``limit`` with the answer's budget.
    """
    text = template.render(messages)
    ids = encode_rendered(tok, text)
    if not ids:
        raise UserError(f"{template.where}: the chat template renders this conversation as no text")
    check_characters(tok, text, ids, "the conversation")
    return ids, new_tokens(len(ids), limit, max_new_tokens, beyond_context=beyond_context, default=default,
                           what="the conversation")


class Chat:
    """One conversation with a language-model run (module doc).

    :param run: a ``task: lm`` run; ``template`` its :func:`run_template`.
    :param system: the system message, if any (kept when old turns are dropped).
    :param max_new_tokens: the most tokens of one answer (and the room kept for it in the model's positions); None:
        :data:`~attnkit.inference.language_model.DEFAULT_NEW_TOKENS`, or less where the positions hold less.
    :param sampling: ``temperature``, ``top_k``, ``top_p`` of :func:`~attnkit.sampling.choose_next`.
    :param decoder: what generates and how it chooses (:func:`attnkit.engine.generation_decoder`; default: the run's
        model and :func:`~attnkit.sampling.choose_next`).
    """

    def __init__(self, run: LoadedRun, template: ChatTemplate, *, system: str | None = None,
                 max_new_tokens: int | None = None, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None,
                 decoder: tuple[StepModel, Callable[..., torch.Tensor]] | None = None) -> None:
        self.run, self.template, self.system = run, template, system
        self.decoder, self.choose = decoder or (run.model, choose_next)
        self.asked = max_new_tokens
        self.max_new_tokens = max_new_tokens or DEFAULT_NEW_TOKENS  # the budget of the next answer (prompt() sets it)
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        self.generator = generator
        self.stop_ids, self.stop = end_of_turn(run.tok, run.cfg.data.end_of_turn)
        self.positions: int = context_limit(run).length  # a table's rows, or the context it was trained on
        self.turns: list[tuple[str, str]] = []  # (question, answer), oldest first
        self.dropped = 0  # turns dropped for the last question, to fit the model's positions

    def reset(self) -> None:
        """Forget the questions and answers (not the system message)."""
        self.turns = []

    def messages(self, turns: list[tuple[str, str]], question: str) -> list[dict[str, str]]:
        """The conversation as the template reads it: system message, ``turns``, then ``question``."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for asked, answered in turns:
            out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
        return out + [{"role": "user", "content": question}]

    def check(self) -> None:
        """Render a first question (:data:`PROBE`): a template that cannot render this conversation (a system
        message it does not take, say) is an error before the first real question."""
        self.template.render(self.messages([], PROBE))

    def prompt(self, question: str) -> list[int]:
        """The ids the model continues to answer ``question``: the conversation, less its oldest turns if it does
        not fit the model's positions with the answer's budget (:attr:`dropped` says how many).

        :raises UserError: the question alone (with the system message) leaves no room for the answer.
        """
        budget = self.asked or DEFAULT_NEW_TOKENS
        for start in range(len(self.turns) + 1):
            text = self.template.render(self.messages(self.turns[start:], question))
            ids = encode_rendered(self.run.tok, text)
            room = self.positions - len(ids)
            if self.asked is None and start == len(self.turns) and 0 < room < budget:
                budget = room  # the default's budget shrinks to what fits, rather than refusing
            if len(ids) + budget <= self.positions:
                self.max_new_tokens = budget
                check_characters(self.run.tok, text, ids, "the conversation")
                self.turns, self.dropped = self.turns[start:], start
                return ids
        system = " with the system message" if self.system is not None else ""
        raise UserError(f"the question ({len(ids)} tokens in the template{system}) and --max-new-tokens "
                        f"{budget} exceed the model's {self.positions} positions; ask a shorter "
                        f"question or for fewer tokens")

    def answer(self, question: str) -> Iterator[str]:
        """The answer to ``question``, as text pieces as they are generated; the answer (so far, if the caller
        stops early) joins the conversation.

        :raises UserError: now, before any piece: the question does not fit (:meth:`prompt`).
        """
        return self._stream(question, self.prompt(question))

    def _stream(self, question: str, ids: list[int]) -> Iterator[str]:
        pieces: list[str] = []
        try:
            for piece in continue_text(self.decoder, self.run.tok, ids, self.max_new_tokens, stop=self.stop,
                                       stop_ids=self.stop_ids, generator=self.generator, choose=self.choose,
                                       **self.sampling):
                pieces.append(piece)
                yield piece
        finally:
            self.turns.append((question, "".join(pieces)))
