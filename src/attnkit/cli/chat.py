"""Chat with a language model (task: lm) in the terminal, each answer streamed as it is generated.

The conversation is laid out by the run's chat template (data.chat_template: an imported instruct model keeps its
checkpoint's; a run trained here takes one in its config), rendered as transformers' apply_chat_template renders it.
An answer ends at the model's end of turn (its <|im_end|>, <|eot_id|>, </s>: data.end_of_turn), or after
--max-new-tokens. The conversation is kept within the model's positions: when the next question and the answer's
budget no longer fit, the oldest turns are dropped (the system message stays).

Type a question and press Enter (one line per question); /reset starts the conversation again; Ctrl-D (end of input)
leaves. Questions may also come one per line on standard input (answers one per line on standard output).
--once QUESTION answers one question and exits, for scripts. The sampling options are `attnkit generate`'s:
--temperature 0 is greedy decoding, and a --seed gives the same conversation every time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch

from ..common.errors import UserError
from ..engine import generation_decoder
from ..inference.chat import Chat, run_template
from ..inference.language_model import DEFAULT_NEW_TOKENS, MAX_NEW_TOKENS, check_sampling
from ..tasks import load_run, require
from .options import add_device_option, add_engine_options, add_sampling_options, engine_of, number, pick_device

HELP = "chat with a language model (its chat template), streamed"
#: What the terminal shows before each question.
PROMPT = ">>> "
RESET = "/reset"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="language-model run directory (task: lm) with a chat template, or a .safetensors "
                                 "checkpoint inside one")
    p.add_argument("--system", help="the system message: instructions the model reads before the conversation")
    p.add_argument("--once", metavar="QUESTION", help="answer this one question, then exit")
    p.add_argument("--max-new-tokens", type=number(int),
                   help=f"the most tokens of one answer, 1..{MAX_NEW_TOKENS} (default {DEFAULT_NEW_TOKENS}, or what "
                        "the model's positions leave after the question)")
    add_sampling_options(p)
    add_device_option(p, "the model (the same --seed gives the same answers on the same device)")
    add_engine_options(p, "eager, and each token through a step compiled ahead of time with a static cache")


def run(args: argparse.Namespace) -> None:
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens is not None and not 0 < args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    if args.once is not None and not args.once.strip():
        raise UserError("--once needs a question")
    engine = engine_of(args, compiled=True)
    lm = require(load_run(args.model, pick_device(args.device), engine), "generate", args.model)
    template = run_template(lm, args.model)
    generator = torch.Generator(device=next(lm.model.parameters()).device).manual_seed(args.seed)
    chat = Chat(lm, template, system=args.system, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, generator=generator,
                decoder=generation_decoder(lm.model, engine))
    chat.check()
    if args.once is not None:
        _show(chat.answer(args.once))
        return
    _converse(chat, interactive=sys.stdin.isatty())


def _show(pieces: Iterator[str]) -> None:
    """Write an answer to standard output as its pieces come, then end its line."""
    out = sys.stdout
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()


def _questions(interactive: bool) -> Iterator[str]:
    """The lines typed (after :data:`PROMPT`, with line editing) or read from standard input, until its end (Ctrl-D)
    or, in a terminal, Ctrl-C."""
    if interactive:
        try:
            import readline  # noqa: F401  (input() gains line editing and a history of questions)
        except ImportError:  # not on every platform
            pass
    while True:
        try:
            line = input(PROMPT) if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stdout)  # the shell's prompt on a line of its own
            return
        if not interactive and not line:
            return
        yield line.rstrip("\r\n")


def _converse(chat: Chat, interactive: bool) -> None:
    """Answer each question; ``/reset`` forgets the conversation. An error about one question (too long for the
    model) is reported and the conversation goes on; Ctrl-C in a terminal stops the answer being written."""
    if interactive:
        print(f"attnkit chat: {RESET} starts the conversation again, Ctrl-D leaves", file=sys.stderr)
    for question in _questions(interactive):
        if not question.strip():
            continue
        if question.strip() == RESET:
            chat.reset()
            print("(the conversation starts again)", file=sys.stderr)
            continue
        try:
            answer = chat.answer(question)
        except UserError as e:
            print(f"attnkit: error: {e}", file=sys.stderr)
            continue
        if chat.dropped:
            print(f"(the oldest {chat.dropped} turn(s) no longer fit the model's {chat.positions} positions: "
                  f"dropped)", file=sys.stderr)
        try:
            _show(answer)
        except KeyboardInterrupt:
            if not interactive:
                raise
            answer.close()  # type: ignore[attr-defined]  (a generator: what was written joins the conversation)
            print(file=sys.stdout)
