"""Encoder-only classifier: pooling, padding invariance, the seed's model, attribution."""

from __future__ import annotations

import pytest
import torch

from attnkit import TransformerClassifier, TransformerConfig
from attnkit.classifier import pool

SEED_MODEL = TransformerConfig(d_model=32, n_heads=2, d_ff=128, encoder_layers=1)


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, 100, (3, 9), generator=g)
    x[1, 5:] = 0
    x[2, 1:] = 0
    return x


@pytest.mark.parametrize("pooling", ["max", "mean", "first"])
def test_padding_does_not_change_a_prediction(pooling: str) -> None:
    torch.manual_seed(1)
    model = TransformerClassifier(SEED_MODEL, 100, 3, pooling=pooling).eval()
    x = tokens()
    padded = torch.cat([x, torch.zeros(3, 6, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded), model(x), atol=1e-5, rtol=1e-5)


def test_pool_ignores_padding() -> None:
    h = torch.tensor([[[1.0, -5.0], [3.0, 2.0], [100.0, 100.0]]])  # third position is padding
    mask = torch.tensor([[True, True, False]])
    assert pool(h, mask, "max").tolist() == [[3.0, 2.0]]
    assert pool(h, mask, "mean").tolist() == [[2.0, -1.5]]
    assert pool(h, mask, "first").tolist() == [[1.0, -5.0]]


def test_seed_imdb_model_size() -> None:
    model = TransformerClassifier(SEED_MODEL, 50002, 2, pooling="max")
    n_params = sum(p.numel() for p in model.parameters())
    # embedding 50002*32 + attention 4*(32*32+32) + FFN (32*128+128 + 128*32+32) + 2 LayerNorms + head 32*2+2
    expected = 50002 * 32 + 4 * (32 * 32 + 32) + (32 * 128 + 128 + 128 * 32 + 32) + 2 * 64 + 66
    assert n_params == expected


@pytest.mark.parametrize("pooling", ["max", "mean", "first"])
def test_token_importance_is_a_distribution_over_real_tokens(pooling: str) -> None:
    torch.manual_seed(2)
    model = TransformerClassifier(SEED_MODEL, 100, 2, pooling=pooling).eval()
    x = tokens()
    share = model.token_importance(x)
    torch.testing.assert_close(share.sum(-1), torch.ones(3))
    assert share[1, 5:].sum() == 0 and share[2, 1:].sum() == 0


def test_tiny_classifier_overfits_a_tiny_labelled_set() -> None:
    torch.manual_seed(3)
    model = TransformerClassifier(SEED_MODEL, 20, 2, pooling="max")
    x = torch.randint(4, 20, (16, 6))
    y = (x == 7).any(dim=1).long()  # label: does token 7 occur?
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    model.eval()
    assert (model(x).argmax(-1) == y).all() and loss.item() < 0.05


def test_an_empty_text_gives_finite_logits() -> None:
    torch.manual_seed(4)
    model = TransformerClassifier(SEED_MODEL, 100, 2, pooling="max").eval()
    x = torch.tensor([[0, 0, 0], [5, 6, 0]])  # the first row has no real token
    assert torch.isfinite(model(x)).all()
