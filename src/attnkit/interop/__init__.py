"""Crossing to and from Hugging Face: real pretrained models in attnkit, attnkit's models outside it.

=============================  ==========================================  ===============================
 direction                     what                                        module
=============================  ==========================================  ===============================
 ``attnkit import DIR -o RUN``  ``model_type: marian`` -> translation run   ``interop/marian.py``
                               ``model_type: bert`` -> classification or   ``interop/bert.py``
                               pretraining run
 ``attnkit export RUN --to      a translation run -> a ``MarianMTModel`` /  ``interop/marian.py``
 huggingface -o DIR``           ``MarianTokenizer`` directory
=============================  ==========================================  ===============================

An import writes an ordinary run directory (config, tokenizer, ``imported.safetensors``): every command
works on it unchanged. Nothing is downloaded and transformers is not needed: :mod:`attnkit.interop.hf`
reads the directory's JSON, safetensors and tokenizer files itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..common.errors import UserError
from .bert import import_bert
from .hf import HFDirectory
from .marian import export_marian, import_marian

__all__ = ["IMPORTERS", "export_marian", "import_model"]

#: ``config.json``'s ``model_type`` -> the function that writes its run.
IMPORTERS: dict[str, Callable[..., Path]] = {"marian": import_marian, "bert": import_bert}


def import_model(source: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the attnkit run of the Hugging Face model directory ``source`` into ``out`` -> ``out``."""
    hf = HFDirectory(source)
    if hf.model_type not in IMPORTERS:
        raise UserError(f"{hf.path / 'config.json'}: key 'model_type' is {hf.model_type!r}; attnkit imports "
                        f"{', '.join(IMPORTERS)}")
    return IMPORTERS[hf.model_type](hf, out, force=force)
