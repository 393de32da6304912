"""Where attention is computed: masks, score functions, normalizers and the kernel ``attend``.

The seeds' recipe (SEEDS.md sections 2-4), for one query q against keys k_1..k_N and values
v_1..v_N::

    e_i     = score(q, k_i)                    # how well key i matches the query
    alpha   = softmax(beta * e)                # soft attention: ||alpha||_1 = 1
            | onehot(argmax(e))                # hard attention: ||alpha||_0 = 1
    context = sum_i alpha_i v_i

Score functions (``e_i``):

======================  =========================================  ================
name                    formula                                    reference
======================  =========================================  ================
``dot``                 ``q^T k``                                   Luong "dot"
``scaled_dot``          ``q^T k / sqrt(d_k)``                       Vaswani et al.
``general``             ``q^T W k``                                 Luong "general"
``additive``/``concat`` ``v^T tanh(W_q q + W_k k)``                 Bahdanau / Luong "concat"
======================  =========================================  ================

**Mask convention (the only one in attnkit):** a boolean tensor broadcastable to
``(..., T_q, T_k)`` where ``True`` means *may attend*. Masked logits are filled with the
dtype's minimum (the seeds add -1e9; the effect is the same and it cannot overflow in
bfloat16), and a query row with nothing to attend to yields a zero context, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import dropout as dropout_fn

ScoreName = Literal["dot", "scaled_dot", "general", "additive", "concat"]
Normalizer = Literal["softmax", "hard"]

# --------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------


def padding_mask(tokens: Tensor | None = None, pad_id: int = 0, *, lengths: Tensor | None = None,
                 max_len: int | None = None) -> Tensor:
    """Key padding mask: ``True`` at real tokens, ``False`` at ``<pad>``.

    Give either token ids ``(B, T)`` (with ``pad_id``) or ``lengths`` ``(B,)`` (with an
    optional ``max_len``). Returns ``(B, 1, T)``, ready to broadcast over query positions
    (insert a head axis with ``mask.unsqueeze(1)`` for ``(B, H, T_q, T_k)`` scores).
    """
    if (tokens is None) == (lengths is None):
        raise ValueError("padding_mask needs exactly one of tokens or lengths")
    if tokens is not None:
        keep = tokens.ne(pad_id)  # (B, T)
    else:
        assert lengths is not None
        T = int(lengths.max()) if max_len is None else max_len
        keep = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]  # (B, T)
    return keep.unsqueeze(-2)  # (B, 1, T)


def causal_mask(T_q: int, T_k: int | None = None, *, device: torch.device | None = None) -> Tensor:
    """Look-ahead mask ``(T_q, T_k)``: query ``i`` may attend to key ``j`` iff ``j <= i + (T_k - T_q)``.

    With ``T_k == T_q`` this is the lower triangle (position i sees positions <= i). When the
    queries are the *last* ``T_q`` positions of a longer sequence (incremental decoding with a
    cache), the offset keeps the same rule.
    """
    T_k = T_q if T_k is None else T_k
    return torch.ones(T_q, T_k, dtype=torch.bool, device=device).tril(diagonal=T_k - T_q)


# --------------------------------------------------------------------------------------
# Score functions: (q (..., T_q, d_q), k (..., T_k, d_k)) -> e (..., T_q, T_k)
# --------------------------------------------------------------------------------------


def dot_score(q: Tensor, k: Tensor) -> Tensor:
    """``e_ij = q_i^T k_j`` (seed 2, Luong "dot"). Shapes ``(..., T_q, d) x (..., T_k, d) -> (..., T_q, T_k)``."""
    return q @ k.transpose(-2, -1)


def scaled_dot_score(q: Tensor, k: Tensor) -> Tensor:
    """``e_ij = q_i^T k_j / sqrt(d_k)`` (Vaswani et al. eq. 1; seed 4).

    Scaling keeps the logits' variance at 1 when q and k have unit-variance components, so
    the softmax does not saturate and its gradient does not vanish.
    """
    return (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))


class GeneralScore(nn.Module):
    """Luong "general": ``e_ij = q_i^T W k_j`` with ``W`` of shape ``(d_q, d_k)``."""

    def __init__(self, d_q: int, d_k: int | None = None) -> None:
        super().__init__()
        self.W = nn.Linear(d_k or d_q, d_q, bias=False)  # maps keys into query space: W k

    def project_keys(self, k: Tensor) -> Tensor:
        """``W k`` ``(..., T_k, d_q)``: depends on the keys only, so an RNN decoder computes it once."""
        return self.W(k)

    def score_projected(self, q: Tensor, projected_k: Tensor) -> Tensor:
        return q @ projected_k.transpose(-2, -1)  # (..., T_q, d_q) @ (..., d_q, T_k)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return self.score_projected(q, self.project_keys(k))


class AdditiveScore(nn.Module):
    """Bahdanau / Luong "concat": ``e_ij = v^T tanh(W_q q_i + W_k k_j)``.

    Luong's ``v^T tanh(W [q; k])`` is the same function with ``W = [W_q  W_k]``.
    Memory is ``O(T_q * T_k * d_attn)``: meant for RNN decoders, one query step at a time.
    """

    def __init__(self, d_q: int, d_k: int | None = None, d_attn: int | None = None) -> None:
        super().__init__()
        d_attn = d_attn or d_q
        self.W_q = nn.Linear(d_q, d_attn, bias=False)
        self.W_k = nn.Linear(d_k or d_q, d_attn, bias=True)
        self.v = nn.Linear(d_attn, 1, bias=False)

    def project_keys(self, k: Tensor) -> Tensor:
        """``W_k k`` ``(..., T_k, d_attn)``: depends on the keys only, so an RNN decoder computes it once."""
        return self.W_k(k)

    def score_projected(self, q: Tensor, projected_k: Tensor) -> Tensor:
        hidden = torch.tanh(self.W_q(q).unsqueeze(-2) + projected_k.unsqueeze(-3))  # (..., T_q, T_k, d_attn)
        return self.v(hidden).squeeze(-1)  # (..., T_q, T_k)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return self.score_projected(q, self.project_keys(k))


Scorer = Callable[[Tensor, Tensor], Tensor]
_PARAMETER_FREE: dict[str, Scorer] = {"dot": dot_score, "scaled_dot": scaled_dot_score}


def make_scorer(name: ScoreName, d_q: int, d_k: int | None = None) -> Scorer:
    """Build a score function by name; ``general`` and ``additive``/``concat`` get fresh parameters."""
    if name in _PARAMETER_FREE:
        return _PARAMETER_FREE[name]
    if name == "general":
        return GeneralScore(d_q, d_k)
    if name in ("additive", "concat"):
        return AdditiveScore(d_q, d_k)
    raise ValueError(f"unknown attention score {name!r}; choose one of dot, scaled_dot, general, additive, concat")


# --------------------------------------------------------------------------------------
# Normalizers: logits e (..., T_q, T_k) -> weights alpha (..., T_q, T_k)
# --------------------------------------------------------------------------------------


def _at_least_float32(e: Tensor) -> Tensor:
    """Softmax runs in float32 under bf16/fp16 autocast, and stays float64 for float64 inputs."""
    return e if e.dtype == torch.float64 else e.float()


def soft_attention(e: Tensor, mask: Tensor | None = None, beta: float = 1.0, *, keep_dtype: bool = False) -> Tensor:
    """``alpha = softmax(beta * e)`` over keys, in float32 (seed 3's soft argmax with inverse temperature).

    Masked keys get weight 0; a row whose keys are all masked gets all-zero weights. With
    ``keep_dtype`` the weights come back in ``e``'s dtype (bfloat16 under autocast): torch's
    softmax still accumulates in float32 and rounds once, as casting the float32 weights would,
    without two (B, H, T_q, T_k) conversions per layer and pass (with ``beta != 1`` the logits are
    scaled in float32 first, so they too are rounded only once).
    """
    logits = e if keep_dtype and beta == 1.0 else _at_least_float32(e)
    logits = logits * beta if beta != 1.0 else logits
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1)  # masked keys: exp(min - max) underflows to exactly 0
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)
        if not bool(has_key.all()):
            weights = weights * has_key  # a row with nothing to attend to: softmax made it uniform
    return weights.to(e.dtype) if keep_dtype else weights


def hard_attention(e: Tensor, mask: Tensor | None = None, beta: float = 1.0, *,
                   straight_through: bool = False) -> Tensor:
    """``alpha = onehot(argmax(e))``: each query takes exactly one value (seed 3, ``||alpha||_0 = 1``).

    The argmax has no gradient. With ``straight_through`` the forward pass stays one-hot while
    the backward pass uses the gradient of ``softmax(beta * e)`` (straight-through estimator).
    """
    logits = _at_least_float32(e)
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    hard = F.one_hot(logits.argmax(dim=-1), num_classes=e.size(-1)).to(logits.dtype)  # (..., T_q, T_k)
    if mask is not None:
        hard = hard * mask.any(dim=-1, keepdim=True)  # nothing to attend to -> zeros
    if straight_through:
        soft = soft_attention(e, mask, beta)
        return hard + soft - soft.detach()
    return hard


# --------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------


_OVERRIDE: ContextVar[tuple[Normalizer | None, float | None]] = ContextVar("attnkit_attention_override",
                                                                         default=(None, None))


@contextmanager
def attention_override(*, normalizer: Normalizer | None = None, beta: float | None = None) -> Iterator[None]:
    """Evaluate a trained model with another normalizer or temperature, without touching its code.

    Inside the block every :func:`attend` call (every layer, head and decoder step of any model)
    uses ``normalizer`` instead of its own, and multiplies its logits by ``beta`` on top of its own
    inverse temperature: ``softmax(beta * score(q, k))`` with the model's ``score`` (for a
    Transformer ``q.k / sqrt(d_k)``). ``None`` leaves that setting alone. Meant for inference
    experiments such as soft-trained models read with hard (argmax) attention (seed 001).
    """
    if normalizer not in (None, "softmax", "hard"):
        raise ValueError(f"unknown normalizer {normalizer!r}; choose softmax or hard")
    if beta is not None and not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    token = _OVERRIDE.set((normalizer, beta))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


# On the CPU, torch's fused bfloat16 kernel is slower than matmul + softmax for short key
# sequences (benchmarks/attention.py: 2x at T=64, even at T=256); above this the fused path wins.
FUSED_BF16_CPU_MIN_KEYS = 256


def _fused_is_faster(q: Tensor, k: Tensor) -> bool:
    return not (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k.size(-2) < FUSED_BF16_CPU_MIN_KEYS)


# On the CPU, torch's bfloat16 softmax and its backward are slow for rows shorter than this
# (backward 1.4-1.7 ms vs 0.1 ms in float32 for ~20k rows of 16-24 keys): below it the weights are
# computed in float32 and cast for ``weights @ v``. Paired in training on Multi30k: +1-2% tokens/s.
BF16_SOFTMAX_CPU_MIN_KEYS = 32


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


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    score: ScoreName | Scorer = "scaled_dot",
    normalizer: Normalizer = "softmax",
    beta: float | None = None,
    dropout: float = 0.0,
    need_weights: bool = True,
    straight_through: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention: ``context = normalize(beta * score(q, k)) v`` (SEEDS.md 2-4).

    :param q: queries ``(..., T_q, d_k)`` — any number of leading (batch, head) dims.
    :param k: keys ``(..., T_k, d_k)``.
    :param v: values ``(..., T_k, d_v)``; ``d_v`` may differ from ``d_k``.
    :param mask: boolean, broadcastable to ``(..., T_q, T_k)``, ``True`` = may attend.
    :param score: ``"dot" | "scaled_dot" | "general" | "additive" | "concat"`` or a scorer module
        such as :class:`GeneralScore` / :class:`AdditiveScore` (parameterised scores need one).
    :param normalizer: ``"softmax"`` (soft attention) or ``"hard"`` (one-hot argmax).
    :param beta: inverse temperature multiplying the logits before the softmax. Default 1;
        ``score="scaled_dot"`` already divides by ``sqrt(d_k)``, which is the seeds'
        ``beta = 1/sqrt(d_k)`` applied to ``dot``.
    :param dropout: dropout probability on the weights (pass 0 at inference).
    :param need_weights: when False and the score is (scaled) dot with softmax, the fused
        ``F.scaled_dot_product_attention`` kernel is used (memory ``O(T)`` instead of ``O(T^2)``)
        and ``None`` is returned for the weights.
    :param straight_through: for ``normalizer="hard"``, pass softmax gradients through.
    :returns: ``(context (..., T_q, d_v), weights (..., T_q, T_k) or None)``.

    Inside :func:`attention_override` its normalizer replaces ``normalizer`` and its beta multiplies ``beta``.
    """
    forced_normalizer, forced_beta = _OVERRIDE.get()
    if forced_normalizer is not None:
        normalizer = forced_normalizer
    if forced_beta is not None:
        beta = forced_beta * (1.0 if beta is None else beta)
    if isinstance(score, str) and score in ("general", "additive", "concat"):
        raise ValueError(f"score {score!r} has parameters: pass a module, e.g. make_scorer({score!r}, d_q)")
    if normalizer not in ("softmax", "hard"):
        raise ValueError(f"unknown normalizer {normalizer!r}; choose softmax or hard")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be boolean (True = may attend), got {mask.dtype}")

    if not need_weights and normalizer == "softmax" and score in ("dot", "scaled_dot") and _fused_is_faster(q, k):
        scale = 1.0 / math.sqrt(q.size(-1)) if score == "scaled_dot" else 1.0
        scale *= 1.0 if beta is None else beta
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
        if mask is not None and not _fused_zeroes_empty_rows(q.device, q.dtype):
            # Older kernels return uniform weights or NaN for rows with nothing to attend to.
            context = context.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
        return context, None

    scorer = _PARAMETER_FREE[score] if isinstance(score, str) else score
    e = scorer(q, k)  # (..., T_q, T_k)
    beta = 1.0 if beta is None else beta
    if normalizer == "softmax":
        keep_dtype = not need_weights and _bf16_softmax_is_faster(e)  # weights shown are float32
        weights = soft_attention(e, mask, beta, keep_dtype=keep_dtype)
    else:
        weights = hard_attention(e, mask, beta, straight_through=straight_through)
    p = dropout_fn(weights, dropout)
    context = p.to(v.dtype) @ v  # (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)
    return context, (weights if need_weights else None)
