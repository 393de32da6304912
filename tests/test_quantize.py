"""Weight-only int8 (:mod:`attnkit.engine.quantize`): the rounding bound, the layer against its dequantized float
layer, an int8 model run eagerly against its dequantized float model (at depth), and the compiled int8 decoder
against the same int8 model run eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit.engine import to_eager
from attnkit.engine.compiled_decoding import CompiledDecoder
from attnkit.engine.quantize import Int8Linear, quantize_int8, quantize_rows
from attnkit.sampling import generate
from test_compiled_decoding import deep_lm, greedy, make_lm, prompts
from test_continuous_lm import CONFIGS
from test_lm_model import one_thread  # noqa: F401  (autouse: one intra-op thread for this module's tiny tensors)


def test_rows_round_to_within_half_a_step_and_the_largest_weight_is_127() -> None:
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # a row of zeros: scale 1, all zeros
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert (q.abs() <= 127).all() and q[3].eq(0).all() and scale[3] == 1
    assert torch.equal(q.abs().amax(1)[[0, 1, 2, 4, 5]], torch.full((5,), 127, dtype=torch.int8))
    assert ((w - scale[:, None] * q).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_an_int8_layer_is_the_dequantized_float_layer_for_one_row_and_many(bias: bool, dtype: torch.dtype) -> None:
    """Eager, in float32 and bf16 (a bf16 model's layer holds a bf16 scale): one row, and rows of a batch, give the
    float layer whose weight is the dequantized ``s_o q_oi``, to the dtype's rounding."""
    linear = nn.Linear(24, 10, bias=bias).to(dtype)
    layer = Int8Linear(linear)
    dequantized = layer.dequantized()  # (out, in)
    assert dequantized.dtype == dtype and torch.equal(dequantized, layer.scale[:, None] * layer.weight.to(dtype))
    g = torch.Generator().manual_seed(1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for x in (torch.randn(1, 1, 24, generator=g), torch.randn(3, 5, 24, generator=g),
              torch.randn(24, 7, generator=g).t()[:, None]):  # (7, 1, 24), strided
        x = x.to(dtype)
        ours = layer(x)
        assert ours.dtype == dtype and ours.shape == (*x.shape[:-1], 10)
        torch.testing.assert_close(ours, F.linear(x, dequantized, linear.bias), atol=tolerance, rtol=tolerance)


def test_quantizing_copies_the_model_keeps_its_hooks_and_moves_logits_little() -> None:
    model = make_lm(positions="rope", n_kv_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_int8(model)
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())
    assert len(quantized.out_proj._forward_hooks) == 1  # the test model's </s> bias, carried over
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the model itself unchanged
    tokens = prompts(2, 12)
    with torch.inference_mode():
        ours, theirs = quantized(tokens), model(tokens)  # (B, T, V), the out_proj hook's </s> bias in both
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_the_int8_decoder_steps_give_the_int8_model_s_logits_eager_and_compiled() -> None:
    """The static-cache step through the int8 copy equals that copy's full forward pass (eager), and the compiled
    int8 step (the int8 weight widened inside the matrix-vector loop) gives its greedy tokens at batch 1."""
    model = to_eager(make_lm(**CONFIGS["rope-gqa-window3"])).eval()
    with pytest.raises(ValueError, match="quantize must be"):
        CompiledDecoder(model, quantize="int4")
    eager = CompiledDecoder(model, compile=False, quantize="int8")
    tokens = prompts(3, 16)
    with torch.inference_mode():
        full = eager.model(tokens)  # (B, T, V)
        logits, state = eager.step(tokens[:, :4], eager.init_state())
        stepped = [logits]
        for t in range(4, 16):
            logits, state = eager.step(tokens[:, t: t + 1], state)
            stepped.append(logits)
    torch.testing.assert_close(torch.stack(stepped, 1), full[:, 3:], atol=1e-4, rtol=1e-4)
    prompt = prompts(1, 5).tolist()
    compiled = CompiledDecoder(copy.deepcopy(model), quantize="int8")
    ours = torch.stack(list(generate(compiled, prompt, 20, temperature=0.0, ignore_eos=True)), 1)
    theirs = torch.stack(list(generate(eager.model, prompt, 20, temperature=0.0, ignore_eos=True)), 1)
    assert torch.equal(ours, theirs)


def dequantized_copy(model: nn.Module, quantized: nn.Module) -> nn.Module:
    """A float copy of ``model`` whose linear layers hold the weights ``quantized``'s int8 layers compute with
    (a tied output layer untied: the embedding stays float in both)."""
    floats = copy.deepcopy(model)
    layers = dict(quantized.named_modules())
    for name, module in floats.named_modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(layers[name].dequantized())
    return floats


def test_an_int8_model_runs_eagerly_as_its_dequantized_float_model_at_depth() -> None:
    """A deep model's int8 copy, run as an ordinary model (forward, and generation through its step and cache),
    computes what the float model with the dequantized weights computes: the same logits, the same greedy tokens;
    and its logits stay within the documented tolerance of the float model's (5% of their spread,
    docs/engine.md)."""
    model = to_eager(deep_lm())
    quantized = quantize_int8(model)
    floats = dequantized_copy(model, quantized)
    assert floats.out_proj.weight is not floats.embed.weight  # untied: the embedding stays as it was
    prompt = prompts(2, 6)
    tokens = greedy(quantized, prompt, 16)
    assert torch.equal(tokens, greedy(floats, prompt, 16))
    sequence = torch.cat([prompt, tokens], 1)
    with torch.inference_mode():
        torch.testing.assert_close(quantized(sequence), floats(sequence), atol=1e-4, rtol=1e-4)
        logits, _ = quantized.step(sequence, quantized.init_state())
        torch.testing.assert_close(logits, floats(sequence)[:, -1], atol=1e-4, rtol=1e-4)
        want = model(sequence)  # (B, T, V), the float weights
        assert (quantized(sequence) - want).abs().max() <= 0.05 * want.abs().max()
