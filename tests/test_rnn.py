"""RNN seq2seq: the seeds' equations at every step, padding invariance, the bottleneck without attention."""

from __future__ import annotations

import dataclasses

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


def top(hidden: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The top layer's hidden state s ``(B, H)`` of a GRU ``(L, B, H)`` or LSTM ``(h, c)`` state."""
    return (hidden[0] if isinstance(hidden, tuple) else hidden)[-1]


@pytest.mark.parametrize("attention", ["dot", "additive"])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_teacher_forcing_follows_the_seed_equations_at_every_step(attention: str, cell: str) -> None:
    """Every step of ``forward``, written out from the equations (not from the model's step code):

    Luong (dot), input feeding: s_t = RNN([y_{t-1}; s~_{t-1}], s_{t-1}), e_ti = s_t . h_i.
    Bahdanau (additive): e_ti = v^T tanh(W s_{t-1} + U h_i) first, then s_t = RNN([y_{t-1}; c_t], s_{t-1}).
    Both: alpha^t = softmax(e_t) over real source tokens, c_t = sum_i alpha_ti h_i,
    s~_t = tanh(W_c [c_t; s_t] + b_c), logits = W_y s~_t + b_y.
    """
    m = model(attention, cell, bidirectional=False, layers=1)
    src, tgt = batch()
    start = m.init_decoder(src)  # the encoder side; its padding invariance is tested below
    h, real = start.values, src.ne(0)  # (B, S, H), (B, S)
    hidden, s_tilde = start.hidden, torch.zeros_like(start.final)
    logits, alphas = [], []
    for t in range(tgt.size(1)):
        y = m.tgt_embed(tgt[:, t])  # (B, E)
        if attention == "additive":
            scorer = m.scorer
            e = scorer.v(torch.tanh(scorer.W_q(top(hidden))[:, None] + scorer.W_k(h))).squeeze(-1)  # (B, S)
            alpha = e.masked_fill(~real, float("-inf")).softmax(-1)
            c = torch.einsum("bs,bsh->bh", alpha, h)
            out, hidden = m.decoder(torch.cat([y, c], -1)[:, None], hidden)
            s_t = out[:, 0]
        else:
            out, hidden = m.decoder(torch.cat([y, s_tilde], -1)[:, None], hidden)
            s_t = out[:, 0]
            alpha = torch.einsum("bh,bsh->bs", s_t, h).masked_fill(~real, float("-inf")).softmax(-1)
            c = torch.einsum("bs,bsh->bh", alpha, h)
        s_tilde = torch.tanh(m.W_c(torch.cat([c, s_t], -1)))
        logits.append(m.W_y(s_tilde))
        alphas.append(alpha)
    torch.testing.assert_close(m(src, tgt), torch.stack(logits, 1), atol=1e-5, rtol=1e-5)
    alignment = m.alignment(src, tgt)  # (B, T, S)
    torch.testing.assert_close(alignment, torch.stack(alphas, 1), atol=1e-5, rtol=1e-5)
    assert alignment[2, :, 2:].abs().sum() == 0  # source padding gets no attention


@pytest.mark.parametrize("attention", ["none", "dot"])
def test_without_attention_the_decoder_sees_the_source_only_through_its_summary(attention: str) -> None:
    """The bottleneck: with attention "none", replacing every encoder state but the summary changes nothing."""
    m = model(attention)
    src, tgt = batch()
    state = m.init_decoder(src)
    g = torch.Generator().manual_seed(2)
    other = dataclasses.replace(state, values=torch.randn(state.values.shape, generator=g),
                                keys=torch.randn(state.keys.shape, generator=g))
    same = True
    for t in range(tgt.size(1)):
        logits, state, _ = m.decode_step(tgt[:, t], state)
        other_logits, other, _ = m.decode_step(tgt[:, t], other)
        same = same and torch.equal(logits, other_logits)
    assert same == (attention == "none")  # with attention the decoder does read the encoder states


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
