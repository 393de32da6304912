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
``gguf`` package and becomes such a directory first (:func:`import_gguf`, :mod:`attnkit.interop.gguf`).
Which family a checkpoint is, and how each is mapped, is :data:`attnkit.interop.families.FAMILIES`; which runs
export, :attr:`attnkit.tasks.TaskSpec.exporters`.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ..common.errors import UserError
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..runs.layout import CONFIG_FILE, find_weights
from ..tasks import spec
from .causal_lm import HF_REFUSAL, TOKENIZER_CONFIG_JSON, TOKENIZER_JSON, export_causal_lm, import_causal_lm
from .families import FAMILIES, family, gguf_family
from .gguf import END_TOKENS, GENERATION_CONFIG
from .gguf_file import GGUFFile, is_gguf
from .gguf_tokenizer import gguf_tokenizer
from .hf import CONFIG, HFDirectory
from .marian import export_marian
from .peft import export_peft_adapters

__all__ = ["FAMILIES", "export_causal_lm", "export_huggingface", "export_marian", "export_peft_adapters", "import_gguf",
           "import_model"]


def import_model(source: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the attnkit run of the Hugging Face model directory, or the GGUF file, ``source`` into ``out`` ->
    ``out``."""
    if not Path(source).is_dir() and is_gguf(source):
        return import_gguf(source, out, force=force)
    hf = HFDirectory(source)
    found = family(hf)
    if found.importer is not None:
        return found.importer(hf, out, force=force)
    return import_causal_lm(hf, out, found, force=force)


class _Converted(HFDirectory):
    """The Hugging Face directory a GGUF became: its JSON files on disk, its weights in memory."""

    def __init__(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        super().__init__(path)
        self._state = state

    def weights(self) -> dict[str, torch.Tensor]:
        return self._state


def import_gguf(source: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the ``task: lm`` run of the GGUF file ``source`` into ``out`` -> ``out``: read as the Hugging Face
    checkpoint of its family (:attr:`~attnkit.interop.families.FamilySpec.gguf_reader`, :mod:`.gguf_tokenizer`),
    which the Hugging Face import then reads."""
    g = GGUFFile(source)
    found = gguf_family(g)
    config, state = found.gguf_reader(g)
    config = {"model_type": found.model_type, "architectures": [found.architectures[0]], **config}
    tokenizer_json, settings = gguf_tokenizer(g, config["vocab_size"])
    files = {CONFIG: config, TOKENIZER_CONFIG_JSON: settings}
    ends = list(dict.fromkeys(g.value(f"tokenizer.ggml.{end}_token_id", int) for end in END_TOKENS
                              if g.has(f"tokenizer.ggml.{end}_token_id")))
    if len(ends) > 1:  # an instruct model's end of turn beside its end of text: listed as transformers lists them
        files[GENERATION_CONFIG] = {"eos_token_id": ends}
    with tempfile.TemporaryDirectory(prefix="attnkit-gguf-") as tmp:
        directory = Path(tmp)
        for name, value in files.items():
            (directory / name).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        (directory / TOKENIZER_JSON).write_text(tokenizer_json, encoding="utf-8")
        try:
            return import_causal_lm(_Converted(directory, state), out, found, force=force, source=g.path)
        except UserError as e:  # a check of the Hugging Face import names the GGUF, not the passing directory
            if str(directory) not in str(e):
                raise
            raise UserError(f"{g.path}: {str(e).replace(f'{directory}/', 'as Hugging Face ')}") from None


def export_huggingface(run: str | Path, out: str | Path, *, adapters: bool = False, **options) -> Path:
    """Write the Hugging Face directory of run ``run`` into ``out``: Marian for a translation run, GPT-2 or Llama
    (Mistral, Qwen2) for a language model, an adapted one's adapters merged; with ``adapters`` the adapters alone,
    as PEFT's (:mod:`attnkit.interop.peft`) (``options``: ``quantization``, ``force``) -> ``out``; a run of a task
    without this target (:attr:`~attnkit.tasks.TaskSpec.exporters`) is refused."""
    run_dir, _ = find_weights(Path(run))
    name = load_config(RunConfig, run_dir / CONFIG_FILE).task
    task = spec(name)
    if "huggingface" not in task.exporters:
        raise UserError(f"{run} is a {name} run; {HF_REFUSAL}")
    if adapters:
        if options.get("quantization", "float32") != "float32":
            raise UserError(f"--quantization {options['quantization']} is for CTranslate2; PEFT adapters are float32")
        return export_peft_adapters(run, out, force=options.get("force", False))
    write = export_causal_lm if task.generates else export_marian
    return write(run, out, **options)
