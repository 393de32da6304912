"""Tests for attnkit.inference.head_scores: each score against its formula on hand-made weights, a real
attention layer set by hand to read the previous token, and a small model trained on repeated random
sequences that grows an induction head (Olsson et al. 2022)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.inference.head_scores import (
    HeadScores,
    head_scores,
    induction_score,
    induction_scores,
    local_window_score,
    previous_token_score,
    repeated_random_tokens,
    sink_score,
)
from attnkit.lm import LanguageModel
from attnkit.transformer import TransformerConfig

T = 12


def one_hot_rows(keys: list[int]) -> torch.Tensor:
    """``(T, T)`` weights: row ``t`` puts all of its weight on key ``keys[t]``."""
    return F.one_hot(torch.tensor(keys), len(keys)).float()


def causal_uniform(T: int) -> torch.Tensor:
    """``(T, T)``: row ``t`` spreads its weight evenly over ``0..t``, ``1 / (t + 1)`` each."""
    return torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]


def test_a_previous_token_head_scores_1() -> None:
    a = one_hot_rows([0] + list(range(T - 1)))  # row 0 can only attend to itself
    assert previous_token_score(a) == 1
    assert sink_score(a) == pytest.approx(1 / (T - 1))  # only row 1's previous token is the first
    assert local_window_score(a, 2) == 1 and local_window_score(a, 1) == 0  # t-1 is inside a window of 2, not 1


def test_a_sink_head_scores_1() -> None:
    a = one_hot_rows([0] * T)
    assert sink_score(a) == 1
    assert previous_token_score(a) == pytest.approx(1 / (T - 1))  # row 1's previous token is the first
    assert local_window_score(a, 4) == 0  # rows t >= 4 look 4 back at most, never at 0


@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_causal_uniform_head_scores_what_the_formulas_say(window: int) -> None:
    a = causal_uniform(T).double()
    assert previous_token_score(a).item() == pytest.approx(sum(1 / (t + 1) for t in range(1, T)) / (T - 1))
    assert sink_score(a).item() == pytest.approx(sum(1 / (t + 1) for t in range(1, T)) / (T - 1))
    assert local_window_score(a, window).item() == pytest.approx(
        sum(window / (t + 1) for t in range(window, T)) / (T - window))


def test_an_induction_head_by_hand() -> None:
    n = 5
    induction = one_hot_rows(list(range(n)) + [t - n + 1 for t in range(n, 2 * n)])  # first copy: itself
    previous = one_hot_rows([0] + list(range(2 * n - 1)))
    assert induction_score(induction) == 1 and induction_score(previous) == 0
    assert induction_score(causal_uniform(2 * n)).item() == pytest.approx(sum(1 / (t + 1) for t in range(n, 2 * n))
                                                                         / n)


def test_scores_keep_the_leading_dims_and_say_when_undefined() -> None:
    a = causal_uniform(T).expand(3, 2, T, T)  # (L, H, T, T)
    for score in (previous_token_score(a), sink_score(a), local_window_score(a), induction_score(a)):
        assert score.shape == (3, 2)
    one = torch.ones(1, 1, 1)  # (H, T, T) with T = 1: no row but row 0
    assert previous_token_score(one).isnan().all() and sink_score(one).isnan().all()
    assert local_window_score(causal_uniform(8), 8).isnan()  # every row's window is everything
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        previous_token_score(torch.ones(2, 3))
    with pytest.raises(ValueError, match="repeated twice"):
        induction_score(causal_uniform(7))
    with pytest.raises(ValueError, match="at least 1"):
        local_window_score(causal_uniform(4), 0)


def test_repeated_random_tokens() -> None:
    x = repeated_random_tokens(3, 10, 4, 30, torch.Generator().manual_seed(0))
    assert x.shape == (3, 20) and torch.equal(x[:, :10], x[:, 10:])
    assert x.min() >= 4 and x.max() < 30
    assert all(len(set(row[:10].tolist())) == 10 for row in x)  # no token twice within a copy
    assert torch.equal(x, repeated_random_tokens(3, 10, 4, 30, torch.Generator().manual_seed(0)))
    small = repeated_random_tokens(2, 10, 4, 8, torch.Generator().manual_seed(0))  # only 4 ids: drawn with repeats
    assert small.shape == (2, 20) and small.min() >= 4 and small.max() < 8


def tiny_lm(positions: str = "rope", layers: int = 1, heads: int = 2, d_model: int = 32, vocab: int = 20
            ) -> LanguageModel:
    cfg = TransformerConfig(d_model=d_model, n_heads=heads, d_ff=2 * d_model, decoder_layers=layers, dropout=0.0,
                            max_len=64, positions=positions, scale_embeddings=False)
    return LanguageModel(cfg, vocab).eval()


def test_a_rope_layer_set_by_hand_is_a_previous_token_head() -> None:
    """Queries and keys made constant (zero projection, hand-set bias): RoPE then makes ``q_t . k_s`` a function of
    ``t - s`` alone (Su et al. 2021), here ``a^2 / sqrt(d_k) sum_i cos((t - s - 1) theta_i)``, largest at
    ``s = t - 1`` by a margin the softmax turns into a weight of exactly 1. Head 1, left with no query or key
    at all, weighs every earlier position alike: the causal-uniform head."""
    torch.manual_seed(0)
    model = tiny_lm()
    attn = model.layers[0].self_attn
    H, dk = attn.n_heads, attn.d_k
    theta = attn.rotary.inv_freq.float()  # (d_k / 2,) theta_i; pair i is dims (i, i + d_k/2)
    a = 40.0  # the margin a^2 / sqrt(d_k) * sum_i (1 - cos theta_i) is about 200 nats
    with torch.no_grad():
        attn.in_proj.weight[: 2 * H * dk].zero_()  # W^Q, W^K: queries and keys are their biases alone
        attn.in_proj.bias[: 2 * H * dk].zero_()
        attn.in_proj.bias[:dk] = a * torch.cat([theta.cos(), -theta.sin()])  # head 0's q: k rotated by -theta_i
        attn.in_proj.bias[H * dk: H * dk + dk] = a * torch.cat([torch.ones_like(theta), torch.zeros_like(theta)])
    tokens = torch.randint(4, 20, (3, 24), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.inference_mode():
        (weights,) = model.attention_weights(tokens)  # (B, H, T, T)
    assert torch.equal(previous_token_score(weights[:, 0]), torch.ones(3))  # exactly 1, every sequence
    uniform = torch.tensor(sum(1 / (t + 1) for t in range(1, 24)) / 23)
    torch.testing.assert_close(previous_token_score(weights[:, 1]), uniform.expand(3), atol=1e-6, rtol=0)


def test_head_scores_of_a_model() -> None:
    torch.manual_seed(0)
    model = tiny_lm(positions="learned", layers=2, heads=4)
    tokens = torch.randint(4, 20, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        weights = [w[0] for w in model.attention_weights(tokens)]  # per layer (H, T, T)
    scores = head_scores(model, weights, 20, low=4, window=4, n=8, batch=2, seed=3)
    assert isinstance(scores, HeadScores) and scores.text_length == 16 and scores.window == 4
    for value in scores.named().values():
        assert value.shape == (2, 4) and ((value >= 0) & (value <= 1)).all()
    torch.testing.assert_close(scores.previous_token, previous_token_score(torch.stack(weights)))
    torch.testing.assert_close(scores.induction, induction_scores(model, 20, low=4, n=8, batch=2, seed=3))
    assert list(scores.named()) == ["previous token", "sink (first token)", "local (last 4)", "induction"]
    lines = scores.table().splitlines()
    assert lines[0].split() == ["layer", "head", "previous", "sink", "local-4", "induction"] and len(lines) == 9
    assert [float(v) for v in lines[-1].split()[2:]] == pytest.approx(
        [float(v[1, 3]) for v in scores.named().values()], abs=5e-4)
    assert model.training is False


def train_on_repeats(model: LanguageModel, vocab: int, steps: int, seed: int) -> float:
    """Adam on ``[r_1..r_n, r_1..r_n]`` with ``n`` drawn from 16..24 every step, the loss on the second copy only
    (the first is unpredictable). ``n`` varies so that no head can find the earlier copy by its offset alone;
    only the content can say where it is. Returns the last loss."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        n = int(torch.randint(16, 25, (1,), generator=generator))
        x = repeated_random_tokens(32, n, 4, vocab, generator)  # (B, 2n)
        logits = model(x[:, :-1])  # (B, 2n - 1, V): row t predicts x[t + 1]
        loss = F.cross_entropy(logits[:, n - 1:].reshape(-1, vocab), x[:, n:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def test_a_two_layer_model_trained_on_repeats_grows_an_induction_head() -> None:
    """Olsson et al. (2022): an induction head needs two layers, a previous-token head that writes each token's
    predecessor into its position, and a head in a later layer whose key reads it. GPT-2's N(0, 0.02)
    initialisation starts the queries and keys so near zero that the plateau before this phase change lasts
    thousands of steps; started at N(0, 0.1), they get there in about 300."""
    vocab = 32
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tiny_lm(layers=2, heads=4, d_model=64, vocab=vocab)
        for layer in model.layers:
            torch.nn.init.normal_(layer.self_attn.in_proj.weight, 0.0, 0.1)
    before = induction_scores(model, vocab, low=4, n=20, batch=8, seed=123)  # (L, H)
    loss = train_on_repeats(model, vocab, steps=500, seed=1)
    after = induction_scores(model, vocab, low=4, n=20, batch=8, seed=123)
    best = int(after.argmax())
    assert loss < 0.5, loss  # the second copy is predicted: ln(28) = 3.3 nats would be guessing
    assert after.max() > 0.3 and after.max() > 5 * before.max(), (before, after)
    assert best // after.size(1) == 1, after  # the induction head is in the second layer
    x = repeated_random_tokens(8, 20, 4, vocab, torch.Generator().manual_seed(123))
    with torch.inference_mode():
        first_layer = model.attention_weights(x)[0]  # (B, H, 2n, 2n)
    # and its partner, a previous-token head in the first layer (a head weighing all earlier tokens alike: 0.07)
    assert previous_token_score(first_layer).mean(0).max() > 0.3
