"""Command line: ``attnkit COMMAND``, one of demo, prepare, train, translate, generate, chat, evaluate, classify,
attention, export, import and serve.

User errors (:class:`~attnkit.common.errors.UserError`), bad options included, print one line
``attnkit: error: ...`` and exit with status 2, without a traceback. Warnings (an input line
cut to the model's length) print ``attnkit: warning: ...`` on standard error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..common.errors import UserError
from . import (
    attention,
    chat,
    classify,
    demo,
    evaluate,
    export,
    generate,
    import_model,
    prepare,
    serve,
    train,
    translate,
)

EXAMPLES = """examples:
  attnkit demo                                   # train on generated dates (a few minutes), print exact match
  attnkit prepare configs/multi30k-de-en.yaml --run-dir runs/de-en   # optional: train prepares when needed
  attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en
  attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en --resume train.max_updates=30000
  torchrun --standalone --nproc_per_node=2 -m attnkit train configs/multi30k-de-en.yaml --run-dir runs/de-en
  attnkit translate runs/de-en -i test.de -o test.hyp.en --beam 4
  attnkit evaluate runs/de-en --src test.de --ref test.en
  attnkit train configs/shakespeare-char.yaml --run-dir runs/shakespeare      # a character-level GPT
  attnkit generate runs/shakespeare --prompt "ROMEO:" --max-new-tokens 120 --temperature 0.8 --seed 1
  attnkit evaluate runs/shakespeare --data held-out.txt                        # loss, perplexity, bits/char
  attnkit classify runs/sst2 -i reviews.txt --with-attention
  attnkit attention runs/de-en --src "Ein Hund rennt." -o attn/ --html
  attnkit export runs/de-en --to ctranslate2 -o runs/de-en-ct2 --quantization int8
  attnkit translate runs/de-en-ct2 -i test.de -o test.hyp.en
  attnkit export runs/de-en --to huggingface -o runs/de-en-hf   # MarianMTModel.from_pretrained reads it
  attnkit import opus-mt-de-en/ -o runs/opus-de-en        # a downloaded Hugging Face Marian or BERT directory
  attnkit import SmolLM2-135M-Instruct/ -o runs/smol      # a downloaded GPT-2, Llama, Mistral or Qwen2 directory
  attnkit chat runs/smol --system "Answer briefly."       # its chat template; /reset, Ctrl-D to leave
  attnkit serve runs/de-en runs/sst2 --port 8000          # HTTP API + a page at http://127.0.0.1:8000/
"""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as :class:`UserError`: one line, exit status 2, like every other user error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see `{self.prog} --help`)")



#: The commands in the order ``--help`` lists them; each module has ``add(subparsers)`` and ``run(args)``.
COMMANDS = {"demo": demo, "prepare": prepare, "train": train, "translate": translate, "generate": generate,
            "chat": chat, "evaluate": evaluate,
            "classify": classify, "attention": attention, "export": export, "import": import_model, "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Attention and the Transformer: train translation, classification and language models on a CPU, "
                    "translate with beam search, score with sacreBLEU, and look at what attention learned.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add(sub)
    return parser


class _WarningLine(logging.Handler):
    """attnkit's warnings as ``attnkit: warning: ...`` lines on the current standard error."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"attnkit: warning: {record.getMessage()}", file=sys.stderr)



def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    logger = logging.getLogger("attnkit")
    if not any(isinstance(h, _WarningLine) for h in logger.handlers):
        logger.addHandler(_WarningLine(logging.WARNING))
    try:
        # KEY=VALUE overrides may also follow options (`train c.yaml --run-dir r --resume train.lr=1e-3`),
        # which argparse alone rejects once the positional list has been consumed before the options.
        args, extra = parser.parse_known_args(argv)
        if extra:
            if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
                args.overrides += extra
            else:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
        COMMANDS[args.command].run(args)
    except UserError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted; `attnkit train ... --resume` continues from the last checkpoint",
              file=sys.stderr)
        return 130
    return 0



if __name__ == "__main__":
    sys.exit(main())
