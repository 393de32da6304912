"""What ``attnkit serve`` serves: a model behind one small interface, whatever runs it.

============================  ==========================================================================
servable                      what it is, and what runs it
============================  ==========================================================================
:class:`RunServable`          a run directory of ``attnkit train`` (translation, classification or a
                              language model), run by attnkit itself; what it serves is its task's
                              ``serves`` (:attr:`attnkit.tasks.TaskSpec.serves`); a language model
                              generates by continuous batching (:mod:`attnkit.serve.generation`)
:class:`ExportedServable`     a translation directory of ``attnkit export --to ctranslate2``, run by
                              CTranslate2 (:class:`attnkit.export.ctranslate2.ExportedTranslator`)
:class:`ExportedGeneration`   a language model's such directory, run by CTranslate2
                              (:class:`attnkit.export.ctranslate2_lm.ExportedGenerator`): requests that
                              arrive together with the same options run as one batch
============================  ==========================================================================

:func:`load_servable` tells the two apart; :class:`ModelInfo` is what ``GET /models`` says of each.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path
from typing import Literal, Protocol

import torch

from ..common.errors import UserError
from ..data.chat_template import ChatTemplate, end_of_turn
from ..engine import Engine
from ..engine.compiled_decoding import CompiledDecoder
from ..engine.continuous import ContinuousGreedy, Finished, supports_continuous
from ..export import is_exported
from ..export.ctranslate2 import MANIFEST, ExportedTranslator
from ..export.ctranslate2_lm import ExportedGenerator
from ..inference.attention_maps import AttentionMaps
from ..inference.chat import conversation_ids, run_template
from ..inference.classify import predict
from ..inference.language_model import context_limit, prompt_ids
from ..inference.translate import encode_sources, source_limit, translate_texts
from ..runs.layout import find_weights
from ..runs.load import LoadedRun, languages
from ..tasks import attention_maps, load_run, served_by, spec
from ..vocab import EOS_ID
from .generation import ContinuousGeneration, ContinuousStepper, Generated, GenerationJob, generate_exported

__all__ = ["ContinuousTranslation", "ExportedGeneration", "ExportedServable", "ModelInfo", "RunServable", "Servable",
           "load_servable"]


@dataclass(frozen=True)
class ModelInfo:
    """What ``GET /models`` tells about a model."""

    name: str
    task: Literal["translate", "classify", "generate"]  # the route that serves it
    architecture: str
    source_language: str | None
    target_language: str | None
    parameters: int
    beam: int | None  # decoding defaults (translation)
    lenpen: float | None
    classes: list[str] | None  # classification
    precision: str = "eager (float32)"  # how a run runs (its Engine), or an export's quantization
    context: int | None = None  # a language model: the positions prompt + continuation fill (ContextLimit.length)
    context_fixed: bool | None = None  # a language model: its positions are a table (else the context it trained on)


class Servable(Protocol):
    """A model the server can run; :func:`load_servable` makes one from a path.

    Calls come from the model's one worker thread, never two at a time. ``translate`` returns the
    n-best list of every text, ``classify`` the class probabilities of every text (in the order of
    ``info.classes``), ``attention`` every attention map of one text (:class:`AttentionMaps`).
    Each raises :class:`UserError` for what the model cannot do. ``lengths`` is every text's length in
    source tokens (as the model's tokenizer counts them, without BOS/EOS), for the worker's
    length-aware batching; it is called from the event loop, so it must be cheap and touch no model.
    ``stepper`` (or None) decodes greedy translations continuously (:class:`ContinuousTranslation`), with
    the same output as ``translate`` with beam 1; a language model's generates continuously
    (:class:`~attnkit.serve.generation.ContinuousGeneration`). A language model's ``prompt_ids`` are a prompt's
    ids, checked (from the event loop: cheap, no model), and ``generate`` runs jobs as one batch; its
    ``attention`` shows ``target``, the continuation, after the prompt ``text``; ``seeded``: a request may give
    its own seed (a run; not a CTranslate2 export, which samples from one generator). ``chat_ids`` are the ids
    that answer a conversation (``messages``) laid out by the model's chat template, checked like ``prompt_ids``,
    and ``end_of_turn`` the ids and strings its answer stops at (``data.end_of_turn``). ``warm_up`` runs on the
    worker's thread before its first job (``attnkit serve --compile`` compiles there).
    """

    info: ModelInfo
    seeded: bool
    stepper: ContinuousTranslation | ContinuousGeneration | None
    end_of_turn: tuple[frozenset[int], tuple[str, ...]]

    def lengths(self, texts: list[str]) -> list[int]: ...
    def warm_up(self) -> None: ...
    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]: ...
    def classify(self, texts: list[str]) -> list[list[float]]: ...
    def attention(self, text: str, *, beam: int, lenpen: float, target: str | None = None) -> AttentionMaps: ...
    def prompt_ids(self, prompt: str, max_new_tokens: int | None, default: int, beyond_context: bool
                   ) -> tuple[list[int], int]: ...
    def chat_ids(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int | None, default: int,
                 beyond_context: bool) -> tuple[list[int], int]: ...
    def generate(self, jobs: list[GenerationJob]) -> list[Generated]: ...


#: A servable's ``end_of_turn`` when it has no chat template.
NO_TURNS: tuple[frozenset[int], tuple[str, ...]] = (frozenset(), ())


def _translation_info(run: LoadedRun, name: str, parameters: int) -> ModelInfo:
    source, target = languages(run.cfg)
    return ModelInfo(name=name, task="translate", architecture=run.cfg.model.arch, source_language=source,
                     target_language=target, parameters=parameters, beam=run.cfg.decode_beam,
                     lenpen=run.cfg.decode_lenpen, classes=None)


def _classification_info(run: LoadedRun, name: str, parameters: int) -> ModelInfo:
    return ModelInfo(name=name, task="classify", architecture="transformer classifier", source_language=None,
                     target_language=None, parameters=parameters, beam=None, lenpen=None, classes=run.classes)


def _generation_info(run: LoadedRun, name: str, parameters: int) -> ModelInfo:
    positions = run.cfg.model.transformer.positions
    limit = context_limit(run)
    return ModelInfo(name=name, task="generate", architecture=f"transformer language model ({positions} positions)",
                     source_language=None, target_language=None, parameters=parameters, beam=None, lenpen=None,
                     classes=None, context=limit.length, context_fixed=limit.fixed)


class RunServable:
    """A run directory of ``attnkit train`` (translation, classification or a language model), run by attnkit
    itself as its engine says (``run.engine``: :func:`~attnkit.tasks.load_run` made it so); with
    ``continuous``, a Transformer's greedy translations are batched continuously (``stepper``); a language model's
    generations always are, and in ``compiled`` mode its prompts run through a pass compiled ahead of time
    (:meth:`~attnkit.engine.compiled_decoding.CompiledDecoder.prefill`, compiled here)."""

    seeded = True  # each generation samples with its own torch.Generator

    def __init__(self, run: LoadedRun, name: str, continuous: bool = False) -> None:
        self.run = run
        task = spec(run.task)
        if task.serves is None:
            raise UserError(f"{name} is a pretraining run: it neither translates nor classifies; serve a run "
                            f"fine-tuned from it (model.init_from)")
        route = _ROUTES[task.serves]
        info = route.describe(run, name, sum(p.numel() for p in run.model.parameters()))
        self.info = replace(info, precision=str(run.engine))
        stepper = route.stepper if continuous and supports_continuous(run.model) else None
        self.stepper = stepper(self) if stepper is not None else None
        compiled = run.engine.mode == "compiled" and task.generates
        self.compiled = CompiledDecoder(run.model) if compiled else None
        self.template: ChatTemplate | None = None
        self.end_of_turn = NO_TURNS
        if task.generates:
            self.stepper = ContinuousGeneration(run.model, run.tok, self.compiled)
            if run.cfg.data.chat_template:
                self.template = run_template(run, name)
                ids, texts = end_of_turn(run.tok, run.cfg.data.end_of_turn)
                self.end_of_turn = (frozenset(ids), tuple(texts))

    def warm_up(self) -> None:
        """(The model's worker thread, before its first job.) Compile the prompt pass and the step, or load them from
        the cache of compiled code (:func:`~attnkit.engine.aot.step_cache`), for one row and for several: on the
        worker's thread, where they run, with its threads (the compiled code is made for a thread count)."""
        if self.compiled is None:
            return
        device = next(self.run.model.parameters()).device
        with torch.inference_mode():
            for rows in (1, 2):  # a batch of one is its own program; 2 stands for any more
                tokens = torch.full((rows, 8), EOS_ID, device=device)
                _, state = self.compiled.step(tokens, self.compiled.init_state())  # the prompt pass
                self.compiled.step(tokens[:, :1], state)  # one step

    def lengths(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.run.tok.encode_src(texts, threads=1)]  # SentencePiece only

    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]:
        return translate_texts(self.run.model, self.run.tok, texts, beam=beam, lenpen=lenpen, n_best=n_best)

    def classify(self, texts: list[str]) -> list[list[float]]:
        return predict(self.run, texts)[0].tolist()

    def attention(self, text: str, *, beam: int, lenpen: float, target: str | None = None) -> AttentionMaps:
        return attention_maps(self.run, text, target, beam=beam, lenpen=lenpen)

    def prompt_ids(self, prompt: str, max_new_tokens: int | None, default: int, beyond_context: bool
                   ) -> tuple[list[int], int]:
        return prompt_ids(self.run.tok, prompt, context_limit(self.run), max_new_tokens, default=default,
                          beyond_context=beyond_context)

    def chat_ids(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int | None, default: int,
                 beyond_context: bool) -> tuple[list[int], int]:
        if self.template is None:
            raise UserError(f"model {self.info.name!r} has no chat template (data.chat_template in its config.yaml; "
                            "an imported checkpoint brings its own): /v1/completions continues plain text")
        return conversation_ids(self.run.tok, self.template, messages, context_limit(self.run), max_new_tokens,
                                beyond_context=beyond_context, default=default)

    def generate(self, jobs: list[GenerationJob]) -> list[Generated]:
        return ContinuousGeneration(self.run.model, self.run.tok, self.compiled).run(jobs)


class ContinuousTranslation(ContinuousStepper):
    """A run's greedy translation by continuous batching (:class:`~attnkit.engine.continuous.ContinuousGreedy`):
    the model worker's :class:`~attnkit.serve.batching.Stepper`. Texts are encoded as
    :func:`~attnkit.inference.translate.translate_texts` encodes them (cut to the model's positions; a blank
    text translates to ``""`` without decoding); each result is a one-entry n-best list, as ``translate``'s."""

    def __init__(self, servable: RunServable) -> None:
        self.servable = servable
        self.decoder = ContinuousGreedy(servable.run.model)
        self._handles = count()
        self._ours: dict[int, int] = {}  # the decoder's handle -> ours
        self._ended: list[tuple[int, list[str]]] = []  # texts that ended at start, returned by the next step

    def start(self, texts: list[str]) -> list[int]:
        run = self.servable.run
        ids = encode_sources(run.tok, texts, source_limit(run.model))
        handles = [next(self._handles) for _ in texts]
        real = [i for i, s in enumerate(ids) if len(s) > 1]  # a blank text is </s> alone
        self._ended += [(handles[i], [""]) for i, s in enumerate(ids) if len(s) <= 1]
        inner, ended = self.decoder.add([ids[i] for i in real])
        self._ours.update(zip(inner, (handles[i] for i in real), strict=True))
        self._ended += self._texts(ended)
        return handles

    def step(self) -> list[tuple[int, list[str]]]:
        ended = self.decoder.step()
        out, self._ended = self._ended + self._texts(ended), []
        return out

    def abandon(self) -> None:
        self.decoder = ContinuousGreedy(self.servable.run.model)
        self._ours.clear()
        self._ended.clear()

    def _texts(self, ended: list[Finished]) -> list[tuple[int, list[str]]]:
        texts = self.servable.run.tok.decode_tgt([f.tokens for f in ended]) if ended else []
        return [(self._ours.pop(f.handle), [text]) for f, text in zip(ended, texts, strict=True)]


@dataclass(frozen=True)
class _Route:
    """What differs by the route that serves a run (its task's :attr:`~attnkit.tasks.TaskSpec.serves`): how ``GET
    /models`` describes it, and what decodes it continuously with ``attnkit serve --batching continuous`` (None: whole
    batches; a language model always generates continuously, :class:`~attnkit.serve.generation.ContinuousGeneration`).
    """

    describe: Callable[[LoadedRun, str, int], ModelInfo]
    stepper: Callable[[RunServable], ContinuousTranslation] | None = None


#: The routes runs are served by, by name.
_ROUTES = {"translate": _Route(_translation_info, ContinuousTranslation), "classify": _Route(_classification_info),
           "generate": _Route(_generation_info)}


class ExportedServable:
    """A directory written by ``attnkit export --to ctranslate2``, run by CTranslate2 (translation only)."""

    stepper = None  # CTranslate2 decodes whole batches
    seeded = False  # CTranslate2 samples from one generator per process
    end_of_turn = NO_TURNS

    def __init__(self, path: Path, threads: int = 0) -> None:
        self.translator = ExportedTranslator(path, threads=threads)
        source, target = self.translator.languages or (None, None)  # [src, tgt] as the export recorded them
        self.info = ModelInfo(
            name=Path(os.path.abspath(path)).name, task="translate",
            architecture=f"transformer (CTranslate2 {self.translator.quantization})",
            source_language=source, target_language=target,
            parameters=self.translator.parameters, beam=self.translator.decode.beam,
            lenpen=self.translator.decode.lenpen, classes=None, precision=self.translator.quantization)

    def lengths(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.translator.tok.encode_src(texts, threads=1)]  # the export's tokenizer

    def warm_up(self) -> None:
        """Nothing to compile: CTranslate2 runs the export as it is."""

    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]:
        d = self.translator.decode
        return self.translator.translate(texts, beam=beam, n_best=n_best, lenpen=lenpen, max_len_a=d.max_len_a,
                                         max_len_b=d.max_len_b)

    def classify(self, texts: list[str]) -> list[list[float]]:
        raise UserError(f"{self.info.name} is a translation model")

    def attention(self, text: str, *, beam: int, lenpen: float, target: str | None = None) -> AttentionMaps:
        raise UserError(f"{self.info.name} is a CTranslate2 export, which gives no attention weights; serve the run "
                        f"directory it was exported from to see them")

    def prompt_ids(self, prompt: str, max_new_tokens: int | None, default: int, beyond_context: bool
                   ) -> tuple[list[int], int]:
        raise UserError(f"{self.info.name} is a translation model")

    def chat_ids(self, messages: Sequence[Mapping[str, str]], max_new_tokens: int | None, default: int,
                 beyond_context: bool) -> tuple[list[int], int]:
        raise UserError(f"model {self.info.name!r} is a CTranslate2 export, which keeps no chat template: serve the "
                        "run directory it was exported from to chat, or use /v1/completions")

    def generate(self, jobs: list[GenerationJob]) -> list[Generated]:
        raise UserError(f"{self.info.name} is a translation model")


class ExportedGeneration(ExportedServable):
    """A language model's directory of ``attnkit export --to ctranslate2``, run by CTranslate2
    (:class:`~attnkit.export.ctranslate2_lm.ExportedGenerator`): no continuous batching, the requests that arrive
    together with the same options run as one batch (:func:`~attnkit.serve.generation.generate_exported`). Its
    samples come from CTranslate2's own random generator (one per process): a seed gives the same text every
    time, but not a run's text for that seed."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        self.generator = ExportedGenerator(path, threads=threads)
        g = self.generator
        self.info = ModelInfo(
            name=Path(os.path.abspath(path)).name, task="generate",
            architecture=f"transformer language model (CTranslate2 {g.quantization})", source_language=None,
            target_language=None, parameters=g.parameters, beam=None, lenpen=None, classes=None,
            precision=g.quantization, context=g.limit.length, context_fixed=g.limit.fixed)

    def lengths(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.generator.tok.encode_src(texts, threads=1)]

    def translate(self, texts: list[str], *, beam: int, n_best: int, lenpen: float) -> list[list[str]]:
        raise UserError(f"{self.info.name} is a language model")

    def classify(self, texts: list[str]) -> list[list[float]]:
        raise UserError(f"{self.info.name} is a language model")

    def prompt_ids(self, prompt: str, max_new_tokens: int | None, default: int, beyond_context: bool
                   ) -> tuple[list[int], int]:
        return prompt_ids(self.generator.tok, prompt, self.generator.limit, max_new_tokens, default=default,
                          beyond_context=beyond_context)

    def generate(self, jobs: list[GenerationJob]) -> list[Generated]:
        return generate_exported(self.generator, jobs)


def load_servable(path: str | Path, threads: int = 0, engine: Engine | None = None, continuous: bool = False,
                  device: torch.device | None = None) -> Servable:
    """The model at ``path``, named after its directory: a run directory (or a ``.safetensors``
    checkpoint inside one), run as ``engine`` says (:class:`RunServable`) and translating greedily by
    continuous batching when ``continuous``, or a CTranslate2 export of one (``attnkit export``),
    which computes in the quantization it was exported with (and takes no engine). A language-model run computes
    on ``device`` (default: the CPU); everything else on the CPU.

    :raises UserError: ``path`` is not something that can be served.
    """
    if is_exported(Path(path)):
        exported = ExportedGeneration if served_by(_exported_task(Path(path)), "generate") else ExportedServable
        return exported(Path(path), threads)
    run_dir, _ = find_weights(Path(path))
    run = load_run(path, engine=engine)
    if device is not None and spec(run.task).generates:
        run.model.to(device)
    return RunServable(run, Path(os.path.abspath(run_dir)).name, continuous)  # a link's own name


def _exported_task(path: Path) -> str | None:
    """The task an export's manifest names (None: unreadable; the servable's own checks then say what is wrong)."""
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("task")
    except (OSError, ValueError, AttributeError):
        return None
