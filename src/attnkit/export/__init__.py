"""Leaving attnkit: export targets for a trained run, and translating with what they wrote.

=================  ===============================================  ===========================
``--to``           writes                                           module
=================  ===============================================  ===========================
``ctranslate2``    a CTranslate2 model directory (float32, int8,    ``export/ctranslate2.py``
                   int8_float32 or bfloat16 weights) + tokenizer;
                   for a language model a ``Generator`` one         ``export/ctranslate2_lm.py``
``huggingface``    a ``MarianMTModel`` + ``MarianTokenizer``        ``interop/marian.py``
                   directory (float32); for a language model a      ``interop/causal_lm.py``
                   ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` one
                   (an adapted run merged), or with ``--adapters``  ``interop/peft.py``
                   its LoRA adapters as PEFT's
=================  ===============================================  ===========================

:data:`TARGETS` maps ``--to`` to its exporter; a new target is a module here, one line there and its name in the
``exporters`` of the tasks it writes (:attr:`attnkit.tasks.TaskSpec.exporters`).
:func:`open_translator` is how ``translate``, ``evaluate`` and ``serve`` open what the user named: a
run directory (decoded by attnkit's engine) or an export (decoded by its engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from ..engine import Engine
from ..inference.translate import translate_texts
from ..interop import export_huggingface
from ..runs.load import LoadedRun
from ..tasks import load_run, spec
from .ctranslate2 import CT2_REFUSAL, ExportedTranslator, check_quantization, export_translation, is_exported
from .ctranslate2_lm import export_language_model

__all__ = ["TARGETS", "Translator", "export", "export_to_ctranslate2", "is_exported", "open_translator"]


def export_to_ctranslate2(run: str | Path, out: str | Path, *, quantization: str = "float32",
                          force: bool = False) -> Path:
    """``--to ctranslate2``: a run whose task generates text (a language model) as a ``ctranslate2.Generator`` model
    (:mod:`.ctranslate2_lm`), a translation run as a ``Translator`` one (:mod:`.ctranslate2`, which refuses what it
    cannot export); a run of a task without this target is refused."""
    check_quantization(quantization)
    loaded = load_run(run)
    task = spec(loaded.task)
    if "ctranslate2" not in task.exporters:
        raise UserError(f"{run} is a {loaded.task} run; {CT2_REFUSAL}")
    if task.generates:
        return export_language_model(loaded, out, quantization=quantization, force=force)
    return export_translation(loaded, run, out, quantization=quantization, force=force)


#: ``attnkit export --to NAME``: the function that writes it, ``(run, out, *, quantization, force) -> out``.
TARGETS: dict[str, Callable[..., Path]] = {"ctranslate2": export_to_ctranslate2, "huggingface": export_huggingface}


def export(run: str | Path, to: str, out: str | Path, *, adapters: bool = False, **options) -> Path:
    """Export run ``run`` to the target ``to`` in ``out`` (options as the target takes them; ``adapters``: an
    adapted run's LoRA adapters alone, in PEFT's format, for ``huggingface``) -> ``out``."""
    if adapters and to != "huggingface":
        raise UserError("--adapters writes PEFT's adapter files, a Hugging Face format: use --to huggingface")
    return TARGETS[to](run, out, **({"adapters": True} if adapters else {}), **options)


@dataclass
class Translator:
    """Something that translates: a run (``run`` set) or an export (``exported`` set), with its decode defaults.

    ``translate(texts, *, beam, lenpen, n_best=1, batch_size=64, max_len_a, max_len_b)`` gives ``n_best``
    translations per text, in input order, as :func:`attnkit.inference.translate.translate_texts` does.
    """

    translate: Callable[..., list[list[str]]]
    beam: int
    lenpen: float
    run: LoadedRun | None = None
    exported: ExportedTranslator | None = None


def open_translator(path: str | Path, *, threads: int = 0, engine: Engine | None = None) -> Translator:
    """A :class:`Translator` for a run directory (or a checkpoint in one) or an ``attnkit export`` directory.

    :param threads: CPU threads of an export's engine (0: its default); a run uses torch's.
    :param engine: how a run's model runs (default :class:`~attnkit.engine.Engine`'s); an export computes as it was
        exported, so it takes none.
    """
    if is_exported(path):
        if engine is not None and engine != Engine():
            raise UserError(f"--engine / --precision / --quantize: {path} is a CTranslate2 export, which computes as "
                            "it was exported (attnkit export --quantization); drop them or give the run")
        exported = ExportedTranslator(path, threads=threads)
        return Translator(exported.translate, exported.decode.beam, exported.decode.lenpen, exported=exported)
    run = load_run(path, engine=engine)

    def translate(texts: list[str], **options) -> list[list[str]]:
        return translate_texts(run.model, run.tok, texts, **options)

    return Translator(translate, run.cfg.decode_beam, run.cfg.decode_lenpen, run=run)
