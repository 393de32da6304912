"""Export a Transformer translation run: to CTranslate2 (model.bin, vocabulary, the SentencePiece model(s)
and attnkit-export.json; `attnkit translate OUT` reads it), or to Hugging Face (a MarianMTModel and
MarianTokenizer directory that transformers' from_pretrained reads). RNN runs and classifiers cannot be
exported.
"""

from __future__ import annotations

import argparse

from ..export import TARGETS, export
from ..export.ctranslate2 import QUANTIZATIONS

HELP = "export a Transformer translation run to CTranslate2 or Hugging Face"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help=HELP, description=__doc__)
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--to", required=True, choices=list(TARGETS),
                   help="ctranslate2 (its inference engine) or huggingface (Marian)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the directory to write")
    p.add_argument("--quantization", default="float32", choices=list(QUANTIZATIONS),
                   help="weights of a CTranslate2 export (default: float32; huggingface: float32)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> None:
    print(export(args.model, args.to, args.output, quantization=args.quantization, force=args.force))
