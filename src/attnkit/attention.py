"""Where attention is computed: masks, score functions, normalizers and the kernel ``attend``.

The seeds' recipe (SEEDS.md sections 2-4), for one query q against keys k_1..k_N and values
v_1..v_N::

    e_i     = score(q, k_i) [+ b_i]            # how well key i matches the query (+ a position bias, ALiBi)
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
:func:`causal_mask` (look-ahead) and :func:`sliding_window_mask` build the masks a decoder needs.

**Grouped-query attention** (Ainslie et al. 2023): keys and values may have fewer heads than the
queries, ``H_kv`` dividing ``H``; each key/value head then serves ``H / H_kv`` consecutive query heads
(:func:`repeat_kv`). ``H_kv = H`` is multi-head attention, ``H_kv = 1`` multi-query attention (Shazeer 2019).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def sliding_window_mask(T_q: int, T_k: int | None = None, window: int = 0, *,
                        device: torch.device | None = None) -> Tensor:
    """Sliding-window look-ahead mask ``(T_q, T_k)``: query ``i`` sees the ``window`` keys ending at its own position.

    Query ``i`` (at position ``p = i + T_k - T_q``) may attend to key ``j`` iff ``p - window < j <= p``
    (Child et al. 2019's local attention, Mistral's sliding window). ``window = 0`` is the plain
    :func:`causal_mask`; a window at least ``T_k`` long changes nothing.
    """
    T_k = T_q if T_k is None else T_k
    mask = causal_mask(T_q, T_k, device=device)  # j <= p
    if window > 0:
        mask = mask & ~torch.ones(T_q, T_k, dtype=torch.bool, device=device).tril(diagonal=T_k - T_q - window)
    return mask


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


def soft_attention(e: Tensor, mask: Tensor | None = None, beta: float = 1.0) -> Tensor:
    """``alpha = softmax(beta * e)`` over keys, in float32 (seed 3's soft argmax with inverse temperature).

    Masked keys get weight 0; a row whose keys are all masked gets all-zero weights.
    """
    logits = _at_least_float32(e) * beta
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1)  # masked keys: exp(min - max) underflows to exactly 0
    if mask is not None:
        weights = weights * mask.any(dim=-1, keepdim=True)  # a row with nothing to attend to: zeros, not uniform
    return weights


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


def normalize(e: Tensor, mask: Tensor | None, normalizer: Normalizer, beta: float,
              straight_through: bool = False) -> Tensor:
    """Logits ``(..., T_q, T_k)`` -> weights: :func:`soft_attention` or :func:`hard_attention`."""
    if normalizer == "softmax":
        return soft_attention(e, mask, beta)
    if normalizer == "hard":
        return hard_attention(e, mask, beta, straight_through=straight_through)
    raise ValueError(f"unknown normalizer {normalizer!r}; choose softmax or hard")


# --------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------


Dropout = Callable[[Tensor], Tensor]


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """Grouped-query attention's keys or values ``(B, H_kv, T, d)`` -> ``(B, H_kv * groups, T, d)``:
    key/value head ``j`` serves query heads ``j * groups .. (j + 1) * groups - 1``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def check_attention_args(score: ScoreName | Scorer, normalizer: str, mask: Tensor | None) -> None:
    """Reject what :func:`attend` cannot do, with a message saying what to pass instead."""
    if isinstance(score, str) and score in ("general", "additive", "concat"):
        raise ValueError(f"score {score!r} has parameters: pass a module, e.g. make_scorer({score!r}, d_q)")
    if isinstance(score, str) and score not in _PARAMETER_FREE:
        raise ValueError(f"unknown attention score {score!r}; choose one of dot, scaled_dot, general, additive, concat")
    if normalizer not in ("softmax", "hard"):
        raise ValueError(f"unknown normalizer {normalizer!r}; choose softmax or hard")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be boolean (True = may attend), got {mask.dtype}")


def attend(
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
    """Attention: ``context = normalize(beta * (score(q, k) + bias)) v`` (SEEDS.md 2-4).

    The steps, as the seeds write them: score every key, mask, normalize (softmax or hard
    argmax, inverse temperature ``beta``), drop out weights (training), take the weighted sum.

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
    :param dropout: dropout on the weights: a probability (applied as in training) or a module
        such as ``nn.Dropout`` (which knows whether it is training).
    :param need_weights: return the weights, or None (a fused kernel would never materialise them;
        here they are only dropped).
    :param straight_through: for ``normalizer="hard"``, pass softmax gradients through.
    :param bias: added to the scores, broadcastable to ``(..., T_q, T_k)`` (ALiBi's ``-m_h |t - s|``).
    :param causal: also apply the look-ahead mask: query ``i`` sees keys ``j <= i + T_k - T_q``
        (:func:`causal_mask`; the queries are the last ``T_q`` of the ``T_k`` positions).
    :returns: ``(context (..., T_q, d_v), weights (..., T_q, T_k) or None)``.

    Keys and values with fewer heads than the queries (``(B, H_kv, T_k, d)`` against ``(B, H, T_q, d)``)
    are grouped-query attention: they are repeated to ``H`` heads first (:func:`repeat_kv`).
    """
    check_attention_args(score, normalizer, mask)
    if q.dim() == 4 and k.dim() == 4 and k.size(1) != q.size(1):  # grouped-query attention
        groups = q.size(1) // k.size(1)
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, H, T_k, d)
    if causal:
        look_ahead = causal_mask(q.size(-2), k.size(-2), device=q.device)  # (T_q, T_k)
        mask = look_ahead if mask is None else mask & look_ahead
    scorer = _PARAMETER_FREE[score] if isinstance(score, str) else score
    e = scorer(q, k)  # 1. scores (..., T_q, T_k)
    if bias is not None:
        e = e + bias  # position bias (ALiBi)
    weights = normalize(e, mask, normalizer, 1.0 if beta is None else beta, straight_through)  # 2.-3. mask, normalize
    if callable(dropout):
        p = dropout(weights)  # 4. dropout on the weights
    else:
        p = F.dropout(weights, dropout) if dropout > 0.0 else weights
    context = p.to(v.dtype) @ v  # 5. (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)
    return context, (weights if need_weights else None)


@contextmanager
def attention_override(model: nn.Module, *, normalizer: Normalizer | None = None,
                       beta: float | None = None) -> Iterator[None]:
    """Evaluate a trained model with another normalizer or temperature, without touching its code.

    Inside the block every attention module of ``model`` (each multi-head layer, or an RNN's
    attention: the modules with ``normalizer`` and ``beta`` attributes) uses ``normalizer``
    instead of its own, and multiplies its logits by ``beta`` on top of its own inverse
    temperature: ``softmax(beta * score(q, k))`` with the model's ``score`` (for a Transformer
    ``q.k / sqrt(d_k)``). ``None`` leaves that setting alone. Meant for inference experiments
    such as soft-trained models read with hard (argmax) attention (seed 001).
    """
    if normalizer not in (None, "softmax", "hard"):
        raise ValueError(f"unknown normalizer {normalizer!r}; choose softmax or hard")
    if beta is not None and not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    modules = [m for m in model.modules() if hasattr(m, "normalizer") and hasattr(m, "beta")]
    saved = [(m.normalizer, m.beta) for m in modules]
    try:
        for m in modules:
            if normalizer is not None:
                m.normalizer = normalizer
            if beta is not None:
                m.beta = beta * (1.0 if m.beta is None else m.beta)
        yield
    finally:
        for m, (n, b) in zip(modules, saved, strict=True):
            m.normalizer, m.beta = n, b
