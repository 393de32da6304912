"""The attention kernel: the seeds' worked example, references, gradients, masks, hard attention."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import AdditiveScore, GeneralScore, attend, causal_mask, dot_score, padding_mask


def test_seed_worked_example_to_four_decimals() -> None:
    """SEEDS.md section 4: x, W_query, W_key, W_value -> scores, weights, output."""
    x = torch.tensor([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=torch.float32)
    W_query = torch.tensor([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=torch.float32)
    W_key = torch.tensor([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=torch.float32)
    W_value = torch.tensor([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=torch.float32)
    q, k, v = x @ W_query, x @ W_key, x @ W_value

    expected_scores = torch.tensor([[2.0, 4, 4], [4, 16, 12], [4, 12, 10]])
    expected_weights = torch.tensor([[1.3613e-01, 4.3194e-01, 4.3194e-01],
                                     [8.9045e-04, 9.0884e-01, 9.0267e-02],
                                     [7.4449e-03, 7.5471e-01, 2.3785e-01]])
    expected_output = torch.tensor([[1.8639, 6.3194, 1.7042], [1.9991, 7.8141, 0.2735], [1.9926, 7.4796, 0.7359]])

    torch.testing.assert_close(dot_score(q, k), expected_scores, atol=0, rtol=0)
    out, weights = attend(q, k, v)  # scaled_dot: softmax(QK^T / sqrt(3)) V
    torch.testing.assert_close(weights, expected_weights, atol=5e-5, rtol=0)
    torch.testing.assert_close(out, expected_output, atol=5e-5, rtol=0)
    # the same thing as the seeds write it: dot score with inverse temperature beta = 1/sqrt(d_k)
    out_beta, weights_beta = attend(q, k, v, score="dot", beta=1 / math.sqrt(3))
    torch.testing.assert_close(weights_beta, weights)
    torch.testing.assert_close(out_beta, out)


def reference_attention(q, k, v, mask=None, scale=None):
    """The textbook formula, written independently: softmax(q k^T * scale + log(mask)) v."""
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    s = torch.einsum("...qd,...kd->...qk", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -1e9)
    w = s.softmax(-1)
    return torch.einsum("...qk,...kd->...qd", w, v), w


def test_leading_dims_and_dk_differs_from_dv() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k = torch.randn(2, 3, 7, 8, generator=g)
    v = torch.randn(2, 3, 7, 11, generator=g)
    out, w = attend(q, k, v)
    ref_out, ref_w = reference_attention(q, k, v)
    assert out.shape == (2, 3, 5, 11) and w.shape == (2, 3, 5, 7)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w)


def test_fully_masked_row_gives_zeros_not_nan() -> None:
    q, k, v = torch.randn(1, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 2)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    mask[0, 1] = False
    for normalizer in ("softmax", "hard"):
        out, w = attend(q, k, v, mask, normalizer=normalizer)
        assert torch.isfinite(out).all() and torch.isfinite(w).all()
        assert torch.equal(out[0, 1], torch.zeros(2)) and torch.equal(w[0, 1], torch.zeros(5))
        torch.testing.assert_close(w[0, [0, 2]].sum(-1), torch.ones(2))


def test_masked_keys_get_zero_weight_and_do_not_matter() -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 3, generator=g)
    lengths = torch.tensor([6, 4])
    mask = padding_mask(lengths=lengths)  # (B, 1, 6)
    out, w = attend(q, k, v, mask)
    assert torch.equal(w[1, :, 4:], torch.zeros(4, 2))
    k2, v2 = k.clone(), v.clone()
    k2[1, 4:] = 100.0
    v2[1, 4:] = -100.0
    out2, _ = attend(q, k2, v2, mask)
    torch.testing.assert_close(out2, out)


def test_padding_mask_from_ids_and_lengths_agree() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0]])
    torch.testing.assert_close(padding_mask(ids, pad_id=0), padding_mask(lengths=torch.tensor([3, 1]), max_len=4))
    assert padding_mask(ids).shape == (2, 1, 4)


def test_causal_mask_blocks_the_future() -> None:
    m = causal_mask(4)
    assert torch.equal(m, torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(2, 4), m[2:])  # the last two queries of a 4-long sequence
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 8, generator=g)
    out, _ = attend(x, x, x, causal_mask(5))
    y = x.clone()
    y[0, 3:] = torch.randn(2, 8, generator=g)  # change the future
    out2, _ = attend(y, y, y, causal_mask(5))
    torch.testing.assert_close(out2[0, :3], out[0, :3])


def test_general_and_additive_scores_match_their_formulas() -> None:
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 3, 6), torch.randn(2, 5, 4), torch.randn(2, 5, 7)
    general = GeneralScore(6, 4)
    W = general.W.weight  # (6, 4): q^T W k
    e = torch.einsum("bqi,ij,bkj->bqk", q, W, k)
    out, w = attend(q, k, v, score=general)
    torch.testing.assert_close(w, e.softmax(-1))
    torch.testing.assert_close(out, e.softmax(-1) @ v)

    additive = AdditiveScore(6, 4, d_attn=10)
    Wq, Wk, bk, v_vec = additive.W_q.weight, additive.W_k.weight, additive.W_k.bias, additive.v.weight[0]
    e = torch.tensor([[[(v_vec @ torch.tanh(Wq @ q[b, i] + Wk @ k[b, j] + bk)).item() for j in range(5)]
                       for i in range(3)] for b in range(2)])
    _, w = attend(q, k, v, score=additive)
    torch.testing.assert_close(w, e.softmax(-1))


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "general", "additive"])
def test_gradcheck_every_score(score: str) -> None:
    torch.manual_seed(5)
    q = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[1, :, 3:] = False
    scorer = {"general": GeneralScore(4).double(), "additive": AdditiveScore(4, d_attn=6).double()}.get(score, score)

    def fn(q, k, v):
        return attend(q, k, v, mask, score=scorer, beta=0.8)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v))
    if isinstance(scorer, torch.nn.Module):  # gradients reach the scorer's parameters too
        fn(q, k, v).sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in scorer.parameters())


def test_hard_attention_is_one_hot_argmax() -> None:
    torch.manual_seed(6)
    q, k, v = torch.randn(3, 4, 5), torch.randn(3, 6, 5), torch.randn(3, 6, 2)
    out, w = attend(q, k, v, normalizer="hard")
    best = (q @ k.transpose(-1, -2)).argmax(-1)  # (3, 4)
    assert torch.equal(w, torch.nn.functional.one_hot(best, 6).float())
    torch.testing.assert_close(out, torch.gather(v, 1, best[..., None].expand(-1, -1, 2)))
    assert ((w == 0) | (w == 1)).all() and torch.equal(w.sum(-1), torch.ones(3, 4))


def test_hard_attention_respects_mask_and_straight_through_has_gradients() -> None:
    torch.manual_seed(7)
    q, k = torch.randn(1, 2, 4), torch.randn(1, 5, 4)
    v = torch.randn(1, 5, 3, requires_grad=True)
    mask = torch.tensor([[[True, True, False, False, False]]])
    _, w = attend(q, k * 0 + torch.tensor([0, 0, 0, 0, 9.0])[None, :, None], v, mask, normalizer="hard")
    assert w[..., 2:].sum() == 0  # the huge masked key is never chosen
    qg = q.clone().requires_grad_(True)
    out, w = attend(qg, k, v, normalizer="hard", straight_through=True)
    assert ((w.detach() == 0) | (w.detach() == 1)).all()
    out.sum().backward()
    assert qg.grad is not None and qg.grad.abs().sum() > 0
    qh = q.clone().requires_grad_(True)
    attend(qh, k, v, normalizer="hard")[0].sum().backward()
    assert qh.grad is None or qh.grad.abs().sum() == 0  # plain argmax passes no gradient to the query


def test_large_beta_softmax_approaches_hard() -> None:
    torch.manual_seed(8)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 3)
    hard_out, hard_w = attend(q, k, v, score="dot", normalizer="hard")
    gaps = []
    for beta in (1.0, 10.0, 1000.0):
        out, w = attend(q, k, v, score="dot", beta=beta)
        gaps.append((w - hard_w).abs().max().item())
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-4


def test_unknown_names_and_bad_masks_are_rejected() -> None:
    q = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="has parameters"):
        attend(q, q, q, score="general")
    with pytest.raises(ValueError, match="normalizer"):
        attend(q, q, q, normalizer="sparsemax")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="boolean"):
        attend(q, q, q, torch.ones(1, 2, 2))


def test_attention_override_switches_normalizer_and_beta_inside_the_block_only() -> None:
    from attnkit import MultiHeadAttention
    from attnkit.attention import attention_override

    torch.manual_seed(9)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([True, True, True, False, True])[None, None, None]  # (1, 1, 1, 5)

    def reference(normalizer: str, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = mha.in_proj(x).split(8, dim=-1)
        q, k, v = (t.view(2, 5, 2, 4).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d_k)
        out, w = attend(q, k, v, mask, normalizer=normalizer, beta=beta)
        return mha.out_proj(out.transpose(1, 2).reshape(2, 5, 8)), w

    soft_out, soft_w, _ = mha(x, mask=mask, need_weights=True)
    with attention_override(mha, normalizer="hard"):
        hard_out, hard_w, _ = mha(x, mask=mask, need_weights=True)
    torch.testing.assert_close(hard_w, reference("hard", 1.0)[1])
    torch.testing.assert_close(hard_out, reference("hard", 1.0)[0])
    assert set(hard_w.unique().tolist()) == {0.0, 1.0}
    with attention_override(mha, beta=4.0):
        out4, w4, _ = mha(x, mask=mask, need_weights=True)
    torch.testing.assert_close(w4, reference("softmax", 4.0)[1])
    torch.testing.assert_close(out4, reference("softmax", 4.0)[0])
    out, w, _ = mha(x, mask=mask, need_weights=True)  # left the block: the model's own attention again
    torch.testing.assert_close(w, soft_w)
    torch.testing.assert_close(out, soft_out)
    assert (mha.normalizer, mha.beta) == ("softmax", None)
    with pytest.raises(ValueError, match="normalizer"), attention_override(mha, normalizer="sparsemax"):  # type: ignore
        pass
    with pytest.raises(ValueError, match="positive"), attention_override(mha, beta=0.0):
        pass
