"""The engine's eager mode: the textbook's classes with their slow parts replaced, built from their public pieces.

Each class here is a subclass of a textbook class that overrides one public method and adds no state, so the engine
turns a built model into its eager form by changing the class of its modules (:func:`to_eager`), parameters and all
untouched, and back (:func:`to_reference`). The textbook does not know these classes exist.

============================================  ======================================================================
eager class                                   what it changes
============================================  ======================================================================
:class:`EagerMultiHeadAttention`              ``forward``: the textbook's ``project`` and ``merge`` around
                                              :func:`~attnkit.engine.attention.fast_attend` (fused SDPA, bf16 weights,
                                              grouped queries) instead of :func:`attnkit.attention.attend`
:class:`EagerLanguageModel`                   ``init_state``: caches that grow in place
                                              (:class:`~attnkit.engine.decoding.GrowingKVCache`)
:class:`EagerTransformer`                     ``init_decoder``: a beam's hypotheses share their sentence's encoder side
                                              (:class:`~attnkit.engine.decoding.SharedMemoryState`)
:class:`~attnkit.engine.lora.EagerLoRALinear`  ``forward``: a LoRA layer with a frozen base in one autograd node
                                              (:func:`~attnkit.engine.lora.lora_linear`: fewer passes over activations)
:class:`~attnkit.engine.dropout.ByteDropout`  ``nn.Dropout``: random bytes instead of random floats (a module swapped
                                              in, the same rate)
============================================  ======================================================================
"""

from __future__ import annotations

from dataclasses import fields

from torch import Tensor, nn

from ..lm import LanguageModel, LMState
from ..lora import LoRALinear
from ..multihead import KVCache, MultiHeadAttention
from ..transformer import Transformer, TransformerState
from .attention import fast_attend
from .decoding import GrowingKVCache, SharedMemoryState
from .dropout import ByteDropout
from .lora import EagerLoRALinear
from .onednn import OneDNNLinear

__all__ = ["EagerLanguageModel", "EagerMultiHeadAttention", "EagerTransformer", "to_eager", "to_reference"]


class EagerMultiHeadAttention(MultiHeadAttention):
    """:class:`~attnkit.multihead.MultiHeadAttention` computing with :func:`~attnkit.engine.attention.fast_attend`."""

    def forward(self, query: Tensor, memory: Tensor | None = None, mask: Tensor | None = None, *,
                cache: KVCache | None = None, need_weights: bool = False, offset: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None, KVCache | None]:
        q, k, v, cache, bias = self.project(query, memory, cache, offset)
        context, weights = fast_attend(q, k, v, mask, score=self.score, normalizer=self.normalizer, beta=self.beta,
                                       dropout=self.dropout, need_weights=need_weights, bias=bias,
                                       causal=self.causal and memory is None)  # (B, H, T_q, d_v)
        return self.merge(context), weights, cache


class EagerLanguageModel(LanguageModel):
    """:class:`~attnkit.lm.LanguageModel` whose generation caches grow in place."""

    def init_state(self) -> LMState:
        return LMState([GrowingKVCache() for _ in self.layers], 0)


class EagerTransformer(Transformer):
    """:class:`~attnkit.transformer.Transformer` whose beam search keeps one encoder row per sentence (not for the
    textbook kernel: cross-attention then runs as grouped queries, which only
    :func:`~attnkit.engine.attention.fast_attend` takes)."""

    def init_decoder(self, src: Tensor, use_cache: bool = True) -> TransformerState:
        state = super().init_decoder(src, use_cache)
        return SharedMemoryState(**{f.name: getattr(state, f.name) for f in fields(state)})


#: textbook class -> its eager form
EAGER: dict[type[nn.Module], type[nn.Module]] = {
    MultiHeadAttention: EagerMultiHeadAttention, LanguageModel: EagerLanguageModel, Transformer: EagerTransformer,
    LoRALinear: EagerLoRALinear}
REFERENCE: dict[type[nn.Module], type[nn.Module]] = {eager: textbook for textbook, eager in EAGER.items()}
REFERENCE[OneDNNLinear] = nn.Linear  # a training run's linear layers where oneDNN measured faster (engine/onednn.py)


def to_eager(model: nn.Module) -> nn.Module:
    """``model`` in the engine's eager form, in place (parameters untouched): every module of a class in
    :data:`EAGER` becomes its eager class, every ``nn.Dropout`` a :class:`ByteDropout` of the same rate."""
    for module in list(model.modules()):
        if type(module) in EAGER:
            module.__class__ = EAGER[type(module)]
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                fast = ByteDropout(child.p)
                fast.train(child.training)
                setattr(module, name, fast)
    return model


def to_reference(model: nn.Module) -> nn.Module:
    """``model`` back in the textbook's classes, in place: the inverse of :func:`to_eager`."""
    for module in list(model.modules()):
        if type(module) in REFERENCE:
            module.__class__ = REFERENCE[type(module)]
        for name, child in module.named_children():
            if type(child) is ByteDropout:
                plain = nn.Dropout(child.p)
                plain.train(child.training)
                setattr(module, name, plain)
    return model
