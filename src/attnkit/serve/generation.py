"""Serving a language model: ``POST /generate``'s requests as the model worker sees them, and what runs them.

A request becomes a :class:`GenerationJob` (``/generate``'s, or each choice of an OpenAI-compatible one): its
prompt's ids, how to sample, its stop strings and stop ids (a chat's end of turn), and ``emit``, where its tokens go
as they come. The model's :class:`~attnkit.serve.batching.ModelWorker` (one thread, the only one
that touches the model) runs it:

==============================  ============================================================================
runs it                         how
==============================  ============================================================================
:class:`ContinuousGeneration`   a run: the worker's :class:`~attnkit.serve.batching.Stepper` over
                                :class:`~attnkit.engine.continuous_lm.ContinuousSampler`; a job's prompt is
                                run when it joins, between two steps, and its row leaves the batch when it ends
:func:`generate_exported`       a CTranslate2 export (:class:`~attnkit.export.ctranslate2_lm.ExportedGenerator`):
                                the jobs that arrive together with the same options, as one batch (a lone
                                job streams token by token)
==============================  ============================================================================

Each job's text is decoded as :func:`attnkit.inference.language_model.continue_text` decodes it (a
:class:`~attnkit.inference.language_model.TextStream`), and a run's job samples with its own
``torch.Generator`` seeded with its seed: its text is ``attnkit generate``'s for that seed, alone or batched.
``emit`` hears ``{"token": piece, "id": id}`` for every token chosen (``</s>`` and stop ids included; ``piece`` is
the text it lets show, maybe ``""``: the characters that may begin a stop string are held back), so the pieces add
up to the text. A job whose client went away (:meth:`GenerationJob.cancel`, from the event loop) leaves the batch at
the next step, its cache rows freed.

What fails for one job ends that job alone, with the exception as its result: its token could not be chosen, its
text could not be decoded or searched for its stop strings, its ``emit`` raised, or the prefill of its prompt
failed (the prompts that ran with it are tried again one by one). Only a failing decoding step fails every job
in flight (the worker abandons the batch).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Literal

import torch

from ..data.tokenizer import EOS_ID, Tokenizer
from ..engine.compiled_decoding import CompiledDecoder
from ..engine.continuous_lm import CompiledContinuousSampler, ContinuousSampler, Sampling, Token
from ..inference.language_model import TextStream
from ..lm import LanguageModel

__all__ = ["ContinuousGeneration", "Generated", "GenerationJob", "generate_exported"]

#: Why a continuation ended: ``</s>`` (or one of the job's ``stop_ids``), ``max_new_tokens``, a stop string, or its
#: client went away.
FinishReason = Literal["eos", "length", "stop", "cancelled"]


@dataclass
class GenerationJob:
    """One generation (a ``/generate`` request, a choice of ``/v1/completions``), as the worker runs it.

    ``stop_ids``: ids that end it as ``</s>`` does (a chat's end of turn: ``<|im_end|>``), not shown. ``seed``
    None: a run draws one (and records it here); an export takes none (it has one generator). ``emit`` is called
    from the worker thread (it must hand the event to the event loop thread-safely).
    The worker fills in the clock readings (``time.perf_counter``) for the metrics.
    """

    ids: list[int]  # the prompt's
    max_new_tokens: int
    sampling: Sampling
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    emit: Callable[[dict], None] | None = None
    cancelled: bool = False  # set by the event loop, read by the worker (one attribute store: no lock needed)
    started: float | None = None  # its prompt began to run
    first_token: float | None = None  # its first token was chosen
    ended: float | None = None  # its last

    def cancel(self) -> None:
        """The client went away: stop generating (at the worker's next step)."""
        self.cancelled = True


@dataclass(frozen=True)
class Generated:
    """What a job generated: the text, the tokens chosen (``</s>`` and the one completing a stop string included),
    the prompt's tokens, why it ended, and the seed it sampled with."""

    text: str
    tokens: int
    prompt_tokens: int
    finish_reason: FinishReason
    seed: int | None


@dataclass
class _Progress:
    """A job's continuation so far."""

    job: GenerationJob
    text: TextStream
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0

    def add(self, token: int, finish: str | None) -> FinishReason | None:
        """Take the chosen ``token`` (``finish``: the engine ended the row with it), tell ``emit``; why the job
        ended, or None."""
        now = time.perf_counter()
        self.job.first_token = self.job.first_token or now
        self.tokens += 1
        if token == EOS_ID or token in self.job.stop_ids:
            piece, reason = self.text.flush(), "eos"
        else:
            piece = self.text.add(token)
            reason = "stop" if self.text.stopped else finish
            if reason == "length":
                piece += self.text.flush()
        self.pieces.append(piece)
        if self.job.emit is not None:
            self.job.emit({"token": piece, "id": token})
        if reason is not None:
            self.job.ended = now
        return reason  # type: ignore[return-value]

    def result(self, reason: FinishReason) -> Generated:
        return Generated("".join(self.pieces), self.tokens, len(self.job.ids), reason, self.job.seed)


#: A job joining the running batch: our handle, its progress, its generator.
_Joining = tuple[int, _Progress, torch.Generator]


class ContinuousStepper:
    """What the continuous steppers (:class:`~attnkit.serve.batching.Stepper`) share: the continuous decoder they
    drive (``decoder``: its running rows, its batch's width) and the texts that ended outside a step, which the
    next step returns (``_ended``)."""

    decoder: Any
    _ended: list

    @property
    def running(self) -> int:
        return self.decoder.running + len(self._ended)

    @property
    def width(self) -> int:
        return self.decoder.width


class ContinuousGeneration(ContinuousStepper):
    """A run's jobs by continuous batching: the model worker's :class:`~attnkit.serve.batching.Stepper` (``start``
    takes :class:`GenerationJob` s, each result is a :class:`Generated`) on a :class:`ContinuousSampler`, or with
    ``compiled`` (``attnkit serve --engine compiled``) a :class:`CompiledContinuousSampler`: prompts and steps
    through programs compiled ahead of time."""

    def __init__(self, model: LanguageModel, tok: Tokenizer, compiled: CompiledDecoder | None = None) -> None:
        self.model, self.tok, self.compiled = model, tok, compiled
        self.decoder = self._sampler()
        self._handles = count()
        self._rows: dict[int, tuple[int, _Progress]] = {}  # the sampler's handle -> (ours, the job's progress)
        self._ended: list[tuple[int, Generated | Exception]] = []  # jobs that ended outside a step (next step's)

    def start(self, jobs: list[GenerationJob]) -> list[int]:
        """Run the jobs' prompts and choose each one's first token; a job joins the running batch unless that ended
        it. Prompts of one length run through the model together (one prefill: the jobs that queued while a step
        ran join at once); a job that cannot start ends with its exception (returned by the next step)."""
        handles = [next(self._handles) for _ in jobs]
        device = next(self.model.parameters()).device
        by_length: dict[int, list[_Joining]] = {}
        for handle, job in zip(handles, jobs, strict=True):
            try:
                progress = _Progress(job, TextStream(self.tok, job.stop, context=job.ids))
            except Exception as e:  # its stop strings or prompt cannot be decoded: it alone ends
                self._ended.append((handle, e))
                continue
            if job.cancelled:  # its client left while it was queued
                self._ended.append((handle, progress.result("cancelled")))
                continue
            if job.seed is None:
                job.seed = secrets.randbits(63)
            generator = torch.Generator(device=device).manual_seed(job.seed)  # as attnkit generate seeds it
            by_length.setdefault(len(job.ids), []).append((handle, progress, generator))
        for group in by_length.values():
            self._prefill(group)
        return handles

    def _prefill(self, group: list[_Joining]) -> None:
        """Run the prompts of ``group`` (of one length) through one prefill and take each one's first token. If the
        prefill fails, a group of several runs again one prompt at a time, and a lone prompt's job ends with the
        exception (the running batch is as it was: :meth:`ContinuousSampler.add_many`)."""
        started = time.perf_counter()
        jobs = [progress.job for _, progress, _ in group]
        for job in jobs:
            job.started = started
        try:
            tokens = self.decoder.add_many([j.ids for j in jobs], [j.max_new_tokens for j in jobs],
                                           [j.sampling for j in jobs], [g for _, _, g in group])
        except Exception as e:
            if len(group) == 1:
                self._ended.append((group[0][0], e))
                return
            for one in group:
                self._prefill([one])
            return
        for (handle, progress, _), token in zip(group, tokens, strict=True):
            self._take(handle, progress, token)

    def step(self) -> list[tuple[int, Generated | Exception]]:
        """Drop the jobs whose clients left, then one token for every running job; the jobs that ended (a job that
        failed: its exception)."""
        gone = [inner for inner, (_, progress) in self._rows.items() if progress.job.cancelled]
        if gone:
            self.decoder.drop(gone)
            for inner in gone:
                handle, progress = self._rows.pop(inner)
                self._ended.append((handle, progress.result("cancelled")))
        if self.decoder.running:
            tokens = self.decoder.step()
            for token in tokens:
                handle, progress = self._rows.pop(token.handle)
                self._take(handle, progress, token)
        ended, self._ended = self._ended, []
        return ended

    def _take(self, handle: int, progress: _Progress, token: Token) -> None:
        """A job's new token: it goes on, or it ended (a stop string or stop id, or a failure of its own: its row is
        taken out of the batch)."""
        error = token.error
        if error is None:
            try:
                reason = progress.add(token.id, token.finish)
            except Exception as e:  # its text, its stop strings or its emit: this job alone ends
                error = e
        if error is None and reason is None:
            self._rows[token.handle] = (handle, progress)
            return
        if token.finish is None:  # the engine would go on: a stop string, a stop id or a failure ended it
            self.decoder.drop([token.handle])
        self._ended.append((handle, error if error is not None else progress.result(reason)))

    def _sampler(self) -> ContinuousSampler:
        return ContinuousSampler(self.model) if self.compiled is None else CompiledContinuousSampler(self.compiled)

    def abandon(self) -> None:
        self.decoder = self._sampler()
        self._rows.clear()
        self._ended.clear()

    def run(self, jobs: list[GenerationJob]) -> list[Generated]:
        """``jobs`` from start to end, as one batch (nothing else running): the servable's whole-batch ``generate``.
        Raises the exception of the first job that failed (the others ran to their end)."""
        handles = self.start(jobs)
        results: dict[int, Generated | Exception] = {}
        while self.running:
            results.update(self.step())
        for h in handles:
            if isinstance(results[h], Exception):
                raise results[h]
        return [results[h] for h in handles]  # type: ignore[misc]


def generate_exported(generator: Any, jobs: list[GenerationJob]) -> list[Generated]:
    """``jobs`` (the same sampling options and ``max_new_tokens``: the worker batches by them) on a CTranslate2 export
    (:class:`~attnkit.export.ctranslate2_lm.ExportedGenerator`): a lone job streamed token by token, several as one
    batch (their tokens told to ``emit`` once the batch is done). The export samples from its own generator, seeded
    once for the process: a job has no seed of its own."""
    first = jobs[0]
    s = first.sampling
    options = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "include_eos": True}
    for job in jobs:
        job.started = time.perf_counter()
    if len(jobs) == 1:
        streams: list[Iterator[int]] = [generator.stream(first.ids, first.max_new_tokens, **options)]
    else:
        batch = generator.generate_batch([job.ids for job in jobs], first.max_new_tokens, **options)
        streams = [iter(ids) for ids in batch]
    results = []
    for job, ids in zip(jobs, streams, strict=True):
        progress = _Progress(job, TextStream(generator.tok, job.stop, context=job.ids))
        reason: FinishReason | None = None
        for i, token in enumerate(ids, start=1):
            if job.cancelled:
                reason = "cancelled"
                break
            reason = progress.add(int(token), "length" if i == job.max_new_tokens else None)
            if reason is not None:
                break
        results.append(progress.result(reason or "length"))
    return results
