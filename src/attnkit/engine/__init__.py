"""The engine: every speed trick of attnkit, apart from the textbook code it replaces.

The reference path (:mod:`attnkit.attention`, :mod:`~attnkit.multihead`, :mod:`~attnkit.layers`,
:mod:`~attnkit.transformer`, the task's ``F.cross_entropy``) reads like the seeds and imports
nothing from here. :func:`accelerate` swaps the fast paths into a built model, in place, without
changing its parameters; training selects it with ``train.engine: fast | reference | compiled`` (default
``fast``; ``compiled`` is ``fast`` with :func:`compile_objective`), and ``translate`` / ``evaluate`` /
``attention`` always decode with it.

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
step compiled (``torch.compile``) over
static key/value buffers (opt-in)
============================================  ============================================  =======================

Each has a test against its reference in ``tests/test_engine.py`` (the compiled decoder in
``tests/test_compiled_decoding.py``, the compiled training step in ``tests/test_train.py``). Neither compiled path is
part of :func:`accelerate`: compiling costs seconds, so ``attnkit generate --compile``, ``train.engine: compiled`` and
the benchmarks ask for them.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..lm import LanguageModel
from ..multihead import MultiHeadAttention
from ..transformer import Transformer
from .attention import fast_attend
from .decoding import GrowingKVCache, SharedMemoryState
from .dropout import ByteDropout
from .loss import FusedLMLoss, FusedSeq2SeqLoss
from .mlm import FusedMLMLoss

Engine = Literal["fast", "reference", "compiled"]
ENGINES: tuple[Engine, ...] = ("fast", "reference", "compiled")

__all__ = ["ENGINES", "ByteDropout", "Engine", "FusedLMLoss", "FusedMLMLoss", "FusedSeq2SeqLoss", "GrowingKVCache",
           "SharedMemoryState", "accelerate", "compile_objective", "fast_attend"]


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


def compile_objective(objective: nn.Module) -> nn.Module:
    """``train.engine: compiled``: the training objective (the model and its loss, as the trainer calls them) under
    ``torch.compile``, the same function with its kernels generated and fused: on a GPU far fewer launches per
    update (benchmarks/README.md). The model's own calls (validation, decoding, export) stay eager; the compiled
    module shares its parameters, so checkpoints are unchanged. Batches of new shapes recompile, then run with
    dynamic shapes."""
    return torch.compile(objective)

