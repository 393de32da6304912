"""Weight-only int8: each linear layer's weight as int8 with one float scale per output row.

At batch 1 a decoding step reads every weight once per token, and on a CPU whose caches do not hold the float
weights the step waits on memory (``docs/engine.md``, int8 weights). Stored as int8 they are a
quarter of the bytes. Symmetric, per output row ``o`` (as CTranslate2's int8 and gpt-fast's weight-only int8)::

    s_o = max_i |W_oi| / 127        q_oi = round(W_oi / s_o)  in [-127, 127]
    y_o = s_o * sum_i x_i q_oi (+ b_o)

The activations stay in float (CTranslate2's int8 quantizes them too, per row, at every product). The rounding
error of ``q`` is at most ``s_o / 2`` per weight, so logits move a little and a greedy choice between two nearly
equal tokens may flip (``tests/test_quantize.py`` bounds both on a small model; the generation race counts the
rows whose greedy tokens stay float32's).
:func:`quantize_int8` gives a copy of a model whose ``nn.Linear`` layers are :class:`Int8Linear`, an ordinary model
(its forward, its step, :func:`~attnkit.sampling.generate`); :class:`~.compiled_decoding.CompiledDecoder` compiles
it with ``quantize="int8"``. How each product runs (:func:`int8_linear`): one float32 row on the CPU, eager or
compiled, by the hand-written kernel (:func:`~.native.int8_matvec`), which widens each int8 weight as it reads it
(compiled without it, a loop the compiler generates does the same); eagerly, by torch's weight-only int8 kernel for
bf16 and half activations on the CPU, else with the weight widened for one matrix product.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .aot import matvec_linear
from .native import int8_matvec, kernel

__all__ = ["Int8Linear", "fused_int8_fits", "int8_linear", "quantize_int8", "quantize_rows"]


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` ``(out, in)`` -> ``(q int8 (out, in), s (out,) float32)``, ``W ~= s[:, None] * q``, symmetric per row
    (a row of zeros gets the scale 1)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (out,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
    return q, scale


def fused_int8_fits(rows: Tensor, q: Tensor) -> bool:
    """Whether torch's weight-only int8 kernel (``torch._weight_int8pack_mm``) can take ``rows`` ``(N, in)`` and
    ``q`` ``(out, in)``: on the CPU, for bf16 or half rows (its x86 kernel is vectorized for those only), which it
    reads in aligned blocks of 16 unchecked (a row of another length, or unaligned, would be read past its end)."""
    return (rows.device.type == "cpu" and rows.dtype in (torch.bfloat16, torch.float16) and rows.size(-1) % 16 == 0
            and rows.is_contiguous() and q.is_contiguous() and rows.data_ptr() % 64 == 0 and q.data_ptr() % 64 == 0)


def int8_linear(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """``y_o = s_o * sum_i x_i q_oi``: ``x`` ``(..., in)``, ``q`` int8 ``(out, in)``, ``scale`` ``(out,)`` ->
    ``(..., out)`` in ``x``'s dtype, the products accumulated in float32 at least.

    One float32 row on the CPU that no gradient flows back to, eager or compiled: the hand-written kernel
    :func:`~.native.int8_matvec` (a compiled step calls it directly), which widens each int8 weight as it reads it;
    where it cannot be built, compiled (under ``torch.export``), :func:`~.aot.matvec_linear`, a loop the compiler
    generates. Eager bf16 or half rows on the CPU go to torch's weight-only int8 kernel where it can take them
    (:func:`fused_int8_fits`), which does the same. Otherwise the weight is widened to ``x``'s dtype for one matrix
    product (float32 rows on the CPU: torch's int8 kernel is not vectorized for them)."""
    scale = scale.to(x.dtype)
    if (x.numel() == x.size(-1) and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad
            and kernel() is not None):
        return int8_matvec(x, q, scale)  # one row: the hand-written kernel (compiled: called from the compiled code)
    if torch.compiler.is_exporting():
        y = matvec_linear(x, q)  # one row: sum_i x_i q_oi, the int8 weight widened inside the loop
        if y is not NotImplemented:
            return y * scale
    else:
        rows = x.reshape(-1, x.size(-1))  # (N, in): the kernel takes a matrix
        if fused_int8_fits(rows, q):
            return torch._weight_int8pack_mm(rows, q, scale).view(*x.shape[:-1], q.size(0))
    return F.linear(x, q.to(x.dtype)) * scale  # (..., out)


class Int8Linear(nn.Module):
    """``nn.Linear`` with its weight in int8 and a scale per output row: ``y = s * (x q^T) + b``
    (:func:`int8_linear`), eager or compiled.

    ``weight`` is the int8 ``q`` ``(out, in)`` (a buffer: nothing here trains), ``scale`` ``(out,)`` in the layer's
    float dtype, ``bias`` as the layer's."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(dtype))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        y = int8_linear(x, self.weight, self.scale)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> Tensor:
        """The float weight this layer computes with, ``s_o q_oi`` ``(out, in)``."""
        return self.scale[:, None] * self.weight.to(self.scale.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (in eval mode) with every ``nn.Linear`` replaced by :class:`Int8Linear` (with the layer's
    forward hooks); ``model`` is left as it is. Embeddings, norms and the other tensors are copied as they are (a
    tied output layer gets an int8 copy of the embedding, which the lookup keeps reading in float)."""
    quantized = copy.deepcopy(model).eval()
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                int8 = Int8Linear(child)
                int8._forward_pre_hooks.update(child._forward_pre_hooks)  # the layer's hooks act as before
                int8._forward_hooks.update(child._forward_hooks)
                setattr(parent, name, int8)
    return quantized
