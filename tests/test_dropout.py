"""Byte-mask dropout: the rate, the expectation, gradients, determinism."""

from __future__ import annotations

import pytest
import torch

from attnkit.engine.dropout import byte_dropout as dropout
from attnkit.engine.dropout import random_bytes


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_drop_rate_and_expectation(p: float) -> None:
    torch.manual_seed(0)
    x = torch.ones(1000, 1000)
    y = dropout(x, p)
    p_eff = round(p * 256) / 256
    assert abs((y == 0).float().mean().item() - p_eff) < 0.003
    assert abs(y.mean().item() - 1.0) < 0.01  # kept values are scaled by 1 / (1 - p_eff)
    kept = y[y != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p_eff)))


def test_gradient_is_the_same_mask() -> None:
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    y = dropout(x, 0.25)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y.detach() / x.detach()))


def test_identity_in_eval_and_deterministic_with_seed() -> None:
    x = torch.randn(10, 10)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    torch.manual_seed(2)
    a = dropout(x, 0.1)
    torch.manual_seed(2)
    torch.testing.assert_close(dropout(x, 0.1), a, rtol=0, atol=0)
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_random_bytes_are_uniform() -> None:
    torch.manual_seed(3)
    b = random_bytes((256 * 4000,), torch.device("cpu"))
    counts = torch.bincount(b.long(), minlength=256).float()
    assert counts.min() > 3500 and counts.max() < 4500


@pytest.mark.parametrize("p", [1 / 256, 0.1, 0.5, 255 / 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_is_exactly_bytes_at_or_above_the_threshold(p: float, dtype: torch.dtype) -> None:
    """The uint8 clamp/subtract mask keeps exactly the bytes b >= round(256 p), as a comparison would."""
    x = torch.randn(300, 7).to(dtype)
    torch.manual_seed(4)
    y = dropout(x, p)
    torch.manual_seed(4)
    b = random_bytes(x.shape, x.device)
    drop_below = round(p * 256)
    expected = x * (b >= drop_below).to(dtype) * torch.tensor(256 / (256 - drop_below), dtype=dtype)
    assert torch.equal(y, expected)
    assert 0 < int((y == 0).sum()) < x.numel()


def test_rate_below_half_a_byte_is_no_dropout() -> None:
    x = torch.randn(10, 10)
    assert dropout(x, 1 / 1024) is x
