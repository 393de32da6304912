"""The engine: every speed trick of attnkit, apart from the textbook code it replaces.

The reference path (:mod:`attnkit.attention`, :mod:`~attnkit.multihead`, :mod:`~attnkit.layers`,
:mod:`~attnkit.transformer`, the task's ``F.cross_entropy``) reads like the seeds and imports
nothing from here. :func:`accelerate` swaps the fast paths into a built model, in place, without
changing its parameters; training selects it with ``train.engine: fast | reference`` (default
``fast``), and ``translate`` / ``evaluate`` / ``attention`` always decode with it.

============================================  ============================================  =======================
fast path                                     replaces (reference)                          module
============================================  ============================================  =======================
:func:`fast_attend`: fused SDPA, bf16         :func:`attnkit.attention.attend`              ``engine/attention.py``
weights, grouped queries
:class:`ByteDropout`: random bytes            ``nn.Dropout``                                ``engine/dropout.py``
:class:`FusedSeq2SeqLoss`: output layer       :class:`~attnkit.tasks.objectives.Seq2SeqLoss`:  ``engine/loss.py``
fused with label-smoothed cross-entropy,      then ``F.cross_entropy``
``index_select`` of scored positions
:class:`FusedLMLoss`: a language model's     :class:`~attnkit.tasks.objectives.LanguageModelLoss`  ``engine/loss.py``
output layer fused with its loss
:class:`FusedMLMLoss`: the tied MLM output     :class:`attnkit.mlm.MLMLoss`                  ``engine/mlm.py``
layer fused with the loss at the masked
positions only
:class:`SharedMemoryState`: one memory row    :class:`attnkit.transformer.TransformerState` ``engine/decoding.py``
per sentence in beam search
:class:`GrowingKVCache`: room to append to    :class:`attnkit.multihead.KVCache`            ``engine/decoding.py``
in place
:class:`CompiledDecoder`: a language model's  :meth:`attnkit.lm.LanguageModel.step`        ``compiled_decoding.py``
step compiled ahead of time (AOTInductor)
over static key/value buffers, one-row
products as loops (opt-in)
:class:`Int8Linear`: int8 weights, a scale    ``nn.Linear`` (in the compiled decoder's     ``quantize.py``
per output row (``quantize="int8"``)          copy of the model)
============================================  ============================================  =======================

Each has a test against its reference in ``tests/test_engine.py`` (the compiled decoder in
``tests/test_compiled_decoding.py``, int8 weights in ``tests/test_quantize.py``: those against the dequantized
float layer, since rounding moves the logits). The compiled decoder is not part of :func:`accelerate`: compiling costs
seconds, so ``attnkit generate --compile`` and the benchmarks ask for it.

Precision is chosen apart from these: :mod:`attnkit.engine.precision` times the model's own matrix products in float32
and in bf16 on this host (training's ``precision: auto``; :func:`~.precision.choose_precision` at inference), and
:func:`~.precision.bf16_weights` stores a model's weights in bf16 for inference (``tests/test_precision.py``: its
logits against float32's, within a tolerance).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from ..lm import LanguageModel
from ..multihead import MultiHeadAttention
from ..transformer import Transformer
from .attention import fast_attend
from .decoding import GrowingKVCache, SharedMemoryState
from .dropout import ByteDropout
from .loss import FusedLMLoss, FusedSeq2SeqLoss
from .mlm import FusedMLMLoss

Engine = Literal["fast", "reference"]
ENGINES: tuple[Engine, ...] = ("fast", "reference")

__all__ = ["ENGINES", "ByteDropout", "Engine", "FusedLMLoss", "FusedMLMLoss", "FusedSeq2SeqLoss", "GrowingKVCache",
           "SharedMemoryState", "accelerate", "fast_attend"]


def accelerate(model: nn.Module) -> nn.Module:
    """Swap the engine's fast paths into ``model`` in place (parameters untouched); returns ``model``.

    Every ``nn.Dropout`` becomes a :class:`ByteDropout` of the same rate, every
    :class:`MultiHeadAttention` computes with :func:`fast_attend`, a :class:`Transformer`
    decodes with :class:`SharedMemoryState`, and a :class:`LanguageModel`'s self-attention caches are
    :class:`GrowingKVCache` s.
    """
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                fast = ByteDropout(child.p)
                fast.train(child.training)
                setattr(module, name, fast)
        if isinstance(module, MultiHeadAttention):
            module.kernel = fast_attend
        if isinstance(module, Transformer):
            module.state_type = SharedMemoryState
        if isinstance(module, LanguageModel):  # not beam search's Transformer: it reorders its caches every step
            module.cache_type = GrowingKVCache
    return model
