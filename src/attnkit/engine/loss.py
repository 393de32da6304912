"""The training loss: label-smoothed cross-entropy fused with the output projection.

For hidden states ``h_i`` (the decoder output at each real target position), the output layer
``z_i = W h_i + b`` and targets ``y_i``::

    loss = sum_i  -sum_v q_iv log softmax(z_i)_v,      q_i = (1 - eps) onehot(y_i) + eps / V

(Szegedy et al. 2016 label smoothing, as ``F.cross_entropy(..., label_smoothing=eps)``).

The reference (:class:`attnkit.tasks.objectives.Seq2SeqLoss`) computes every logit, then
``F.cross_entropy``. A 4k-token batch over an 8k vocabulary has 32M logits, and their float32
log-softmax and gradient dominate the memory traffic of an update. :func:`linear_cross_entropy`
never holds them at once: it walks the rows in chunks, and because the loss is a plain sum it computes each
chunk's gradients right away (``dL/dz = softmax(z) - q``, ``dL/dh = dL/dz W``,
``dL/dW = dL/dz^T h``); backward only scales them by the incoming gradient. Only the gradients wanted are
formed: a frozen output layer (a LoRA run's, :mod:`attnkit.lora`) costs no ``dL/dW``, a third of the work.

Each chunk makes one pass over its logits, the softmax ``p``; everything else is per row:

- ``log sum_v exp z_v = z_y - log p_y``, so ``nll = -log p_y`` and the smoothing term
  ``-(1/V) sum_v log p_v = log sum exp z - (1/V) sum_v z_v``, where ``sum_v z_v = h . sum_v W_v
  + sum_v b_v`` needs no logits. (A ``p_y`` that underflows takes its row's exact logsumexp.)
- The uniform part of ``q`` adds a rank-one term to the gradients, applied once:
  ``dL/dh -= (eps/V) sum_v W_v`` per row, ``dL/dW -= (eps/V) sum_i h_i`` per vocabulary row,
  ``dL/db -= eps N / V``. Only the target entries of ``p`` change (``p_y - (1 - eps)``).

The matmuls and the softmax's output run in the autocast dtype (bfloat16 on this CPU; the
softmax accumulates in float32 either way); the loss and the gradients are summed in float32.
In bf16 the logits are rounded to bf16 as autocast's ``F.linear`` would round them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..common.numeric import round_up

#: Rows per chunk on the CPU: 1024 x 8k logits at a time.
CHUNK_ROWS = 1024
#: Logits per chunk on a GPU (at least :data:`CHUNK_ROWS` rows): there memory is plentiful and every chunk costs
#: a dozen kernel launches, so one chunk usually covers the whole batch.
GPU_CHUNK_LOGITS = 1 << 26
#: The last chunk is padded to a multiple of this many rows. The number of scored tokens changes
#: every batch, and oneDNN (bf16 matmuls on the CPU) builds and keeps a kernel per matrix shape:
#: unpadded, every batch would add three, and the process's memory would grow with them.
ROW_MULTIPLE = 128
#: Below this a target's probability has lost precision (float32 / bfloat16 subnormals start at
#: 1.2e-38), and its row's log-sum-exp is computed directly instead.
UNDERFLOW = 1e-30


def select_positions(x: Tensor, positions: Tensor) -> Tensor:
    """``x`` ``(B, T, d)`` at the ``True`` entries of ``positions`` ``(B, T)`` -> ``(N, d)``, as ``x[positions]``.

    Gathers with ``index_select``, whose backward is an ``index_add``: on the CPU much cheaper than
    boolean indexing's backward, an accumulating ``index_put``.
    """
    rows = positions.flatten().nonzero().squeeze(1)  # (N,)
    return x.flatten(0, 1).index_select(0, rows)  # (B*T, d) -> (N, d)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # type: ignore[override]
                eps: float, chunk: int, compute_dtype: torch.dtype, wanted: tuple[bool, bool, bool]) -> Tensor:
        N, V = hidden.size(0), weight.size(0)
        W = weight.to(compute_dtype)  # (V, d)
        b = None if bias is None else bias.to(compute_dtype)  # (V,)
        W_sum = weight.float().sum(dim=0)  # (d,) = sum_v W_v
        hidden32 = hidden.float()  # (N, d)
        z_sum = hidden32 @ W_sum  # (N,) = sum_v z_v, without the logits
        if bias is not None:
            z_sum += bias.float().sum()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with_grad = any(wanted)  # which of hidden, weight, bias need a gradient: a frozen output layer needs none
        grad_h = torch.empty_like(hidden, dtype=torch.float32) if wanted[0] else None  # (N, d)
        grad_W = torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None  # (V, d)
        grad_b = torch.zeros(V, dtype=torch.float32, device=hidden.device) if wanted[2] else None  # (V,)
        for start in range(0, N, chunk):
            h = hidden[start: start + chunk].to(compute_dtype)  # (n, d)
            y = targets[start: start + chunk]  # (n,)
            n = h.size(0)
            rows = min(round_up(n, ROW_MULTIPLE), max(chunk, n))  # see ROW_MULTIPLE
            if rows > n:  # zero rows; their loss and gradient are dropped below
                h = torch.cat([h, h.new_zeros(rows - n, h.size(1))])
                y = torch.cat([y, y.new_zeros(rows - n)])
            z = h @ W.t() if b is None else torch.addmm(b, h, W.t())  # (rows, V)
            p = torch.softmax(z, dim=-1)  # (rows, V), accumulated in float32, stored in z's dtype
            z_y = z.gather(1, y[:, None]).squeeze(1)[:n].float()  # (n,)
            p_y = p.gather(1, y[:, None]).squeeze(1).float()  # (rows,)
            lse = z_y - p_y[:n].log()  # (n,) log sum_v exp z_v
            lost = p_y[:n] < UNDERFLOW
            if z.is_cuda:  # no wait for the GPU mid-update: the exact log-sum-exp for every row, kept where lost
                lse = torch.where(lost, torch.logsumexp(z[:n].float(), dim=-1), lse)
            elif bool(lost.any()):
                lse[lost] = torch.logsumexp(z[:n][lost].float(), dim=-1)
            smooth = lse - z_sum[start: start + n] / V  # -(1/V) sum_v log p_v
            total += ((1.0 - eps) * (lse - z_y) + eps * smooth).sum()
            if with_grad:
                g = p  # becomes p - (1 - eps) onehot(y) in place; the -eps/V is added once, below
                targets_at = torch.arange(rows, device=y.device) * V + y  # (rows,) flat index of each target
                g.view(-1).index_put_((targets_at,), (p_y - (1.0 - eps)).to(g.dtype))
                g[n:] = 0.0  # padding rows
                if grad_h is not None:
                    grad_h[start: start + chunk] = (g @ W)[:n]  # (rows, V) @ (V, d)
                if grad_W is not None:
                    grad_W += g.t() @ h  # (V, rows) @ (rows, d)
                if grad_b is not None:
                    grad_b += g.sum(dim=0, dtype=torch.float32)
        # the uniform eps/V of q: a rank-one term in each gradient
        if grad_h is not None:
            grad_h -= (eps / V) * W_sum
        if grad_W is not None:
            grad_W -= (eps / V) * hidden32.sum(dim=0)
        if grad_b is not None:
            grad_b -= eps * N / V
        ctx.grads = (grad_h, grad_W, grad_b)  # not inputs or outputs: kept as they are until backward
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        grads = [None if g is None else (g * grad_out).to(dtype)
                 for g, dtype in zip(ctx.grads, ctx.dtypes, strict=True)]
        ctx.grads = None
        return *grads, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, *,
                         label_smoothing: float = 0.0, chunk: int | None = None) -> Tensor:
    """Summed label-smoothed cross-entropy of ``hidden @ weight.T + bias`` against ``targets``.

    Equal to ``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets,
    label_smoothing=label_smoothing, reduction="sum")`` (see the module docstring), with memory
    for one chunk of logits instead of all of them.

    :param hidden: ``(N, d)`` features of the scored positions (padding already removed).
    :param weight: ``(V, d)`` output projection (may be tied to an embedding).
    :param bias: ``(V,)`` or None.
    :param targets: ``(N,)`` long class indices.
    :param chunk: rows per chunk; by default :data:`CHUNK_ROWS` on the CPU, and on a GPU as many as
        :data:`GPU_CHUNK_LOGITS` logits.
    :returns: a float32 scalar.
    """
    if chunk is None:
        chunk = max(CHUNK_ROWS, GPU_CHUNK_LOGITS // weight.size(0)) if hidden.is_cuda else CHUNK_ROWS
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grad = torch.is_grad_enabled()
    wanted = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, label_smoothing, chunk, dtype, wanted)


class FusedSeq2SeqLoss(nn.Module):
    """The engine's training objective for a sequence-to-sequence model: equals
    :class:`attnkit.tasks.objectives.Seq2SeqLoss`.

    ``model.features`` up to the output layer, the scored positions gathered with
    :func:`select_positions`, and the output layer fused with the loss (:func:`linear_cross_entropy`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, src: Tensor, tgt_in: Tensor, scored: Tensor, targets: Tensor,
                label_smoothing: float = 0.0) -> Tensor:
        hidden = select_positions(self.model.features(src, tgt_in), scored)  # (N, d)
        out = self.model.output_layer
        return linear_cross_entropy(hidden, out.weight, out.bias, targets, label_smoothing=label_smoothing)


class FusedLMLoss(nn.Module):
    """The engine's training objective for a language model: equals :class:`attnkit.tasks.objectives.LanguageModelLoss`.

    Every position of packed blocks is scored (they have no padding), so the hidden states go to the output layer
    fused with the loss (:func:`linear_cross_entropy`) as they are, without the ``(B, T, V)`` logits; with
    ``scored`` (a conversation's assistant tokens) only those positions, gathered by :func:`select_positions`.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, targets: Tensor, label_smoothing: float = 0.0,
                scored: Tensor | None = None) -> Tensor:
        hidden, _, _ = self.model.features(inputs)  # (B, T, d)
        if scored is None:
            hidden, targets = hidden.flatten(0, 1), targets.flatten()  # (B*T, d), (B*T,)
        else:
            hidden, targets = select_positions(hidden, scored), targets[scored]  # (N, d), (N,)
        out = self.model.output_layer
        return linear_cross_entropy(hidden, out.weight, out.bias, targets, label_smoothing=label_smoothing)
