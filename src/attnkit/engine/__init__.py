"""The engine: every speed trick of attnkit, apart from the textbook code it replaces, chosen by one switch.

The textbook (:mod:`attnkit.attention`, :mod:`~attnkit.multihead`, :mod:`~attnkit.layers`, :mod:`~attnkit.transformer`,
:mod:`~attnkit.lm`, :mod:`~attnkit.sampling`, the tasks' ``F.cross_entropy``) reads like the seeds and does not know
the engine exists. The engine builds its fast paths from the textbook's public pieces, and :class:`Engine` says which
run a model (``--engine``, ``--precision``, ``--quantize`` on every command; ``train.engine``, ``train.precision``):

=============  ==========================================================================================
mode           what runs
=============  ==========================================================================================
``reference``  the textbook's modules and plain torch ops, nothing of the engine
``eager``      the engine's kernels and data structures, swapped into the model (:mod:`.eager`): fused
               attention, byte dropout, fused losses, caches that grow in place, shared beam memory
``compiled``   eager, and a language model's generation through a prompt pass and a one-token step
               compiled ahead of time (:mod:`.compiled_decoding`); other work has no compiled path and
               runs eager (said once on standard error by the command)
=============  ==========================================================================================

Beside the mode, ``precision`` (``float32``, ``bf16``, or ``auto``: what measures faster on this host) and
``quantize`` (``none``, ``int8``: weight-only int8 linear layers, :mod:`.quantize`).

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
products as loops
:class:`Int8Linear`: int8 weights, a scale    ``nn.Linear``                                 ``quantize.py``
per output row (``quantize: int8``)
:func:`int8_matvec`: one row's int8 product,  ``F.linear`` of the widened weight            ``native.py``
a hand-written kernel (C++, built here)
:class:`EagerLoRALinear`: a LoRA layer with   :class:`attnkit.lora.LoRALinear`              ``engine/lora.py``
a frozen base as one autograd node
:func:`hold_freed_memory`: freed memory kept  (the C library's ``malloc`` as it is)          ``engine/memory.py``
for the next update (training on a CPU)
:class:`OneDNNLinear`: float32 products      ``nn.Linear`` (torch's BLAS)                  ``engine/onednn.py``
through oneDNN, where training's
calibration measures them faster
============================================  ============================================  =======================

Each has a test against its reference (``tests/test_engine.py``, ``tests/test_compiled_decoding.py``,
``tests/test_quantize.py``: int8 against the dequantized float layer, since rounding moves the logits;
``tests/test_native.py``: the kernel against the widened product; ``tests/test_onednn.py``: oneDNN's products
against ``F.linear``), and
``tests/test_modes.py`` holds every mode to ``reference`` for every kind of model.

Precision: :mod:`attnkit.engine.precision` times the model's own matrix products in float32 and in bf16 on this host
(``precision: auto`` in training and at inference, :func:`~.precision.choose_precision`; in training float32
through oneDNN as well, :mod:`.onednn`), and
:func:`~.precision.bf16_weights` stores a model's weights in bf16 for inference (``tests/test_precision.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from torch import Tensor, nn

from ..common.errors import UserError
from ..lm import LanguageModel
from ..sampling import StepModel, choose_next
from ..transformer import Transformer
from .attention import fast_attend
from .compiled_decoding import CompiledDecoder
from .decoding import GrowingKVCache, SharedMemoryState
from .dropout import ByteDropout
from .eager import to_eager, to_reference
from .loss import FusedLMLoss, FusedSeq2SeqLoss
from .mlm import FusedMLMLoss
from .native import int8_matvec
from .precision import Choice, bf16_weights, choose_precision
from .quantize import quantize_int8

Mode = Literal["reference", "eager", "compiled"]
MODES: tuple[Mode, ...] = ("reference", "eager", "compiled")
Precision = Literal["auto", "float32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("auto", "float32", "bf16")
Quantize = Literal["none", "int8"]
QUANTIZE: tuple[Quantize, ...] = ("none", "int8")

__all__ = ["MODES", "PRECISIONS", "QUANTIZE", "ByteDropout", "Engine", "FusedLMLoss", "FusedMLMLoss",
           "FusedSeq2SeqLoss", "GrowingKVCache", "Mode", "Precision", "Quantize", "SharedMemoryState", "fast_attend",
           "generation_decoder", "int8_matvec", "prepare", "resolve", "to_eager", "to_reference"]


@dataclass(frozen=True)
class Engine:
    """How a model runs: the mode, the precision and the weights' quantization (see the module docstring)."""

    mode: Mode = "eager"
    precision: Precision = "float32"
    quantize: Quantize = "none"

    def __post_init__(self) -> None:
        for name, value, allowed in (("--engine", self.mode, MODES), ("--precision", self.precision, PRECISIONS),
                                     ("--quantize", self.quantize, QUANTIZE)):
            if value not in allowed:
                raise UserError(f"{name} {value}: choose one of {', '.join(allowed)}")
        if self.mode == "reference" and self.quantize != "none":
            raise UserError(f"--quantize {self.quantize} is the engine's (int8 linear layers); the reference runs the "
                            "textbook's float layers: use --engine eager or compiled with it")

    def __str__(self) -> str:
        quantized = "" if self.quantize == "none" else f", {self.quantize} weights"
        return f"{self.mode} ({self.precision}{quantized})"


def resolve(model: nn.Module, engine: Engine) -> tuple[Engine, Choice | None]:
    """``engine`` with ``precision: auto`` replaced by what a short measurement of ``model``'s own matrix shapes finds
    faster on its device (:func:`~.precision.choose_precision`: for decoding steps where the model has a
    single-step interface, else for whole forward passes), and that measurement; other engines as they are."""
    if engine.precision != "auto":
        return engine, None
    steps = callable(getattr(model, "init_state", None)) or callable(getattr(model, "init_decoder", None))
    choice = choose_precision(model, next(model.parameters()).device, "decode" if steps else "forward")
    return replace(engine, precision=choice.precision), choice


def prepare(model: nn.Module, engine: Engine) -> nn.Module:
    """``model`` made to run as ``engine`` says: the textbook's classes (``reference``) or the engine's
    (``eager``, ``compiled``), in place, with its weights in bfloat16 for ``precision: bf16``; with ``quantize:
    int8`` a copy whose linear layers hold int8 weights (``model`` itself stays float). ``precision: auto`` is
    :func:`resolve` d first. The mode's compiled steps are made by :func:`generation_decoder`."""
    engine, _ = resolve(model, engine)
    model = to_reference(model) if engine.mode == "reference" else to_eager(model)
    if engine.precision == "bf16":
        model = bf16_weights(model, inplace=True)  # stored in bfloat16: no cast at every step
    if engine.quantize == "int8":
        if any(isinstance(m, Transformer) for m in model.modules()):
            raise UserError("--quantize int8: an encoder-decoder's cross-attention projects the encoder's memory with "
                            "slices of its weight, which int8 layers do not offer; quantize language models and "
                            "classifiers, or export the run to CTranslate2 (attnkit export --quantization int8)")

        model = quantize_int8(model)
    return model


def generation_decoder(model: LanguageModel, engine: Engine) -> tuple[StepModel, Callable[..., Tensor]]:
    """What :func:`attnkit.sampling.generate` runs for ``engine``, and how it chooses each token: the model itself
    (prepared by :func:`prepare`) and :func:`~attnkit.sampling.choose_next`, or in ``compiled`` mode a
    :class:`~attnkit.engine.compiled_decoding.CompiledDecoder` over it, which makes the greedy choice inside its
    compiled step."""
    if engine.mode != "compiled":
        return model, choose_next
    decoder = CompiledDecoder(model)
    return decoder, decoder.choose_next
