"""The fused output-layer cross-entropy equals F.linear + F.cross_entropy, loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.engine.loss import linear_cross_entropy


def inputs(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(50, 16, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(50, generator=g)).requires_grad_() if bias else None
    targets = torch.randint(0, 50, (37,), generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 8, 1024])
def test_equals_linear_then_cross_entropy(bias: bool, eps: float, chunk: int) -> None:
    hidden, weight, b, targets = inputs(bias)
    ours = linear_cross_entropy(hidden, weight, b, targets, label_smoothing=eps, chunk=chunk)
    ours.mul(0.7).backward()  # a scaled upstream gradient
    got = [t.grad.clone() for t in (hidden, weight, b) if t is not None]
    for t in (hidden, weight, b):
        if t is not None:
            t.grad = None
    ref = F.cross_entropy(F.linear(hidden, weight, b), targets, label_smoothing=eps, reduction="sum")
    ref.mul(0.7).backward()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    for g, t in zip(got, [t for t in (hidden, weight, b) if t is not None], strict=True):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("frozen", [("weight",), ("weight", "bias"), ("hidden",)])
def test_only_the_wanted_gradients_are_formed(frozen: tuple[str, ...]) -> None:
    """A frozen output layer (a LoRA run's) gets no gradient, and the others are still exact."""
    hidden, weight, b, targets = inputs(True, seed=3)
    named = {"hidden": hidden, "weight": weight, "bias": b}
    for name in frozen:
        named[name].requires_grad_(False)
    linear_cross_entropy(hidden, weight, b, targets, label_smoothing=0.1, chunk=8).backward()
    got = {n: t.grad for n, t in named.items()}
    for t in named.values():
        t.grad = None
    F.cross_entropy(F.linear(hidden, weight, b), targets, label_smoothing=0.1, reduction="sum").backward()
    for name, t in named.items():
        if name in frozen:
            assert got[name] is None
        else:
            torch.testing.assert_close(got[name], t.grad, atol=1e-5, rtol=1e-4)


def test_tied_weight_gradients_add_up() -> None:
    hidden, weight, _, targets = inputs(False, seed=1)
    tokens = torch.randint(0, 50, (5,))
    (linear_cross_entropy(hidden, weight, None, targets) + weight[tokens].sum()).backward()
    got = weight.grad.clone()
    weight.grad, hidden.grad = None, None
    (F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum") + weight[tokens].sum()).backward()
    torch.testing.assert_close(got, weight.grad, atol=1e-5, rtol=1e-4)


def test_bf16_autocast_is_close_and_grads_keep_their_dtype() -> None:
    hidden, weight, b, targets = inputs(True, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, b, targets, label_smoothing=0.1, chunk=16)
    ref = F.cross_entropy(F.linear(hidden, weight, b), targets, label_smoothing=0.1, reduction="sum")
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=0.0)
    ours.backward()
    got = [t.grad.clone() for t in (hidden, weight, b)]
    for t in (hidden, weight, b):
        t.grad = None
    ref.backward()
    for g, t in zip(got, (hidden, weight, b), strict=True):
        assert g.dtype == torch.float32  # the parameters' dtype, though the matmuls ran in bf16
        torch.testing.assert_close(g, t.grad, rtol=0.0, atol=3e-2 * t.grad.abs().max().item())


def test_inference_mode_gives_the_same_loss_without_a_graph() -> None:
    hidden, weight, b, targets = inputs(True)
    with torch.inference_mode():
        loss = linear_cross_entropy(hidden, weight, b, targets)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight, b), targets, reduction="sum").detach())


def assert_same_loss_and_gradients(model: torch.nn.Module, fast: torch.nn.Module, reference: torch.nn.Module,
                                   *inputs: object) -> None:
    """``fast(*inputs)`` equals ``reference(*inputs)`` in value and in every parameter's gradient."""
    results = []
    for objective in (fast, reference):
        model.zero_grad()
        loss = objective(*inputs)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (fast_loss, fast_grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(fast_loss, ref_loss, atol=1e-4, rtol=1e-5)
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
def test_fused_objective_equals_the_reference_objective(arch: str) -> None:
    """The engine's FusedSeq2SeqLoss equals the task's F.cross_entropy objective, value and gradients."""
    from attnkit import RNNConfig, RNNSeq2Seq, Transformer, preset
    from attnkit.engine.loss import FusedSeq2SeqLoss
    from attnkit.tasks.objectives import Seq2SeqLoss

    torch.manual_seed(0)
    if arch == "transformer":
        model = Transformer(preset("tiny", d_model=16, n_heads=2, d_ff=32, dropout=0.0), 30, 30)
    else:
        model = RNNSeq2Seq(RNNConfig(embed_dim=8, hidden_size=16, attention="additive", dropout=0.0), 30, 30)
    src = torch.randint(4, 30, (3, 6))
    tgt_in = torch.randint(4, 30, (3, 5))
    positions = torch.ones(3, 5, dtype=torch.bool)
    positions[1, 3:] = False
    targets = torch.randint(4, 30, (int(positions.sum()),))
    assert_same_loss_and_gradients(model, FusedSeq2SeqLoss(model), Seq2SeqLoss(model),
                                   src, tgt_in, positions, targets, 0.1)


def test_select_positions_equals_boolean_indexing_forward_and_backward() -> None:
    from attnkit.engine.loss import select_positions

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 7, 3, generator=g, requires_grad=True)
    positions = torch.rand(4, 7, generator=g) > 0.3
    positions[2] = False  # a row with nothing selected
    upstream = torch.randn(int(positions.sum()), 3, generator=g)
    ours = select_positions(x, positions)
    ours.backward(upstream)
    got = x.grad.clone()
    x.grad = None
    ref = x[positions]
    ref.backward(upstream)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    torch.testing.assert_close(got, x.grad, rtol=0, atol=0)
    assert got[2].abs().sum() == 0


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_exact_where_the_target_probability_underflows(eps: float) -> None:
    """Logit gaps of hundreds: p_y is 0 in float32, yet the loss is the exact log-sum-exp one."""
    hidden, weight, b, targets = inputs(True, seed=3)
    with torch.no_grad():
        weight *= 200.0  # logits spread over ~+-1000: most targets' softmax probability underflows
    ours = linear_cross_entropy(hidden, weight, b, targets, label_smoothing=eps, chunk=8)
    ref = F.cross_entropy(F.linear(hidden, weight, b), targets, label_smoothing=eps, reduction="sum")
    assert torch.softmax(F.linear(hidden, weight, b), -1).gather(1, targets[:, None]).min() == 0
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0.0)
