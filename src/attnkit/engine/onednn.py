"""float32 linear layers through oneDNN rather than the BLAS, where that measures faster on this host.

torch computes a float32 ``nn.Linear`` (``y = x W^T + b``) and both products of its backward pass
(``dx = dy W``, ``dW = dy^T x``) with its BLAS, Intel's MKL. MKL picks its kernels by the CPU's vendor: on an AMD
CPU with AVX-512 it does not run its AVX-512 kernels. oneDNN, which torch ships for its bf16 and int8 products,
picks them by the instruction set. The products, and so the arithmetic, are the same; only the summation order
differs (float32 rounding, ``tests/test_onednn.py``). Which library is faster is a property of the host, so it is
measured with the precision: ``precision: auto`` in training times the model's own products three ways, float32
through the BLAS, float32 through oneDNN and bf16 autocast (:mod:`.precision`), and a run that chose oneDNN has
its ``nn.Linear`` layers changed to :class:`OneDNNLinear` (:func:`use_onednn`), parameters untouched. The run's
``precision.json`` records the choice and its timings; a resumed run computes as it started.

:func:`onednn_linear` is one autograd node: forward and ``dx`` are oneDNN's linear (``torch.ops.mkldnn.
_linear_pointwise``, the op Inductor's CPU code calls) of ``x`` and ``W``, and of ``dy`` and ``W^T``; ``dW`` is the
linear of ``dy^T`` and ``x^T``. The bias is added outside it, so autograd sums its gradient. Where oneDNN does not
apply (not float32 on a CPU, under autocast, while compiling or exporting, no rows) :class:`OneDNNLinear` is
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["OneDNNLinear", "available", "onednn_linear", "use_onednn"]


def available() -> bool:
    """Whether this torch has oneDNN's linear op (torch built with oneDNN, as the PyPI wheels are)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _linear(x: Tensor, w: Tensor) -> Tensor:
    """oneDNN's ``x W^T``: ``x`` ``(m, in)``, ``w`` ``(out, in)`` -> ``(m, out)``."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """``y = x W^T`` with its backward ``dx = dy W``, ``dW = dy^T x``, every product through oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:  # (..., in), (out, in) -> (..., out)
        ctx.save_for_backward(x, weight)
        return _linear(x.reshape(-1, x.size(-1)), weight).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None]:  # dy (..., out)
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.size(-1))  # (m, out)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _linear(dy2, weight.t().contiguous()).view(x.shape)  # (m, in): dy W
        if ctx.needs_input_grad[1]:
            dw = _linear(dy2.t(), x.reshape(-1, x.size(-1)).t())  # (out, in): dy^T x
        return dx, dw


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with its products through oneDNN where it applies (float32 on a CPU, no
    autocast, not compiling, at least one row; otherwise ``F.linear`` itself): ``x`` ``(..., in)`` -> ``(..., out)``."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0
            or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        return F.linear(x, weight, bias)
    y = _OneDNNLinear.apply(x, weight)  # (..., out)
    return y if bias is None else y + bias


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`onednn_linear`: the same parameters, the same state dict."""

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        return onednn_linear(x, self.weight, self.bias)


def use_onednn(model: nn.Module) -> int:
    """Every module of ``model`` whose class is exactly ``nn.Linear`` made a :class:`OneDNNLinear`, in place
    (parameters, hooks and state dict untouched); returns how many. Subclasses (LoRA's layers, int8 layers) keep
    their own forward. :func:`~.eager.to_reference` turns them back."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            changed += 1
    return changed
