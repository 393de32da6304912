"""Export a Transformer translation run or a language model (task: lm): to CTranslate2 (model.bin, vocabulary,
the tokenizer files and attnkit-export.json; `attnkit translate OUT` reads a translation export, `attnkit
generate OUT` a language model's; an option CTranslate2 cannot represent is refused), or to Hugging Face
(a MarianMTModel and MarianTokenizer directory for a translation run; a GPT2LMHeadModel directory for a
language model with learned positions, LayerNorm and biases, a LlamaForCausalLM one (MistralForCausalLM with a
window, Qwen2ForCausalLM with qkv_bias) for RoPE, RMSNorm and SwiGLU, each with a tokenizer.json; transformers'
from_pretrained reads them, and an option without a Hugging Face equivalent is refused). A LoRA run (model.lora)
is exported with its adapters merged into its base's weights, or with --adapters as the adapters alone in PEFT's
format (adapter_config.json, adapter_model.safetensors: peft.PeftModel.from_pretrained puts them on the base
model). RNN runs and classifiers cannot be exported.
"""

from __future__ import annotations

import argparse

from ..export import TARGETS, export
from ..export.ctranslate2 import QUANTIZATIONS

HELP = "export a Transformer translation run or a language model to CTranslate2 or Hugging Face"


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help=HELP, description=__doc__)
    p.add_argument("model", help="run directory or a .safetensors checkpoint inside one")
    p.add_argument("--to", required=True, choices=list(TARGETS),
                   help="ctranslate2 (its inference engine) or huggingface (Marian, GPT-2, Llama, Mistral, Qwen2)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the directory to write")
    p.add_argument("--quantization", default="float32", choices=list(QUANTIZATIONS),
                   help="weights of a CTranslate2 export (default: float32; huggingface: float32)")
    p.add_argument("--adapters", action="store_true",
                   help="huggingface: a LoRA run's adapters alone, as PEFT's adapter_config.json and "
                        "adapter_model.safetensors (default: the model, adapters merged)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> None:
    print(export(args.model, args.to, args.output, adapters=args.adapters, quantization=args.quantization,
                 force=args.force))
