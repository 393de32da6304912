"""Make an attnkit run from a local Hugging Face model directory or GGUF file: a Marian (OPUS-MT) translation
model becomes a translation run; a BERT sequence classifier a classification run; a bare or masked-LM BERT a
pretraining run that a classification config fine-tunes with model.init_from; a causal language model (GPT-2,
Llama, Mistral, Qwen2) a language-model run (task: lm) that generate, evaluate and attention read and a task: lm
config trains further with model.init_from, its tokenizer.json read by the tokenizers library. A GGUF file
(llama.cpp's format; architecture llama, qwen2 or gpt2) becomes the same kind of run: its weights dequantized to
float32 (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, ...), its tokenizer.ggml metadata rebuilt as a
tokenizers pipeline. A config attnkit cannot represent (RoPE scaling, cross-attention, another activation, a
sliding window in some layers only, ...) is refused, naming the file and key. Nothing is downloaded.
"""

from __future__ import annotations

import argparse

from ..interop import import_model

HELP = "make a run from a Hugging Face Marian, BERT, GPT-2, Llama, Mistral or Qwen2 directory, or a GGUF file"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help=HELP, description=__doc__)
    p.add_argument("source", metavar="DIR|FILE.gguf", help="a local Hugging Face model directory (config.json, "
                   "model.safetensors or pytorch_model.bin, tokenizer files), or a GGUF file")
    p.add_argument("-o", "--output", required=True, metavar="RUN_DIR", help="the run directory to write")
    p.add_argument("--force", action="store_true", help="replace RUN_DIR if it is an earlier import")


def run(args: argparse.Namespace) -> None:
    print(import_model(args.source, args.output, force=args.force))
