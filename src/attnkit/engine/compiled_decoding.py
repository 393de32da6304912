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
* :class:`CompiledDecoder` runs the prompt through the model's layers from an empty cache (the prefill, the model's
  own :meth:`~attnkit.lm.LanguageModel.step`; compiled, :func:`compile_prefill`, one :class:`LayerPrefill` per
  layer, its batch size and length free), copies its cache into static buffers, then feeds one token at a time
  through :meth:`CompiledDecoder.decode_step`: :class:`StepInput` (the embedding and the mask), the textbook's
  layers with a static cache (:class:`LayerStep`, one per layer), :class:`StepOutput` (the final norm and the
  output layer). The capacity doubles when a sequence outgrows it (64, 128, ...; at most the model's context); the
  span grows one column per step. The compiled step also makes the greedy choice (the textbook's
  :func:`~attnkit.sampling.choose_next`, traced), which :meth:`CompiledDecoder.choose_next` hands to
  :func:`~attnkit.sampling.generate`.
* :func:`compile_step` compiles that step ahead of time, once per batch size and dtype: ``torch.export`` then
  AOTInductor (a shared library of generated C++ kernels) of :class:`StepInput`, of one :class:`LayerStep` and of
  :class:`StepOutput`. The layer's code is loaded once per layer, each copy pointed at its own layer's weights
  (:func:`~.aot.compile_modules`; PyTorch's "regional compilation"), so the compile time does not grow with the
  depth, and the compiler never sees a graph deep enough to overflow Python's recursion limit (its buffer planner
  recurses deeper as buffers are added: a whole step of a dozen layers or more did). The span and the capacity are
  dimensions of the compiled code (a growing sequence compiles once; a kernel chosen by the number of keys splits
  the spans in ranges, one step each). A program is called with a list of tensors, no guards and no Python wrapper;
  its weights are the model's own tensors.
* At batch 1 every ``nn.Linear`` is a matrix-vector product, which the library's routine spends more time being
  called for than multiplying (``docs/engine.md``): a one-row step writes it as :func:`~.aot.matvec_linear`, a
  loop in the layer's own kernel, its inputs computed once, not per row (``realize_cpu_opcount_threshold``).

The compiled step and the eager one give the same logits (``tests/test_compiled_decoding.py``); compiling costs
seconds per batch size, and the compiled code (no weights) is kept on disk (:func:`~.aot.step_cache`), so a later
process with a model of the same architecture loads it instead (it pays off for long or many generations). The
step runs in the model's own dtype: for bf16, convert the model (``model.to(torch.bfloat16)``; autocast is
refused); ALiBi's larger constant is then rounded with the bias, so its logits differ a little from eager.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from ..lm import LanguageModel, LMState
from ..multihead import KVCache
from ..positions import RotaryPositions
from ..sampling import choose_next, never_sampled
from .aot import CompiledProgram, compile_module, compile_modules, in_ranges
from .attention import _fused_zeroes_empty_rows
from .quantize import quantize_int8

__all__ = ["CompiledDecoder", "CompiledPass", "LayerPrefill", "LayerStep", "StaticKVCache", "StepInput", "StepOutput",
           "compile_prefill", "compile_step", "embed_at", "static_mask"]

#: The buffers' first capacity (doubled as needed); the most prompt positions a prompt pass is traced for at first.
FIRST_CAPACITY, TRACED_POSITIONS = 64, 8192


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


def embed_at(model: nn.Module, tokens: Tensor, pos: Tensor, table_rows: int) -> Tensor:
    """``Dropout(Embed(y) + PE[pos])`` for one token per row, ``tokens`` ``(B, 1)`` at positions ``pos`` ``(B,)``
    (each row at its own), reading the first ``table_rows > max(pos)`` rows of a position table. ``model``: a
    language model, or a module holding its ``embed``, ``positions`` and ``dropout``."""
    x = model.embed(tokens)  # (B, 1, d_model)
    if model.positions is not None:
        x = x + model.positions(table_rows)[pos][:, None]  # + PE at each row's own position
    return model.dropout(x)


class StepInput(nn.Module):
    """The decoding step before the layers: ``(tokens (B, 1), pos (B,), span (L,)) -> (x (B, 1, d_model), mask
    (B, 1, 1, L))``, :func:`embed_at` and :func:`static_mask` with the model's embedding, positions and window."""

    def __init__(self, model: LanguageModel) -> None:
        super().__init__()
        self.embed, self.positions, self.dropout = model.embed, model.positions, model.dropout
        self.window = model.cfg.window

    def forward(self, tokens: Tensor, pos: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
        return embed_at(self, tokens, pos, span.size(0)), static_mask(pos, span, self.window)


class LayerStep(nn.Module):
    """One layer of the decoding step: ``x`` ``(B, 1, d_model)`` at positions ``pos`` ``(B,)``, its key and value
    written into the static buffers ``keys``, ``values`` ``(B, H_kv, capacity, d)`` at ``pos`` (in place), attending
    over their first ``L`` columns as ``mask`` ``(B, 1, 1, L)`` allows -> ``x``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, pos: Tensor, mask: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        cache = StaticKVCache(keys, values, pos, mask.size(-1))
        x, _, _ = self.layer(x, mask, cache, offset=pos)  # (B, 1, d_model)
        return x


class StepOutput(nn.Module):
    """After the layers: the final norm (if the model has one) and the output layer, ``hidden`` ``(B, T, d_model)``
    -> ``(logits of the last position (B, V), the greedy choice (B,))`` (:func:`~attnkit.sampling.choose_next` at
    temperature 0, traced into the compiled step)."""

    def __init__(self, model: LanguageModel) -> None:
        super().__init__()
        self.norm, self.out_proj = model.final_norm, model.out_proj
        device = next(model.parameters()).device
        self.register_buffer("never", never_sampled(device).clone(), persistent=False)  # a buffer, named in the program

    def logits(self, hidden: Tensor) -> Tensor:
        last = hidden[:, -1]  # (B, d_model); the norm is per position
        return self.out_proj(last if self.norm is None else self.norm(last))  # (B, V)

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.logits(hidden)
        return logits, choose_next(logits, 0.0, never=self.never)


class LayerPrefill(nn.Module):
    """One layer of the prompt's pass from an empty cache: ``x`` ``(B, T, d_model)`` -> ``(x, keys, values)``, the
    keys and values ``(B, H_kv, T, d)`` (the look-ahead mask is the layer's own; ``self_mask`` gives what it adds,
    :meth:`~attnkit.lm.LanguageModel.self_mask`)."""

    def __init__(self, layer: nn.Module, self_mask: Callable[[int, int, torch.device], Tensor | None]) -> None:
        super().__init__()
        self.layer = layer
        self.self_mask = self_mask

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        T = x.size(1)
        x, _, cache = self.layer(x, self.self_mask(T, T, x.device), KVCache())
        return x, cache.k, cache.v


def textbook_state(model: LanguageModel) -> LMState:
    """An empty state with the textbook's caches (:class:`~attnkit.multihead.KVCache`, whatever the model's
    ``cache_type``): a prompt's keys and values come out as they are computed, with no room to copy them into."""
    return LMState([KVCache() for _ in model.layers], 0)


class CompiledPass:
    """A pass through the model as compiled programs run one after another: ``before`` the layers (None: that part
    runs eagerly), one per layer (``layers``: one compiled program, loaded for each layer with its own tensors),
    and ``after`` them (or None). ``ranges``: the sizes of each free dimension that every program holds."""

    def __init__(self, layers: list[CompiledProgram], before: CompiledProgram | None = None,
                 after: CompiledProgram | None = None) -> None:
        self.layers, self.before, self.after = layers, before, after
        programs = [p for p in (before, *layers, after) if p is not None]
        names = {name for p in programs for name in p.ranges}
        self.ranges = {name: (max(p.ranges[name][0] for p in programs if name in p.ranges),
                              min(p.ranges[name][1] for p in programs if name in p.ranges)) for name in names}

    def holds(self, **sizes: int) -> bool:
        """Whether each of ``sizes`` is in its dimension's range."""
        return in_ranges(self.ranges, sizes)


def compile_step(decoder: CompiledDecoder, tokens: Tensor, pos: Tensor, span: Tensor, keys: list[Tensor],
                 values: list[Tensor]) -> CompiledPass:
    """:meth:`CompiledDecoder.decode_step` for this dtype, compiled ahead of time (AOTInductor) as
    :class:`StepInput`, one :class:`LayerStep` program loaded once per layer, and :class:`StepOutput`, for every span,
    capacity and batch size in the ranges the traced code allows (``ranges["span"]``, ``ranges["batch"]``).

    The batch size is free from two rows up (a continuous batch changes it at every join and end); a one-row step
    is a program of its own, with :func:`~.aot.matvec_linear` for ``nn.Linear``."""
    B, L = tokens.size(0), span.size(0)
    auto = torch.export.Dim.AUTO
    free = {0: auto} if B > 1 else {}  # one row is a program of its own (matrix-vector loops); more rows share one
    before = compile_module(decoder.input, (tokens, pos, span), (free, free, {0: auto}),
                            {"span": ("span", 0), "batch": ("tokens", 0)}, matvec=False)
    with torch.no_grad():
        x, mask = decoder.input(tokens, pos, span)  # (B, 1, d_model), (B, 1, 1, L): the layers' inputs

    def example(buffer: Tensor) -> Tensor:  # a capacity unequal to the span: equal sizes could be traced as one
        _, H, _, d = buffer.shape
        return buffer.new_zeros(B, H, L + 1, d)

    layers = compile_modules(decoder.layer_steps, (x, pos, mask, example(keys[0]), example(values[0])),
                             (free, free, {**free, 3: auto}, {**free, 2: auto}, {**free, 2: auto}),
                             {"span": ("mask", 3), "batch": ("x", 0)}, matvec=B == 1)
    after = compile_module(decoder.output, (x,), (free,), {"batch": ("hidden", 0)}, matvec=B == 1)
    return CompiledPass(layers, before, after)


def compile_prefill(decoder: CompiledDecoder, tokens: Tensor) -> CompiledPass:
    """The prompt's pass compiled ahead of time: one :class:`LayerPrefill` program, loaded once per layer, for the
    batch sizes and prompt lengths in the ranges the traced code allows (``ranges["batch"]``,
    ``ranges["length"]``; a batch of one is its own). The embedding and the output layer, once per prompt, run
    eagerly. RoPE's table is grown first (grown in the trace, it fixed the length): to the model's positions, at
    most :data:`TRACED_POSITIONS` (131,072 positions of 64 dimensions are 64 MB of angles), or to a longer prompt's."""
    for module in decoder.model.modules():
        if isinstance(module, RotaryPositions):
            module.tables(max(tokens.size(1), min(decoder.model.cfg.max_len, TRACED_POSITIONS)))
    auto = torch.export.Dim.AUTO
    with torch.no_grad():
        x = decoder.model.embed_input(tokens)  # (B, T, d_model): the first layer's input
    free = {0: auto, 1: auto} if tokens.size(0) > 1 else {1: auto}  # a batch of one is fixed (export would warn)
    return CompiledPass(compile_modules(decoder.layer_prefills, (x,), (free,),
                                        {"batch": ("x", 0), "length": ("x", 1)}, matvec=False))


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
        # the step and the prompt's pass as modules, eager or compiled (each layer's its own)
        self.input, self.output = StepInput(self.model), StepOutput(self.model)
        layers = self.model.layers
        self.layer_steps: list[nn.Module] = [LayerStep(layer) for layer in layers]
        self.layer_prefills: list[nn.Module] = [LayerPrefill(layer, self.model.self_mask) for layer in layers]
        #: compiled steps by (dtype, device, training), each for ranges of spans and batch sizes
        self.steps: dict[tuple, list[CompiledPass]] = {}
        #: compiled prompt passes by (dtype, device, training), each for ranges of batch sizes and lengths
        self.prefills: dict[tuple, list[CompiledPass]] = {}
        self._last: dict[tuple, tuple[CompiledPass, int, float]] = {}  # the step used last, by its key
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
            if state.length == 0:
                logits, state = self.prefill(tokens)  # the prompt (compiled, when compiling)
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
        B = tokens.size(0)
        key = (B, first.dtype, first.device, self.model.training)
        last = self._last.get(key)  # (program, its least span, its most span): most often the one
        if last is None or not (last[1] <= capacity and n <= last[2]):
            steps = self.steps.setdefault(key[1:], [])
            step = next((s for s in steps if s.ranges["span"][0] <= capacity and n <= s.ranges["span"][1]
                         and s.holds(batch=B)), None)
            if step is None:
                step = compile_step(self, tokens, pos, self.span(n), keys, values)
                steps.append(step)
            low, high = step.ranges["span"]
            last = self._last[key] = (step, int(low), high)
        step = last[0]
        x, mask = step.before.run([tokens.contiguous(), pos, self.span(max(n, last[1]))])  # type: ignore[union-attr]
        for program, k, v in zip(step.layers, keys, values, strict=True):
            [x] = program.run([x, pos, mask, k, v])  # (B, 1, d_model), k and v written in place
        logits, greedy = step.after.run([x])  # type: ignore[union-attr]
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
        and length (compiled on first use; eager when not compiling): the last position's logits ``(B, V)`` and a
        state whose caches are the textbook's, each layer's ``(B, H_kv, T, d)``. A one-token prompt, which the
        traced code takes apart (one query needs no look-ahead mask), runs eagerly unless a program holds it: it is
        one step, not worth the seconds of compiling (on a server, while its request waits)."""
        if not self.compile:
            return self.model.step(tokens, textbook_state(self.model))
        weight = next(self.model.parameters())
        refuse_autocast(weight.device)
        key = (weight.dtype, weight.device, self.model.training)
        B, T = tokens.shape
        prefills = self.prefills.setdefault(key, [])
        prefill = next((p for p in prefills if p.holds(batch=B, length=T)), None)
        if prefill is None and T == 1:
            return self.model.step(tokens, textbook_state(self.model))
        if prefill is None:
            prefill = compile_prefill(self, tokens)
            prefills.append(prefill)
        x = self.model.embed_input(tokens).contiguous()  # (B, T, d_model)
        caches = []
        for program in prefill.layers:
            x, k, v = program.run([x])  # (B, T, d_model), the layer's keys and values (B, H_kv, T, d)
            caches.append(KVCache(k, v))
        return self.output.logits(x), LMState(caches, tokens.size(1))

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
        x, mask = self.input(tokens, pos, span)  # (B, 1, d_model), (B, 1, 1, L)
        for layer, k, v in zip(self.layer_steps, keys, values, strict=True):
            x = layer(x, pos, mask, k, v)  # (B, 1, d_model)
        return self.output.logits(x)  # (B, V)
