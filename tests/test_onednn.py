"""Tests for attnkit.engine.onednn: float32 linear layers through oneDNN, held to ``F.linear`` (the BLAS).

The products are the same; only the summation order differs, so forward and gradients are compared to float32
rounding, and where oneDNN does not apply the layer must be ``F.linear`` exactly. A training run that measured
oneDNN faster (timings fixed, as in ``tests/test_precision.py``) trains as a BLAS run does, to rounding, and
resumes bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit.cli import main
from attnkit.engine import to_reference
from attnkit.engine.onednn import OneDNNLinear, available, onednn_linear, use_onednn
from attnkit.engine.quantize import Int8Linear
from attnkit.lora import LoRALinear
from attnkit.runs.layout import PRECISION_FILE
from test_precision import fixed_timings
from test_train import assert_same_checkpoint, raw_config, weights, write_yaml

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN linear op")

#: float32 rounding of sums over at most a few hundred terms of order one, relative to the largest value
TOLERANCE = 1e-5


def close(got: torch.Tensor, reference: torch.Tensor) -> bool:
    return (got - reference).abs().max().item() <= TOLERANCE * max(reference.abs().max().item(), 1.0)


@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (2, 3, 4, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_forward_and_gradients_equal_f_linear(shape, bias, grads):
    torch.manual_seed(0)
    x, w, b = torch.randn(shape), torch.randn(16, 24), torch.randn(16) if bias else None
    x.requires_grad_(grads[0])
    w.requires_grad_(grads[1])
    wanted = [t for t in (x, w, b) if t is not None and t.requires_grad]
    y = onednn_linear(x, w, b)  # (..., 16)
    reference = F.linear(x, w, b)
    assert y.shape == reference.shape and close(y, reference)
    dy = torch.randn_like(y)
    for got, expected in zip(torch.autograd.grad(y, wanted, dy), torch.autograd.grad(reference, wanted, dy),
                             strict=True):
        assert got.shape == expected.shape and close(got, expected)


def test_strided_inputs_and_an_expanded_gradient():
    """A transposed input, and the gradient of a sum (stride 0), which autograd hands over unexpanded."""
    torch.manual_seed(0)
    x, w = torch.randn(24, 6).t().requires_grad_(), torch.randn(16, 24).requires_grad_()  # x (6, 24), not contiguous
    got = torch.autograd.grad(onednn_linear(x, w).sum(), (x, w))
    expected = torch.autograd.grad(F.linear(x, w).sum(), (x, w))
    assert all(close(g, e) for g, e in zip(got, expected, strict=True))


def test_where_onednn_does_not_apply_it_is_f_linear_exactly():
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    for args in [(x.bfloat16(), w.bfloat16(), b.bfloat16()), (x.double(), w.double(), None), (x[:0], w, b)]:
        assert torch.equal(onednn_linear(*args), F.linear(*args))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's bf16 product, as a BLAS run computes it
        got, expected = onednn_linear(x, w, b), F.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_use_onednn_changes_plain_linear_layers_only_and_to_reference_undoes_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), LoRALinear(nn.Linear(16, 16), {"q": (0, 16)}, rank=2, alpha=4),
                          nn.Linear(16, 4))
    model[2].lora_B["q"].data.normal_()  # the adapter adds something
    int8 = Int8Linear(nn.Linear(4, 4))
    model.append(int8)
    x = torch.randn(5, 8)
    before, state = model(x), {k: v.clone() for k, v in model.state_dict().items()}
    assert use_onednn(model) == 3  # the two plain layers and the LoRA layer's frozen base
    assert [type(m) for m in (model[0], model[3])] == [OneDNNLinear, OneDNNLinear]
    assert type(model[2]) is LoRALinear and type(int8) is Int8Linear
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert close(model(x), before)
    to_reference(model)
    assert not any(type(m) is OneDNNLinear for m in model.modules())
    assert torch.equal(model(x), before)


def trained(tmp_path, monkeypatch, name: str, updates: int, precision: str, resume: bool = False):
    """A tiny translation run (``tests/test_train.py``'s) trained to ``updates``; ``auto`` measures oneDNN faster."""
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    fixed_timings(monkeypatch, float32=2.0, bf16=3.0, onednn=1.0)
    raw = raw_config(precision=precision, valid_every=3)
    config = write_yaml(tmp_path / f"{name}.yaml", raw)
    assert main(["train", str(config), "--run-dir", str(tmp_path / name), f"train.max_updates={updates}",
                 *(["--resume"] if resume else [])]) == 0
    return tmp_path / name


def test_a_run_through_onednn_trains_as_the_blas_does_and_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    straight = trained(tmp_path, monkeypatch, "straight", 6, "auto")
    assert json.loads((straight / PRECISION_FILE).read_text())["onednn"] is True
    assert "precision: float32 through oneDNN (measured: " in capsys.readouterr().err
    trained(tmp_path, monkeypatch, "resumed", 3, "auto")
    trained(tmp_path, monkeypatch, "resumed", 6, "auto", resume=True)
    assert_same_checkpoint(straight, tmp_path / "resumed", 6)
    blas = trained(tmp_path, monkeypatch, "blas", 6, "float32")
    assert json.loads((blas / PRECISION_FILE).read_text())["onednn"] is False
    # Adam divides each gradient by its own size, so a weight whose gradient is rounding noise moves by up to the
    # learning rate either way: the weights are not compared to a tolerance, the losses they reach are
    onednn, blas_weights = weights(straight, 6), weights(blas, 6)
    assert any(not torch.equal(onednn[k], blas_weights[k]) for k in blas_weights)

    def valid_losses(run):
        return [json.loads(line)["valid_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert valid_losses(straight) == pytest.approx(valid_losses(blas), rel=1e-4)


def test_a_traced_layer_is_f_linear():
    """Compiled code (torch.export, torch.compile) gets the plain product, which the compiler knows."""
    layer = OneDNNLinear(8, 4)
    program = torch.export.export(layer, (torch.randn(2, 8),))
    assert not any("mkldnn" in str(node.target) for node in program.graph.nodes)
    assert torch.equal(program.module()(x := torch.randn(2, 8)), F.linear(x, layer.weight, layer.bias))
