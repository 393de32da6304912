"""A compiled decoding step for a language model: a static key/value cache, compiled ahead of time.

At batch 1 a small model's step is a few dozen matrix-vector products, and eager PyTorch spends most of it
launching operators from Python (docs/language-models.md, the generation race). A compiled step runs as one graph of
generated kernels, but a graph wants fixed shapes, and the textbook cache grows by one position per step. So:

* :class:`StaticKVCache` keeps each layer's keys and values in buffers ``(B, H_kv, capacity, d)`` allocated once.
  A step writes row ``b``'s new key and value at its position ``pos[b]``, in place, and attends over the first
  ``L`` columns of the buffers (the span, ``L > max(pos)``) with :func:`static_mask`: key ``s`` is visible when
  ``s <= pos`` (written already) and, under a sliding window, ``s > pos - window``. A masked key gets exactly zero
  weight, so the step computes what the textbook's growing cache computes.
* RoPE rotates by each row's ``pos`` (the ``offset`` argument of the textbook's attention); a table of positions is
  read at ``pos``. ALiBi's bias is taken for a query at the span's last column, ``-m_h (L - 1 - s)``, which
  differs from the query's own ``-m_h (pos - s)`` by one constant per row and head: softmax does not see it.
* :class:`CompiledDecoder` runs the prompt through the model's own :meth:`~attnkit.lm.LanguageModel.step` (the
  prefill; compiled too, :func:`compile_prefill`, its batch size and length free), copies its cache into static
  buffers, then feeds one token at a time through :meth:`CompiledDecoder.decode_step`: the textbook's layers
  (:meth:`~attnkit.lm.LanguageModel.decode_layers`) with a static cache. The capacity doubles when a sequence
  outgrows it (64, 128, ...; at most the model's context); the span grows one column per step. The compiled
  step also makes the greedy choice (the textbook's :func:`~attnkit.sampling.choose_next`, traced), which
  :meth:`CompiledDecoder.choose_next` hands to :func:`~attnkit.sampling.generate`.
* :func:`compile_step` compiles that step ahead of time, once per batch size and dtype: ``torch.export`` then
  AOTInductor (a shared library of generated C++ kernels), with the span and the capacity as dimensions of the
  compiled code (its attention loops over the span, not the buffer, and a growing sequence compiles once; a
  kernel chosen by the number of keys splits the spans in ranges, one compiled step each). It is called with a
  list of tensors, with no guards to check and no Python wrapper per call; its weights are the model's own
  tensors (nothing copied).
* At batch 1 every ``nn.Linear`` is a matrix-vector product, and the library's matrix-matrix routine, called once
  per layer, spends more time being called than multiplying (``docs/engine.md``, compiled steps).
  So a one-row step writes each product as :func:`~.aot.matvec_linear`, an elementwise product and a row sum, which
  the compiler generates as a loop in the same kernel as the rest of the step. Its inputs are computed once
  (``realize_cpu_opcount_threshold``): otherwise the compiler would recompute the layer norm or GELU before each
  product for every row of the weight.

The compiled step and the eager one give the same logits (``tests/test_compiled_decoding.py``); compiling costs
seconds per batch size, and the compiled code (no weights) is kept on disk (:func:`~.aot.step_cache`), so a later
process with a model of the same architecture loads it instead. It pays off for long or many generations
(``attnkit generate --compile``).
The step runs in the model's own dtype: for bf16, convert the model (``model.to(torch.bfloat16)``; autocast is
refused). Under bf16 ALiBi's larger constant is rounded with the bias, so its logits differ a little from eager.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from ..lm import LanguageModel, LMState
from ..multihead import KVCache
from ..sampling import choose_next, never_sampled
from .aot import CompiledProgram, compile_module
from .attention import _fused_zeroes_empty_rows
from .quantize import quantize_int8

__all__ = ["CompiledDecoder", "StaticKVCache", "compile_prefill", "compile_step", "embed_at", "static_mask"]

#: The first capacity of the buffers (doubled as a sequence outgrows it, up to the model's context).
FIRST_CAPACITY = 64


@dataclass
class StaticKVCache(KVCache):
    """Keys and values ``(B, H_kv, capacity, d)`` in fixed buffers; ``pos`` ``(B,)`` is where each row writes next.

    :meth:`append` writes in place and returns a cache one position further whose keys and values are the first
    ``span`` columns of the buffers (all of them when ``span`` is None): the columns a step attends over. A cache is
    extended once (decoding replaces each step's cache by the next), like :class:`~.decoding.GrowingKVCache`.
    """

    pos: Tensor | None = None  # (B,) long
    span: int | None = None  # columns attended (> every row's pos); None: the whole buffer

    def append(self, k: Tensor, v: Tensor) -> KVCache:
        if self.k is None or self.v is None or self.pos is None:
            raise ValueError("a static cache is made from a filled one (StaticKVCache.of)")
        if k.size(2) != 1:
            raise ValueError(f"a static cache takes one new position per step, got {k.size(2)}")
        rows = torch.arange(k.size(0), device=k.device)  # (B,)
        self.k[rows, :, self.pos] = k[:, :, 0]  # row b's key at its position pos[b]: (B, H_kv, d)
        self.v[rows, :, self.pos] = v[:, :, 0]
        if self.span is None:
            return StaticKVCache(self.k, self.v, self.pos + 1)
        return StaticKVCache(self.k.narrow(2, 0, self.span), self.v.narrow(2, 0, self.span), self.pos + 1)

    def select(self, index: Tensor) -> KVCache:
        if self.k is None or self.v is None or self.pos is None:
            return StaticKVCache()
        return StaticKVCache(self.k.index_select(0, index), self.v.index_select(0, index),
                             self.pos.index_select(0, index))

    @staticmethod
    def of(cache: KVCache, capacity: int) -> StaticKVCache:
        """A filled cache ``(B, H_kv, t, d)`` copied into buffers with room for ``capacity >= t`` positions."""
        assert cache.k is not None and cache.v is not None
        B, H, t, _ = cache.k.shape
        k = cache.k.new_zeros(B, H, capacity, cache.k.size(3))
        v = cache.v.new_zeros(B, H, capacity, cache.v.size(3))
        k[:, :, :t], v[:, :, :t] = cache.k, cache.v
        return StaticKVCache(k, v, torch.full((B,), t, dtype=torch.long, device=k.device))


def static_mask(pos: Tensor, span: Tensor, window: int | None) -> Tensor:
    """Which cached keys, at positions ``span`` ``(L,)`` (``0..L-1``), the query at ``pos`` ``(B,)`` may see:
    ``s <= pos`` (the look-ahead mask; later columns are not written yet) and ``pos - s < window``
    -> ``(B, 1, 1, L)``, True = may attend."""
    s = span[None, :]  # (1, L) key positions
    t = pos[:, None]  # (B, 1) query positions
    mask = s <= t
    if window:
        mask = mask & (t - s < window)
    return mask[:, None, None, :]  # (B, 1, 1, L)


def embed_at(model: LanguageModel, tokens: Tensor, pos: Tensor, table_rows: int) -> Tensor:
    """``Dropout(Embed(y) + PE[pos])`` for one token per row, ``tokens`` ``(B, 1)`` at positions ``pos`` ``(B,)``
    (each row at its own), reading the first ``table_rows > max(pos)`` rows of a position table."""
    x = model.embed(tokens)  # (B, 1, d_model)
    if model.positions is not None:
        x = x + model.positions(table_rows)[pos][:, None]  # + PE at each row's own position
    return model.dropout(x)


class _DecodeStep(nn.Module):
    """:meth:`CompiledDecoder.decode_step` as a module, for ``torch.export`` (its weights are ``model.*``)."""

    def __init__(self, decoder: CompiledDecoder) -> None:
        super().__init__()
        self.model = decoder.model
        self.step = decoder.decode_step
        device = next(self.model.parameters()).device
        self.register_buffer("never", never_sampled(device).clone(), persistent=False)  # a buffer, named in the program

    def forward(self, tokens: Tensor, pos: Tensor, span: Tensor, keys: list[Tensor], values: list[Tensor]
                ) -> tuple[Tensor, Tensor]:
        logits = self.step(tokens, pos, span, keys, values)  # (B, V)
        return logits, choose_next(logits, 0.0, never=self.never)  # and the greedy choice (B,), inside the program


def textbook_state(model: LanguageModel) -> LMState:
    """An empty state with the textbook's caches (:class:`~attnkit.multihead.KVCache`, whatever the model's
    ``cache_type``): a prompt's keys and values come out as they are computed, with no room to copy them into."""
    return LMState([KVCache() for _ in model.layers], 0)


class _Prefill(nn.Module):
    """The prompt's pass, :meth:`~attnkit.lm.LanguageModel.step` from an empty cache, as a module for
    ``torch.export``: ``tokens (B, T) -> (logits (B, V), keys, values)``, each layer's ``(B, H_kv, T, d)``."""

    def __init__(self, model: LanguageModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        logits, state = self.model.step(tokens, textbook_state(self.model))
        return logits, [c.k for c in state.caches], [c.v for c in state.caches]  # type: ignore[misc]


def compile_step(decoder: CompiledDecoder, tokens: Tensor, pos: Tensor, span: Tensor, keys: list[Tensor],
                 values: list[Tensor]) -> CompiledProgram:
    """``decoder.decode_step`` for this batch size and dtype, compiled ahead of time (AOTInductor), for every span
    and capacity in the range the traced code allows (``ranges["span"]``).

    The span (``L``) and the buffers' capacity are dimensions of their own; a one-row step has
    :func:`~.aot.matvec_linear` for ``nn.Linear``."""
    L = span.size(0)

    def example(buffer: Tensor) -> Tensor:  # a capacity unequal to the span: equal sizes could be traced as one
        B, H, _, d = buffer.shape
        return buffer.new_zeros(B, H, L + 1, d)

    auto = torch.export.Dim.AUTO
    return compile_module(_DecodeStep(decoder), (tokens, pos, span, [example(k) for k in keys],
                                                 [example(v) for v in values]),
                          (None, None, {0: auto}, [{2: auto}] * len(keys), [{2: auto}] * len(values)),
                          {"span": ("span", 0)}, matvec=tokens.size(0) == 1)


def compile_prefill(model: LanguageModel, tokens: Tensor) -> CompiledProgram:
    """The prompt's pass (:class:`_Prefill`) compiled ahead of time, for the batch sizes and prompt lengths in the
    ranges the traced code allows (``ranges["batch"]``, ``ranges["length"]``; a batch of one is its own)."""
    auto = torch.export.Dim.AUTO
    free = {0: auto, 1: auto} if tokens.size(0) > 1 else {1: auto}  # a batch of one is fixed (export would warn)
    return compile_module(_Prefill(model), (tokens,), (free,),
                          {"batch": ("tokens", 0), "length": ("tokens", 1)}, matvec=False)


def refuse_autocast(device: torch.device) -> None:
    """A compiled program runs in the model's own dtype: autocast would not reach inside it."""
    if torch.is_autocast_enabled(device.type):
        raise ValueError("the compiled step runs in the model's dtype: convert the model "
                         "(model.to(torch.bfloat16)) instead of autocast")


class CompiledDecoder:
    """Generation from ``model`` through a compiled one-token step (see the module docstring).

    It has what :func:`attnkit.sampling.generate` calls (``parameters``, ``init_state``, ``step``), so
    ``generate(CompiledDecoder(model), ...)`` gives ``generate(model, ...)``'s tokens.

    :param compile: compile the step ahead of time (:func:`compile_step`; False: the same static-cache step, eager,
        for tests).
    :param quantize: ``"int8"``: decode through a copy of the model whose linear layers hold int8 weights
        (:func:`~.quantize.quantize_int8`; ``model`` itself is left as it is); None: the model's own weights.
    """

    def __init__(self, model: LanguageModel, *, compile: bool = True, quantize: str | None = None) -> None:
        if not isinstance(model, LanguageModel):
            raise TypeError(f"a compiled decoder needs a LanguageModel, got {type(model).__name__}")
        if quantize not in (None, "int8"):
            raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
        self.model = model if quantize is None else cast(LanguageModel, quantize_int8(model))
        self.compile = compile
        device = next(model.parameters()).device
        for dtype in (torch.float32, torch.bfloat16):  # probe the fused kernel now: a probe in the graph would split it
            _fused_zeroes_empty_rows(device, dtype)
        #: compiled steps by (batch size, dtype, device, training), each for a range of spans
        self.steps: dict[tuple, list[CompiledProgram]] = {}
        #: compiled prompt passes by (dtype, device, training), each for ranges of batch sizes and lengths
        self.prefills: dict[tuple, list[CompiledProgram]] = {}
        self._last: dict[tuple, tuple[CompiledProgram, int, float]] = {}  # the step used last, by its key
        self._greedy: tuple[Tensor, Tensor] | None = None  # the last compiled step's logits and greedy choice
        self.positions = torch.arange(FIRST_CAPACITY, device=device)  # spans are its leading slices
        self._spans: dict[int, Tensor] = {}  # those slices, by length

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def init_state(self) -> LMState:
        return self.model.init_state()

    def capacity_for(self, length: int) -> int:
        """Buffer positions for a sequence of ``length``: a power of two with room (at most the model's context).

        A step attends over the columns a sequence has reached (its span), so a longer buffer costs memory, not
        time; buffers double, so that a growing sequence is copied a few times only."""
        capacity = FIRST_CAPACITY
        while capacity < length:
            capacity *= 2
        context = self.model.context
        return capacity if context is None else min(capacity, context)

    def step(self, tokens: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """:meth:`LanguageModel.step`: ``tokens`` ``(B, T)`` -> ``(logits of the last position (B, V), new state)``.

        A state that is not static yet (the prompt) goes through the compiled prompt pass (:func:`compile_prefill`;
        the model's own step when not compiling, or for a state that holds positions already), then into static
        buffers; afterwards each token goes through the compiled step.
        """
        caches = state.caches
        if caches and type(caches[0]) is StaticKVCache and tokens.size(1) == 1:  # a decoding step: kept lean
            return self._advance(tokens, state)
        if not (caches and isinstance(caches[0], StaticKVCache)):
            if self.compile and state.length == 0:
                logits, state = self.prefill(tokens)  # the prompt, compiled
            else:
                logits, state = self.model.step(tokens, state)  # eager
            capacity = self.capacity_for(state.length + 1)
            return logits, LMState([StaticKVCache.of(c, capacity) for c in state.caches], state.length)
        logits = tokens.new_empty(0)
        for j in range(tokens.size(1)):  # one position at a time
            logits, state = self._advance(tokens[:, j: j + 1], state)
        return logits, state

    def _advance(self, token: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """One token per row ``(B, 1)`` through the step: its logits ``(B, V)`` and the state one position on (the
        same buffers, written in place, or buffers twice as long when these are full)."""
        caches = cast(list[StaticKVCache], state.caches)
        length, pos = state.length, caches[0].pos  # (B,) each row's position
        if length >= caches[0].k.size(2):  # out of room (the capacity is at most the model's context)
            context = self.model.context
            if context is not None and length + 1 > context:
                raise ValueError(f"position {length + 1} exceeds max_len={context}")
            capacity = self.capacity_for(length + 1)
            caches = [StaticKVCache.of(KVCache(c.k[:, :, :length], c.v[:, :, :length]), capacity) for c in caches]
        logits = self._step(token, pos, length + 1, caches)  # writes the buffers in place
        pos = pos + 1
        return logits, LMState([StaticKVCache(c.k, c.v, pos) for c in caches], length + 1)

    def _step(self, tokens: Tensor, pos: Tensor, reached: int, caches: list[StaticKVCache]) -> Tensor:
        """One step over the first ``reached`` (or more) columns of the buffers: the compiled step for this batch
        size and span (compiled on first use), or :meth:`decode_step` eagerly.

        Spans are at least ``FIRST_CAPACITY`` columns (the masked ones get no weight), so that short and long
        sequences share one compiled step. A compiled step reads its inputs at the strides it was compiled for,
        unchecked: the tokens are made contiguous here (a column of a prompt is not), and static buffers are
        contiguous by construction (:meth:`StaticKVCache.of`, and ``index_select`` in
        :meth:`StaticKVCache.select`). Called once per token, it keeps its Python short: the step of the previous
        call is checked first, and spans are views made once."""
        first = caches[0].k
        capacity = first.size(2)
        n = reached if reached > FIRST_CAPACITY else min(FIRST_CAPACITY, capacity)
        keys, values = [c.k for c in caches], [c.v for c in caches]
        if not self.compile:
            return self.decode_step(tokens, pos, self.span(n), keys, values)
        refuse_autocast(first.device)
        key = (tokens.size(0), first.dtype, first.device, self.model.training)
        last = self._last.get(key)  # (program, its least span, its most span): most often the one
        if last is None or not (last[1] <= capacity and n <= last[2]):
            steps = self.steps.setdefault(key, [])
            step = next((s for s in steps if s.ranges["span"][0] <= capacity and n <= s.ranges["span"][1]), None)
            if step is None:
                step = compile_step(self, tokens, pos, self.span(n), keys, values)
                steps.append(step)
            low, high = step.ranges["span"]
            last = self._last[key] = (step, int(low), high)
        logits, greedy = last[0].run([tokens.contiguous(), pos, self.span(max(n, last[1])), *keys, *values])
        self._greedy = (logits, greedy)
        return logits

    def choose_next(self, logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    generator: torch.Generator | None = None) -> Tensor:
        """:func:`attnkit.sampling.choose_next` (:func:`~attnkit.sampling.generate` calls a model's own): for the
        logits of the last compiled step at temperature 0, the choice the step made inside the program."""
        if temperature == 0 and self._greedy is not None and self._greedy[0] is logits:
            return self._greedy[1]
        return choose_next(logits, temperature, top_k, top_p, generator)

    def prefill(self, tokens: Tensor) -> tuple[Tensor, LMState]:
        """``model.step(tokens, model.init_state())`` through the compiled prompt pass for the prompts' batch size
        and length (compiled on first use): the last position's logits ``(B, V)`` and a state whose caches are the
        textbook's, each layer's ``(B, H_kv, T, d)``. A one-token prompt, which the traced code takes apart (one
        query needs no look-ahead mask), runs eagerly unless a program holds it: it is one step, not worth the
        seconds of compiling (on a server, while its request waits)."""
        weight = next(self.model.parameters())
        refuse_autocast(weight.device)
        key = (weight.dtype, weight.device, self.model.training)
        B, T = tokens.shape
        prefills = self.prefills.setdefault(key, [])
        prefill = next((p for p in prefills if p.holds(batch=B, length=T)), None)
        if prefill is None and T == 1:
            return self.model.step(tokens, textbook_state(self.model))
        if prefill is None:
            prefill = compile_prefill(self.model, tokens)
            prefills.append(prefill)
        logits, *kv = prefill.run([tokens.contiguous()])
        n = len(kv) // 2
        return logits, LMState([KVCache(k, v) for k, v in zip(kv[:n], kv[n:], strict=True)], tokens.size(1))

    def span(self, n: int) -> Tensor:
        """The key positions ``0..n-1`` ``(n,)``: a leading slice of one table, grown as needed (each slice made once:
        a step asks for one per token)."""
        view = self._spans.get(n)
        if view is None:
            if self.positions.size(0) < n:
                self.positions = torch.arange(max(n, 2 * self.positions.size(0)), device=self.positions.device)
                self._spans = {}
            view = self._spans[n] = self.positions[:n]
        return view

    def decode_step(self, tokens: Tensor, pos: Tensor, span: Tensor, keys: list[Tensor], values: list[Tensor]
                    ) -> Tensor:
        """One token per row, ``tokens`` ``(B, 1)`` at ``pos`` ``(B,)``, through the textbook's layers with static
        caches ``keys[l]`` / ``values[l]`` ``(B, H_kv, capacity, d)`` (written in place), attending over their
        first ``L`` columns, at the positions ``span`` ``(L,)`` (``L > max(pos)``) -> logits ``(B, V)``."""
        model = self.model
        L = span.size(0)
        x = embed_at(model, tokens, pos, L)  # (B, 1, d_model)
        mask = static_mask(pos, span, model.cfg.window)  # (B, 1, 1, L)
        caches: list[KVCache] = [StaticKVCache(k, v, pos, L) for k, v in zip(keys, values, strict=True)]
        hidden, _, _ = model.decode_layers(x, mask, caches, offset=pos)  # (B, 1, d_model)
        return model.out_proj(hidden[:, 0])  # (B, V)
