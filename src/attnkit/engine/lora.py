"""The engine's LoRA layer: :class:`attnkit.lora.LoRALinear`'s ``h = W x + b + s B A Drop(x)`` in one autograd node.

The reference composes it from modules (the frozen ``nn.Linear``, ``nn.Dropout``, two thin products, a sum), and
autograd keeps what each of them needs: the float dropout mask, the dropped input, the adapters' output, and a
gradient of ``x`` from each branch to add up. :func:`lora_linear` computes the same with fewer passes over the
activations, which is what a CPU spends most of a LoRA update on (the products are a few, and fast):

* forward: ``y = x W^T + b``, then the adapters' product added into ``y`` in place (``addmm_``: no second
  ``(N, d_out)`` tensor and no sum); the dropout scale ``1 / (1 - p)`` and ``s`` are one factor on the thin
  ``(N, n r)`` product ``z``, not a pass over ``x``;
* kept for backward: the dropped input ``Drop(x)`` (for ``dL/dA``), the mask as bytes, ``z`` (thin), the weights;
  nothing for the frozen ``W`` (``x`` itself is not needed: ``W`` gets no gradient);
* backward: ``g = dL/dy``; ``dL/dB = g^T z``, ``dL/dA = s (g B)^T Drop(x)``, and
  ``dL/dx = (s (g B) A) * mask + g W``, the base's product accumulated into the adapters' in place.

It runs when the base layer is frozen (always, after :func:`attnkit.lora.apply_lora`); a base that trains takes the
reference's path. Dropout draws the same bytes as :class:`~attnkit.engine.dropout.ByteDropout` from torch's
generator (``F.dropout``'s distribution on other devices), so that with one seed the two paths drop the same inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..lora import LoRALinear
from .dropout import keep_bytes

__all__ = ["EagerLoRALinear", "lora_linear"]


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[Tensor | None, float]:
    """Dropout's mask -> ``(keep (0 / 1, uint8) or None for no dropout, the scale of what is kept)``: byte dropout's
    on the CPU (:func:`~attnkit.engine.dropout.keep_bytes`), ``F.dropout``'s distribution elsewhere."""
    if p <= 0.0:
        return None, 1.0
    if device.type == "cpu":
        return keep_bytes(shape, p, device)
    return (torch.rand(shape, device=device) >= p).to(torch.uint8), 1.0 / (1.0 - p)


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor, B: Tensor,  # type: ignore[override]
                scale: float, p: float) -> Tensor:
        y = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())  # (N, d_out): W x + b
        keep, kept_scale = keep_mask(x.shape, p, x.device)  # (N, d_in) bytes, or None
        dropped = x if keep is None else x * keep  # (N, d_in): Drop(x) without its scale
        scale = scale * kept_scale  # s / (1 - p): applied to the thin product
        z = (dropped @ A.t()).mul_(scale)  # (N, n r)
        y.addmm_(z, B.t())  # (N, d_out): + s B A Drop(x), in place
        ctx.save_for_backward(weight, A, B, dropped, z, keep)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        weight, A, B, dropped, z, keep = ctx.saved_tensors
        grad_x = grad_A = grad_B = None
        if ctx.needs_input_grad[4]:
            grad_B = g.t() @ z  # (d_out, n r)
        g_z = (g @ B).mul_(ctx.scale)  # (N, n r): dL/d(A Drop(x)) times the dropout's and LoRA's scales
        if ctx.needs_input_grad[3]:
            grad_A = g_z.t() @ dropped  # (n r, d_in)
        if ctx.needs_input_grad[0]:
            grad_x = g_z @ A  # (N, d_in): through the adapters
            if keep is not None:
                grad_x.mul_(keep)
            grad_x.addmm_(g, weight)  # + g W: through the frozen base
        return grad_x, None, None, grad_A, grad_B, None, None


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, A: Tensor, B: Tensor, scale: float,
                p: float = 0.0) -> Tensor:
    """``x W^T + b + scale B A Drop_p(x)`` for a frozen ``weight`` ``(d_out, d_in)`` and ``bias``, adapters ``A``
    ``(n r, d_in)`` and ``B`` ``(d_out, n r)``; ``x`` ``(..., d_in)`` -> ``(..., d_out)`` (module doc). Under autocast
    it computes in the autocast dtype, as ``F.linear`` would."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight, A, B = (t.to(dtype) for t in (x, weight, A, B))
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        y = _LoRALinear.apply(x.reshape(-1, x.size(-1)), weight, bias, A, B, scale, p)  # (N, d_out)
    return y.view(*x.shape[:-1], y.size(-1))


class EagerLoRALinear(LoRALinear):
    """:class:`~attnkit.lora.LoRALinear` computing with :func:`lora_linear` while its base is frozen."""

    def forward(self, x: Tensor) -> Tensor:
        base = self.base
        if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
            return super().forward(x)  # a base that trains: the reference's path keeps its gradient
        p = self.dropout.p if isinstance(self.dropout, nn.Dropout) and self.dropout.training else 0.0
        return lora_linear(x, base.weight, base.bias, self.stacked_A(), self.placed_B(), self.scale, p)
