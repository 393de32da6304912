"""The engine's attention kernel: :func:`fast_attend`, the same function as :func:`attnkit.attention.attend`.

What it does differently from the reference, each where it is faster (``docs/engine.md`` says why;
``tests/test_engine.py`` checks each against the reference):

1. **Fused kernel.** When nobody asks for the weights and the score is (scaled) dot with softmax,
   ``F.scaled_dot_product_attention`` computes the context without materialising the
   ``(T_q, T_k)`` weights — except for bfloat16 on the CPU with fewer than
   :data:`FUSED_BF16_CPU_MIN_KEYS` keys, where torch's fused kernel is slower than matmul + softmax.
2. **Weights in the compute dtype.** Under bf16 autocast the softmax output stays bfloat16
   when it is not returned (torch accumulates in float32 and rounds once, as casting would), except
   on the CPU below :data:`BF16_SOFTMAX_CPU_MIN_KEYS` keys, where torch's bf16 softmax backward is slow.
3. **Byte dropout** on the weights (:mod:`attnkit.engine.dropout`).
4. **Causal, grouped-query and biased attention in the fused kernel**: the look-ahead mask as
   ``is_causal`` (no ``(T, T)`` mask built, masked blocks skipped), key/value heads shared by
   ``enable_gqa`` (no copy), ALiBi's bias as a float ``attn_mask``.
5. **Grouped queries** for beam search: queries ``(B, H, T, d)`` against keys ``(A, H, S, d)``
   with ``B = g * A`` — each memory row serves ``g`` consecutive hypothesis rows
   (:class:`attnkit.engine.decoding.SharedMemoryState`), so the memory is never copied per beam.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import (
    _PARAMETER_FREE,
    Dropout,
    Normalizer,
    ScoreName,
    Scorer,
    causal_mask,
    check_attention_args,
    hard_attention,
    repeat_kv,
    soft_attention,
)
from .dropout import byte_dropout

#: On the CPU, torch's fused bfloat16 kernel is slower than matmul + softmax below this many keys.
FUSED_BF16_CPU_MIN_KEYS = 256
#: On the CPU, torch's bfloat16 softmax backward is slow for rows shorter than this: below it the
#: weights are computed in float32 and cast for ``weights @ v``.
BF16_SOFTMAX_CPU_MIN_KEYS = 32


def _fused_is_faster(q: Tensor, k: Tensor) -> bool:
    return not (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k.size(-2) < FUSED_BF16_CPU_MIN_KEYS)


def _bf16_softmax_is_faster(e: Tensor) -> bool:
    return not (e.device.type == "cpu" and e.size(-1) < BF16_SOFTMAX_CPU_MIN_KEYS)


_EMPTY_ROWS_ZEROED: dict[tuple[str, torch.dtype], bool] = {}


def _fused_zeroes_empty_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's fused kernel already returns 0 for a query with no key (probed once per device/dtype)."""
    key = (device.type, dtype)
    if key not in _EMPTY_ROWS_ZEROED:
        x = torch.ones(1, 1, 2, 2, device=device, dtype=dtype)
        none = torch.zeros(1, 1, 2, 2, dtype=torch.bool, device=device)
        with torch.no_grad():
            out = F.scaled_dot_product_attention(x, x, x, attn_mask=none)
        _EMPTY_ROWS_ZEROED[key] = bool((out == 0).all())
    return _EMPTY_ROWS_ZEROED[key]


def soft_attention_in_dtype(e: Tensor, mask: Tensor | None, beta: float) -> Tensor:
    """:func:`attnkit.attention.soft_attention` returned in ``e``'s dtype, rounded once.

    With ``beta == 1`` the softmax reads ``e`` as it is (torch accumulates a bfloat16 softmax in
    float32), so no ``(..., T_q, T_k)`` float32 copy is made; otherwise the reference's float32
    weights are cast. Rows with nothing to attend to are zeroed only when there are any.
    """
    if beta != 1.0:
        return soft_attention(e, mask, beta).to(e.dtype)
    logits = e if mask is None else e.masked_fill(~mask, torch.finfo(e.dtype).min)
    weights = torch.softmax(logits, dim=-1)
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)
        if torch.compiler.is_compiling() or not bool(has_key.all()):  # no Python branch on data in a graph
            weights = weights * has_key
    return weights


def _dropout_rate(dropout: float | Dropout) -> float:
    """The rate of a probability or of an ``nn.Dropout``-like module (0 when it is not training)."""
    if callable(dropout):
        return float(getattr(dropout, "p", 0.0)) if getattr(dropout, "training", True) else 0.0
    return dropout


def fast_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    score: ScoreName | Scorer = "scaled_dot",
    normalizer: Normalizer = "softmax",
    beta: float | None = None,
    dropout: float | Dropout = 0.0,
    need_weights: bool = True,
    straight_through: bool = False,
    bias: Tensor | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`attnkit.attention.attend`, faster; same arguments and results (see the module docstring).

    Also accepts ``q`` ``(B, H, T_q, d)`` with ``k``, ``v`` ``(A, H, T_k, d)`` and ``B = g * A``
    (a mask broadcastable to ``(A, H, T_q, T_k)``): each key row serves ``g`` consecutive query rows.
    """
    check_attention_args(score, normalizer, mask)
    if q.dim() == 4 and k.dim() == 4 and q.size(0) != k.size(0):
        return _grouped(q, k, v, mask, score=score, normalizer=normalizer, beta=beta, dropout=dropout,
                        need_weights=need_weights, straight_through=straight_through, bias=bias, causal=causal)
    T_q, T_k = q.size(-2), k.size(-2)
    if causal and T_q == 1:
        causal = False  # one query at the newest position sees every key
    p = _dropout_rate(dropout)
    grouped_kv = q.dim() == 4 and k.dim() == 4 and k.size(1) != q.size(1)
    # In a compiled graph, one query's matmul + softmax become generated kernels, faster than the fused kernel
    compiled_step = T_q == 1 and torch.compiler.is_compiling()
    if not need_weights and normalizer == "softmax" and score in ("dot", "scaled_dot") and _fused_is_faster(q, k) \
            and not compiled_step:
        scale = 1.0 / math.sqrt(q.size(-1)) if score == "scaled_dot" else 1.0
        scale *= 1.0 if beta is None else beta
        is_causal = bool(causal and mask is None and bias is None and T_q == T_k)  # the kernel's own look-ahead mask
        attn_mask = mask
        if causal and not is_causal:
            look_ahead = causal_mask(T_q, T_k, device=q.device)  # (T_q, T_k)
            attn_mask = look_ahead if mask is None else mask & look_ahead
        keep = attn_mask  # boolean: who may be attended to
        if bias is not None:  # SDPA adds attn_mask after scaling: scale the bias by beta as the reference does
            b = bias * (1.0 if beta is None else beta)
            attn_mask = b if attn_mask is None else b.masked_fill(~attn_mask, float("-inf"))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, scale=scale,
                                                 is_causal=is_causal, enable_gqa=grouped_kv)
        if keep is not None and not _fused_zeroes_empty_rows(q.device, q.dtype):
            # Older kernels return uniform weights or NaN for rows with nothing to attend to.
            context = context.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
        return context, None

    if grouped_kv:
        groups = q.size(1) // k.size(1)
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, H, T_k, d)
    if causal:
        look_ahead = causal_mask(T_q, T_k, device=q.device)  # (T_q, T_k)
        mask = look_ahead if mask is None else mask & look_ahead
    scorer = _PARAMETER_FREE[score] if isinstance(score, str) else score
    e = scorer(q, k)  # (..., T_q, T_k)
    if bias is not None:
        e = e + bias  # position bias (ALiBi)
    beta = 1.0 if beta is None else beta
    if normalizer == "softmax":
        in_dtype = not need_weights and _bf16_softmax_is_faster(e)  # weights that are shown stay float32
        weights = soft_attention_in_dtype(e, mask, beta) if in_dtype else soft_attention(e, mask, beta)
    else:
        weights = hard_attention(e, mask, beta, straight_through=straight_through)
    dropped = byte_dropout(weights, p) if p > 0.0 else weights
    context = dropped.to(v.dtype) @ v  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)
    return context, (weights if need_weights else None)


def _grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, **kwargs) -> tuple[Tensor, Tensor | None]:
    """Queries of ``g`` consecutive rows against one key row: just more queries for the same keys."""
    B, H, T, d = q.shape
    A = k.size(0)
    if B % A or (mask is not None and mask.dim() == 4 and mask.size(0) not in (1, A)):
        raise ValueError(f"queries {tuple(q.shape)} and keys {tuple(k.shape)}: every key row must serve the "
                         f"same number of consecutive query rows (mask {None if mask is None else tuple(mask.shape)})")
    g = B // A
    q = q.view(A, g, H, T, d).transpose(1, 2).reshape(A, H, g * T, d)  # (B, H, T, d) -> (A, H, g*T, d)
    context, weights = fast_attend(q, k, v, mask, **kwargs)
    dv, S = context.size(-1), k.size(-2)
    context = context.view(A, H, g, T, dv).transpose(1, 2).reshape(B, H, T, dv)  # (A, H, g*T, d_v) -> (B, H, T, d_v)
    if weights is not None:
        weights = weights.view(A, H, g, T, S).transpose(1, 2).reshape(B, H, T, S)  # -> (B, H, T, S)
    return context, weights
