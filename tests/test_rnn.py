"""RNN seq2seq: the seeds' equations, padding invariance, step decoding == teacher forcing."""

from __future__ import annotations

import pytest
import torch

from attnkit import RNNConfig, RNNSeq2Seq

ATTENTIONS = ["none", "dot", "general", "concat", "additive"]


def model(attention: str, cell: str = "gru", bidirectional: bool = True, layers: int = 2) -> RNNSeq2Seq:
    torch.manual_seed(0)
    cfg = RNNConfig(cell=cell, embed_dim=12, hidden_size=16, layers=layers, bidirectional=bidirectional,
                    attention=attention, dropout=0.2)
    return RNNSeq2Seq(cfg, 30, 25).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 30, (3, 8), generator=g)
    src[1, 5:] = 0
    src[2, 2:] = 0
    tgt = torch.randint(4, 25, (3, 6), generator=g)
    tgt[:, 0] = 2
    return src, tgt


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_step_decoding_equals_teacher_forcing(attention: str, cell: str) -> None:
    m = model(attention, cell)
    src, tgt = batch()
    full = m(src, tgt)
    state = m.init_decoder(src)
    for t in range(tgt.size(1)):
        logits, state, weights = m.decode_step(tgt[:, t], state, need_weights=True)
        torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)
        if attention == "none":
            assert weights is None
        else:
            torch.testing.assert_close(weights.sum(-1), torch.ones(3))
            assert weights[2, 2:].abs().sum() == 0  # source padding gets no attention


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_source_padding_changes_nothing(attention: str) -> None:
    m = model(attention, "lstm")
    src, tgt = batch()
    padded = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(m(padded, tgt), m(src, tgt), atol=1e-5, rtol=1e-5)


def test_future_target_tokens_do_not_leak() -> None:
    m = model("dot")
    src, tgt = batch()
    changed = tgt.clone()
    changed[:, 4:] = 5
    torch.testing.assert_close(m(src, changed)[:, :4], m(src, tgt)[:, :4])


def test_luong_dot_step_follows_the_seed_equations() -> None:
    """e = [s_t^T h_i], alpha = softmax(e), a_t = sum alpha_i h_i, s~_t = tanh(W_c [a_t; s_t] + b_c)."""
    m = model("dot", bidirectional=False, layers=1)
    src, tgt = batch()
    state = m.init_decoder(src)
    y = m.tgt_embed(tgt[:, 0])
    out, _ = m.decoder(torch.cat([y, state.feed], -1)[:, None], state.hidden)
    s_t = out[:, 0]  # (B, H)
    h = state.values  # (B, S, H)
    e = torch.einsum("bh,bsh->bs", s_t, h).masked_fill(src.eq(0), float("-inf"))
    alpha = e.softmax(-1)
    a_t = torch.einsum("bs,bsh->bh", alpha, h)
    s_tilde = torch.tanh(m.W_c(torch.cat([a_t, s_t], -1)))
    logits, new_state, weights = m.decode_step(tgt[:, 0], state, need_weights=True)
    torch.testing.assert_close(weights, alpha)
    torch.testing.assert_close(new_state.feed, s_tilde)
    torch.testing.assert_close(logits, m.W_y(s_tilde))


def test_without_attention_the_context_is_the_fixed_encoder_summary() -> None:
    m = model("none")
    src, tgt = batch()
    state = m.init_decoder(src)
    changed = src.clone()
    changed[0, 3] = 7  # a different source changes the one summary vector
    assert not torch.allclose(m.init_decoder(changed).final[0], state.final[0])
    for t in range(3):
        _, state, _ = m.decode_step(tgt[:, t], state)
    assert torch.equal(state.final, m.init_decoder(src).final)


def test_state_select_for_beam_search() -> None:
    m = model("additive", "lstm")
    src, tgt = batch()
    index = torch.tensor([1, 1, 0, 2])
    state = m.init_decoder(src).select(index)
    logits, _, _ = m.decode_step(tgt[index, 0], state)
    torch.testing.assert_close(logits, m(src[index], tgt[index, :1])[:, 0], atol=1e-6, rtol=1e-6)


def test_gradients_reach_every_parameter() -> None:
    m = model("general", "lstm").train()
    src, tgt = batch()
    m(src, tgt).sum().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
