"""Byte dropout: the engine's replacement for ``nn.Dropout`` (the reference) on the CPU.

Dropout is ``y = x * m / (1 - p)`` with ``m_i ~ Bernoulli(1 - p)`` (Srivastava et al. 2014).
On the CPU, ``F.dropout`` draws one 32-bit random number per element, which costs more than
a bf16 matmul of the same activation; :func:`byte_dropout` draws random *bytes* instead,
eight per 64-bit draw (``docs/engine.md`` says why). Deviation: ``p`` is rounded to
a multiple of 1/256 (0.1 -> 26/256 = 0.1016), and the scale uses the rounded value, so the
expectation is still exact in float32 (in bfloat16 the scale itself has 8 bits: 1.109 for
256/230 = 1.113, kept values 0.3% small). Other devices use ``F.dropout``. The stream comes
from torch's global generator, so ``torch.manual_seed`` (and checkpointed RNG state) reproduce it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_INT64_MIN = -(2**63)


def random_bytes(shape: torch.Size | tuple[int, ...], device: torch.device) -> Tensor:
    """Uniform random ``uint8`` tensor of ``shape`` from torch's generator (8 bytes per 64-bit draw)."""
    n = 1
    for s in shape:
        n *= s
    # from INT64_MIN with no upper bound: all 64 bits random, and no modulo to compute
    words = torch.empty((n + 7) // 8, dtype=torch.int64, device=device).random_(_INT64_MIN, None)
    return words.view(torch.uint8)[:n].view(shape)


def keep_bytes(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> tuple[Tensor | None, float]:
    """Byte dropout's mask on the CPU: ``(keep, scale)``, ``keep`` a ``uint8`` tensor of ``shape``, 1 with probability
    ``1 - p'`` (``p'``: ``p`` rounded to a multiple of 1/256) else 0, and ``scale = 1 / (1 - p')``; ``(None, 1)`` when
    ``p'`` is 0. Dropout is ``x * keep * scale``."""
    drop_below = round(p * 256)  # a byte b < drop_below means "drop": P = drop_below / 256
    if drop_below == 0:  # p < 1/512
        return None, 1.0
    if drop_below >= 256:
        return torch.zeros(shape, dtype=torch.uint8, device=device), 0.0
    # keep = 1 if b >= drop_below else 0, by uint8 clamp and subtract: on the CPU a uint8 comparison,
    # and a bool -> bfloat16 conversion, are scalar loops, while these and uint8 -> bfloat16 are vectorised
    keep = random_bytes(shape, device).clamp_(drop_below - 1, drop_below).sub_(drop_below - 1)
    return keep, 256.0 / (256 - drop_below)


def byte_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)`` (training only)."""
    if not training or p <= 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    keep, scale = keep_bytes(x.shape, p, x.device)
    if keep is None:
        return x
    if scale == 0.0:  # everything dropped
        return torch.zeros_like(x)
    return x * keep.to(x.dtype).mul_(scale)  # one product with x: one tensor saved


class ByteDropout(nn.Dropout):
    """``nn.Dropout`` with :func:`byte_dropout`'s random bytes; :func:`attnkit.engine.to_eager` swaps it in."""

    def forward(self, x: Tensor) -> Tensor:
        return byte_dropout(x, self.p, self.training)
