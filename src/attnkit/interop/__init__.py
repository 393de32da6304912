"""Crossing to and from Hugging Face: real pretrained models in attnkit, attnkit's models outside it.

=============================  ==========================================  ===============================
 direction                     what                                        module
=============================  ==========================================  ===============================
 ``attnkit import DIR -o RUN``  ``model_type: marian`` -> translation run   ``interop/marian.py``
                               ``model_type: bert`` -> classification or   ``interop/bert.py``
                               pretraining run
                               ``model_type: gpt2`` -> language-model run  ``interop/gpt2.py``,
                               (``task: lm``)                              ``interop/causal_lm.py``
                               ``model_type: llama``, ``mistral``,         ``interop/llama.py``,
                               ``qwen2`` -> language-model run             ``interop/causal_lm.py``
 ``attnkit import FILE.gguf     a GGUF of ``llama``, ``qwen2`` or ``gpt2``   ``interop/gguf.py``,
 -o RUN``                      -> language-model run, through the          ``interop/gguf_tokenizer.py``
                               Hugging Face import
 ``attnkit export RUN --to      a translation run -> a ``MarianMTModel`` /  ``interop/marian.py``
 huggingface -o DIR``           ``MarianTokenizer`` directory
                               a language-model run -> a                   ``interop/causal_lm.py``
                               ``GPT2LMHeadModel`` or ``LlamaForCausalLM``
                               (``MistralForCausalLM``,
                               ``Qwen2ForCausalLM``) directory with its
                               ``tokenizer.json`` (an adapted run merged)
 ``attnkit export RUN --to      an adapted run's LoRA adapters -> PEFT's    ``interop/peft.py``
 huggingface --adapters``       ``adapter_config.json`` and
                               ``adapter_model.safetensors``
=============================  ==========================================  ===============================

An import writes an ordinary run directory (config, tokenizer, ``imported.safetensors``): every command
works on it unchanged. Nothing is downloaded and transformers is not needed: :mod:`attnkit.interop.hf`
reads the directory's JSON, safetensors and tokenizer files itself (a causal language model's
``tokenizer.json`` through the ``tokenizers`` library); a GGUF file (llama.cpp's format) is read with the
``gguf`` package and becomes such a directory first (:mod:`attnkit.interop.gguf`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..common.errors import UserError
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..runs.layout import CONFIG_FILE, find_weights
from .bert import import_bert
from .causal_lm import export_causal_lm, import_causal_lm
from .gguf import import_gguf
from .gguf_file import is_gguf
from .hf import HFDirectory
from .marian import export_marian, import_marian
from .peft import export_peft_adapters

__all__ = ["EXPORTERS", "IMPORTERS", "export_causal_lm", "export_huggingface", "export_marian", "export_peft_adapters",
           "import_gguf", "import_model"]

#: ``config.json``'s ``model_type`` -> the function that writes its run.
IMPORTERS: dict[str, Callable[..., Path]] = {"marian": import_marian, "bert": import_bert, "gpt2": import_causal_lm,
                                             "llama": import_causal_lm, "mistral": import_causal_lm,
                                             "qwen2": import_causal_lm}
#: A run's ``task`` -> the function that writes its Hugging Face directory.
EXPORTERS: dict[str, Callable[..., Path]] = {"translate": export_marian, "lm": export_causal_lm}


def import_model(source: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the attnkit run of the Hugging Face model directory, or the GGUF file, ``source`` into ``out`` ->
    ``out``."""
    if not Path(source).is_dir() and is_gguf(source):
        return import_gguf(source, out, force=force)
    hf = HFDirectory(source)
    if hf.model_type not in IMPORTERS:
        raise UserError(f"{hf.path / 'config.json'}: key 'model_type' is {hf.model_type!r}; attnkit imports "
                        f"{', '.join(IMPORTERS)}")
    return IMPORTERS[hf.model_type](hf, out, force=force)


def export_huggingface(run: str | Path, out: str | Path, *, adapters: bool = False, **options) -> Path:
    """Write the Hugging Face directory of run ``run`` into ``out``: Marian for a translation run, GPT-2 or Llama
    (Mistral, Qwen2) for a language model, an adapted one's adapters merged; with ``adapters`` the adapters alone,
    as PEFT's (:mod:`attnkit.interop.peft`) (``options``: ``quantization``, ``force``) -> ``out``."""
    run_dir, _ = find_weights(Path(run))
    task = load_config(RunConfig, run_dir / CONFIG_FILE).task
    if adapters:
        if options.get("quantization", "float32") != "float32":
            raise UserError(f"--quantization {options['quantization']} is for CTranslate2; PEFT adapters are float32")
        return export_peft_adapters(run, out, force=options.get("force", False))
    if task not in EXPORTERS:
        raise UserError(f"{run} is a {task} run; only translation and language-model runs can be exported to "
                        f"Hugging Face")
    return EXPORTERS[task](run, out, **options)
