"""The decoder-only language model's options (issue 36): RoPE, ALiBi, grouped-query attention,
sliding windows, the key/value cache, and the engine's kernel against the textbook one.

References are written here in plain torch ops, independently of the code under test: RoPE as a
complex rotation ``(x_i + i x_{i+d/2}) e^{i t theta_i}``, ALiBi's slopes as the paper's code computes
them, multi-head attention as ``softmax(q k^T / sqrt(d_k) + bias) v`` from the ``in_proj`` weights, and
the sliding window as its defining inequality. Models are re-initialised with unit-variance
activations (GPT-2's N(0, 0.02) makes attention nearly uniform, so positions would barely matter).
Tolerances: float32 within 1e-5; float64 for gradcheck.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from attnkit.attention import attend, causal_mask, repeat_kv, sliding_window_mask
from attnkit.engine import fast_attend, to_eager
from attnkit.engine.eager import EagerMultiHeadAttention
from attnkit.lm import Block, LanguageModel, LMConfig
from attnkit.multihead import KVCache, MultiHeadAttention
from attnkit.positions import ALiBi, RotaryPositions, alibi_slopes
from attnkit.sampling import generate
from attnkit.transformer import Transformer, TransformerConfig

VOCAB, D_MODEL, HEADS, LAYERS, D_FF, MAX_LEN = 50, 32, 4, 2, 64, 64
D_HEAD = D_MODEL // HEADS
ATOL = 1e-5

#: Model options under test: every ``positions`` kind, and the combinations Llama-style models use.
CONFIGS: dict[str, dict] = {
    "sinusoidal": {"positions": "sinusoidal"},
    "learned": {"positions": "learned"},
    "rope": {"positions": "rope"},
    "alibi": {"positions": "alibi"},
    "none": {"positions": "none"},
    "rope-gqa2": {"positions": "rope", "n_kv_heads": 2},
    "alibi-mqa": {"positions": "alibi", "n_kv_heads": 1},
    "rope-window3": {"positions": "rope", "window": 3},
    "alibi-window4-gqa2": {"positions": "alibi", "window": 4, "n_kv_heads": 2},
    "learned-window2": {"positions": "learned", "window": 2},
    "llama": {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "n_kv_heads": 2,
              "rope_theta": 500000.0},
    "qwen2": {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "qkv_bias": True,
              "n_kv_heads": 2, "rope_theta": 500000.0},
    "post-norm-gelu-tanh": {"positions": "sinusoidal", "norm_first": False, "activation": "gelu_tanh"},
}
POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "none"]


# --------------------------------------------------------------------------------------
# Helpers and references
# --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and does not spin against other processes' work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spread_weights_(model: torch.nn.Module, seed: int) -> None:
    """Every matrix ``N(0, 1/fan_in)`` (unit-variance activations), biases ``N(0, 0.1)``, gains ``1 + N(0, 0.1)``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * p.size(-1) ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def make_lm(seed: int = 0, layers: int = LAYERS, **options) -> LanguageModel:
    torch.manual_seed(seed)
    cfg = TransformerConfig(d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF, decoder_layers=layers, dropout=0.0,
                            max_len=MAX_LEN, **options)
    model = LanguageModel(cfg, VOCAB)
    spread_weights_(model, seed)
    return model.eval()


def random_tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))  # no <pad>


def other_token(tokens: torch.Tensor, t: int) -> torch.Tensor:
    """``tokens`` with position ``t`` changed to another (non-pad) token in every row."""
    changed = tokens.clone()
    changed[:, t] = tokens[:, t] % (VOCAB - 1) + 1
    assert (changed[:, t] != tokens[:, t]).all()
    return changed


def both_engines(model: LanguageModel) -> list[LanguageModel]:
    """The textbook model and an accelerated deep copy of it (same parameters, the engine's kernel)."""
    fast = to_eager(copy.deepcopy(model))
    assert all(type(m) is EagerMultiHeadAttention for m in fast.modules() if isinstance(m, MultiHeadAttention))
    return [model, fast]


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE as a complex rotation (RoFormer eq. 34), pairs ``(i, i + d/2)``: ``z_i e^{i t theta^(-2i/d)}``.

    ``x`` ``(..., T, d)`` at ``positions`` ``(T,)``; computed in float64, returned in ``x``'s dtype.
    """
    d = x.size(-1)
    half = d // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # (..., T, d/2)
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = positions.double()[:, None] * freq  # (T, d/2)
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([rotated.real, rotated.imag], dim=-1).to(x.dtype)


def reference_self_attention(mha: MultiHeadAttention, x: torch.Tensor, *, rope_theta: float | None = None,
                             slopes: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal multi-head self-attention by hand from ``in_proj`` / ``out_proj``, K/V heads repeated.

    :returns: ``(output (B, T, d_model), keys (B, H_kv, T, d_k) after RoPE, values (B, H_kv, T, d_v))``.
    """
    B, T, _ = x.shape
    H, Hkv, dk = mha.n_heads, mha.n_kv_heads, mha.d_k
    W, b = mha.in_proj.weight, mha.in_proj.bias
    rows = [slice(0, H * dk), slice(H * dk, (H + Hkv) * dk), slice((H + Hkv) * dk, (H + 2 * Hkv) * dk)]
    q, k, v = (x @ W[r].T + (0 if b is None else b[r]) for r in rows)  # (B, T, heads*d_k)
    q = q.view(B, T, H, dk).transpose(1, 2)  # (B, H, T, d_k)
    k = k.view(B, T, Hkv, dk).transpose(1, 2)  # (B, H_kv, T, d_k)
    v = v.view(B, T, Hkv, dk).transpose(1, 2)
    if rope_theta is not None:
        q, k = rope_reference(q, torch.arange(T), rope_theta), rope_reference(k, torch.arange(T), rope_theta)
    k_rep = k.repeat_interleave(H // Hkv, dim=1)  # query head h uses key/value head h // (H / H_kv)
    v_rep = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k_rep.transpose(-2, -1) / math.sqrt(dk)  # (B, H, T, T)
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    if slopes is not None:
        scores = scores - torch.tensor(slopes)[:, None, None] * (t - s)  # -m_h (t - s)
    scores = scores.masked_fill(s > t, float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v_rep  # (B, H, T, d_v)
    out = context.transpose(1, 2).reshape(B, T, H * dk) @ mha.out_proj.weight.T
    if mha.out_proj.bias is not None:
        out = out + mha.out_proj.bias
    return out, k, v


# --------------------------------------------------------------------------------------
# 1. RoPE
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("theta", [10000.0, 500000.0, 100.0])
@pytest.mark.parametrize("offset", [0, 7])
def test_rope_equals_the_complex_rotation(theta: float, offset: int) -> None:
    x = torch.randn(2, 3, 11, 8, generator=torch.Generator().manual_seed(0))
    rotated = RotaryPositions(8, theta)(x, offset)
    torch.testing.assert_close(rotated, rope_reference(x, torch.arange(offset, offset + 11), theta),
                               atol=ATOL, rtol=ATOL)


def test_rope_score_depends_only_on_the_offset() -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)
    rope = RotaryPositions(16)

    def score(t: int, s: int) -> float:
        return float((rope(q, t) * rope(k, s)).sum())

    by_offset = {}
    for delta in (-4, -1, 0, 1, 3, 10):
        scores = [score(t, t - delta) for t in (10, 11, 17, 40, 123, 300)]
        torch.testing.assert_close(torch.tensor(scores), torch.full((6,), scores[0]), atol=ATOL, rtol=ATOL)
        by_offset[delta] = scores[0]
    gaps = torch.tensor(sorted(by_offset.values())).diff()
    assert gaps.min() > 1e-3, by_offset  # different offsets: different scores
    assert by_offset[0] == pytest.approx(float((q * k).sum()), abs=ATOL)  # offset 0: the unrotated dot product


def test_rope_preserves_norms() -> None:
    x = torch.randn(2, 4, 20, 8, generator=torch.Generator().manual_seed(3))
    rotated = RotaryPositions(8)(x, offset=5)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), atol=ATOL, rtol=ATOL)
    assert not torch.allclose(rotated[..., 1:, :], x[..., 1:, :], atol=1e-2)  # it does rotate


def test_rope_offset_equals_slicing_a_longer_sequence() -> None:
    x = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(4))
    full = RotaryPositions(8)(x)
    growing = RotaryPositions(8)  # its tables grow as later positions come
    for start, end in ((0, 3), (3, 4), (4, 9), (9, 40)):
        torch.testing.assert_close(growing(x[..., start:end, :], offset=start), full[..., start:end, :],
                                   atol=ATOL, rtol=ATOL)


def test_rope_theta_changes_the_rotation_and_reaches_the_model() -> None:
    x = torch.randn(1, 1, 6, 8, generator=torch.Generator().manual_seed(5))
    base, llama3 = RotaryPositions(8)(x), RotaryPositions(8, theta=500000.0)(x)
    torch.testing.assert_close(base[..., 0, :], llama3[..., 0, :])  # position 0 is never rotated
    assert (base[..., 1:, :] - llama3[..., 1:, :]).abs().max() > 1e-2

    default, other = make_lm(positions="rope"), make_lm(positions="rope", rope_theta=500000.0)
    other.load_state_dict(default.state_dict())
    assert all(layer.self_attn.rotary.theta == 500000.0 for layer in other.layers)
    tokens = random_tokens(2, 8)
    with torch.no_grad():
        a, b = default(tokens), other(tokens)
    torch.testing.assert_close(a[:, 0], b[:, 0], atol=ATOL, rtol=ATOL)  # one position: nothing to rotate against
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-3


def test_rope_refuses_an_odd_head_size() -> None:
    with pytest.raises(ValueError, match="even"):
        RotaryPositions(7)


# --------------------------------------------------------------------------------------
# 2. ALiBi
# --------------------------------------------------------------------------------------


def test_alibi_slopes_for_a_power_of_two_are_the_papers() -> None:
    assert alibi_slopes(8) == pytest.approx([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256],
                                            rel=1e-12)
    assert alibi_slopes(4) == pytest.approx([1 / 4, 1 / 16, 1 / 64, 1 / 256], rel=1e-12)
    assert alibi_slopes(1) == pytest.approx([1 / 256], rel=1e-12)


def test_alibi_slopes_for_other_head_counts_are_the_reference_codes() -> None:
    """ofirpress/attention_with_linear_biases ``get_slopes``: 8 power-of-two slopes, then get_slopes(16)[0::2][:4]."""
    expected_12 = [
        0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,  # 2^-1 .. 2^-8
        0.7071067811865476,  # 2^-0.5
        0.35355339059327373,  # 2^-1.5
        0.17677669529663687,  # 2^-2.5
        0.08838834764831843,  # 2^-3.5
    ]
    assert alibi_slopes(12) == pytest.approx(expected_12, rel=1e-12)
    # 6 heads: 4 power-of-two slopes 2^-2, 2^-4, 2^-6, 2^-8, then get_slopes(8)[0::2][:2] = 2^-1, 2^-3
    assert alibi_slopes(6) == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125], rel=1e-12)
    with pytest.raises(ValueError):
        alibi_slopes(0)


@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_bias_is_minus_slope_times_distance_under_the_causal_mask(heads: int) -> None:
    T = 7
    bias = ALiBi(heads)(T, T)
    assert bias.shape == (heads, T, T)
    slopes = alibi_slopes(heads)
    for h in range(heads):
        for t in range(T):
            for s in range(t + 1):
                assert float(bias[h, t, s]) == pytest.approx(-slopes[h] * (t - s), abs=1e-6)


@pytest.mark.parametrize("T_q", [1, 3, 8])
def test_alibi_bias_for_cached_queries_is_the_last_rows_of_the_full_bias(T_q: int) -> None:
    alibi = ALiBi(4)
    torch.testing.assert_close(alibi(T_q, 8), alibi(8, 8)[:, -T_q:], atol=0, rtol=0)


# --------------------------------------------------------------------------------------
# 3. Grouped-query attention (and the layer against a reference written here)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["none", "rope", "alibi"])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_multihead_attention_equals_the_textbook_formula(n_kv_heads: int, positions: str) -> None:
    torch.manual_seed(0)
    rotary = RotaryPositions(D_HEAD) if positions == "rope" else None
    alibi = ALiBi(HEADS) if positions == "alibi" else None
    mha = MultiHeadAttention(D_MODEL, HEADS, n_kv_heads=n_kv_heads, rotary=rotary, alibi=alibi, causal=True)
    spread_weights_(mha, 0)
    x = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(1))
    out, _, cache = mha(x, cache=KVCache())
    expected, k, v = reference_self_attention(mha, x, rope_theta=10000.0 if rotary else None,
                                              slopes=alibi_slopes(HEADS) if alibi else None)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)
    assert cache.k.shape == (2, n_kv_heads, 9, D_HEAD) and cache.v.shape == (2, n_kv_heads, 9, D_HEAD)
    torch.testing.assert_close(cache.k, k, atol=ATOL, rtol=ATOL)  # keys cached after the rotation
    torch.testing.assert_close(cache.v, v, atol=ATOL, rtol=ATOL)


def test_qkv_bias_biases_the_query_key_and_value_projections_only() -> None:
    """Qwen2: ``Q = x W^Q + b^Q`` (likewise K, V) and no bias on ``W^O``; the textbook formula with those biases."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS, bias=False, qkv_bias=True, n_kv_heads=2, rotary=RotaryPositions(D_HEAD),
                             causal=True)
    assert mha.in_proj.bias is not None and mha.in_proj.bias.shape == ((HEADS + 2 * 2) * D_HEAD,)
    assert mha.out_proj.bias is None
    spread_weights_(mha, 0)
    x = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(1))
    expected, _, _ = reference_self_attention(mha, x, rope_theta=10000.0)
    torch.testing.assert_close(mha(x)[0], expected, atol=ATOL, rtol=ATOL)
    # in a model: one tensor more per layer than without, and nothing else changes
    plain, qwen2 = make_lm(**CONFIGS["llama"]), make_lm(**CONFIGS["qwen2"])
    assert set(plain.state_dict()) <= set(qwen2.state_dict())
    assert set(qwen2.state_dict()) - set(plain.state_dict()) == {f"layers.{i}.self_attn.in_proj.bias"
                                                                 for i in range(LAYERS)}


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_repeat_kv_serves_consecutive_query_heads(n_kv_heads: int) -> None:
    x = torch.randn(2, n_kv_heads, 5, 3)
    groups = HEADS // n_kv_heads
    repeated = repeat_kv(x, groups)
    for h in range(HEADS):
        assert torch.equal(repeated[:, h], x[:, h // groups])


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_attend_with_fewer_key_heads_equals_repeated_keys(n_kv_heads: int) -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, HEADS, 5, 8, generator=g)
    k, v = torch.randn(2, n_kv_heads, 7, 8, generator=g), torch.randn(2, n_kv_heads, 7, 8, generator=g)
    grouped, _ = attend(q, k, v, causal=True)
    groups = HEADS // n_kv_heads
    k_rep, v_rep = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    weights = torch.softmax((q @ k_rep.transpose(-2, -1) / math.sqrt(8)).masked_fill(~causal_mask(5, 7), -math.inf),
                            dim=-1)
    torch.testing.assert_close(grouped, weights @ v_rep, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_the_cache_holds_only_the_key_value_heads(n_kv_heads: int) -> None:
    model = make_lm(positions="rope", n_kv_heads=n_kv_heads)
    tokens = random_tokens(3, 6)
    with torch.no_grad():
        _, state = model.step(tokens, model.init_state())
    assert state.length == 6 and len(state.caches) == LAYERS
    for cache in state.caches:
        assert cache.k.shape == (3, n_kv_heads, 6, D_HEAD) and cache.v.shape == (3, n_kv_heads, 6, D_HEAD)
    assert model.layers[0].self_attn.in_proj.weight.shape == ((HEADS + 2 * n_kv_heads) * D_HEAD, D_MODEL)


# --------------------------------------------------------------------------------------
# 4. Sliding window
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("T_q,T_k", [(5, 5), (3, 8), (1, 6), (6, 6)])
@pytest.mark.parametrize("window", [0, 1, 2, 3, 10])
def test_sliding_window_mask_is_its_definition(T_q: int, T_k: int, window: int) -> None:
    expected = torch.zeros(T_q, T_k, dtype=torch.bool)
    for i in range(T_q):
        p = i + T_k - T_q  # the query's position among the keys
        for j in range(T_k):
            expected[i, j] = j <= p and (window == 0 or p - window < j)
    assert torch.equal(sliding_window_mask(T_q, T_k, window), expected)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("positions", ["rope", "alibi", "learned"])
def test_a_windowed_model_sees_exactly_its_receptive_field(layers: int, positions: str) -> None:
    """With L layers of window w, position t sees positions t - L (w - 1) .. t and nothing earlier."""
    window, T = 3, 12
    t = T - 1
    reach = layers * (window - 1)
    tokens = random_tokens(2, T)
    for model in both_engines(make_lm(layers=layers, positions=positions, window=window)):
        with torch.no_grad():
            base = model(tokens)[:, t]
            outside = model(other_token(tokens, t - reach - 1))[:, t]
            inside = model(other_token(tokens, t - reach))[:, t]
        torch.testing.assert_close(outside, base, atol=1e-6, rtol=0)
        assert (inside - base).abs().max() > 1e-3


# --------------------------------------------------------------------------------------
# 5. Cached decoding == the whole sequence at once
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["textbook", "engine"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_the_full_forward(name: str, engine: str) -> None:
    """A 4-token prompt, a 3-token chunk (queries the last T_q of T_k keys), then one token at a time."""
    textbook = make_lm(**CONFIGS[name])
    model = textbook if engine == "textbook" else both_engines(textbook)[1]
    state = assert_cached_decoding_equals_full(textbook, model, random_tokens(2, 12), ATOL)
    assert state.length == 12


def assert_cached_decoding_equals_full(textbook: LanguageModel, model: LanguageModel, tokens: torch.Tensor,
                                       atol: float):
    """``model``'s cached decoding of ``tokens`` ``(B, 12)`` (a 4-token prompt, a 3-token chunk, then one token at
    a time) gives ``textbook``'s full-forward logits; returns the final state."""
    with torch.no_grad():
        full = textbook(tokens)  # (B, T, V), the textbook model as the reference
        logits, state = model.step(tokens[:, :4], model.init_state())
        torch.testing.assert_close(logits, full[:, 3], atol=atol, rtol=atol)
        hidden, _, state = model.features(tokens[:, 4:7], state)
        torch.testing.assert_close(model.out_proj(hidden), full[:, 4:7], atol=atol, rtol=atol)
        for t in range(7, 12):
            logits, state = model.step(tokens[:, t:t + 1], state)
            torch.testing.assert_close(logits, full[:, t], atol=atol, rtol=atol)
    return state


# --------------------------------------------------------------------------------------
# 6. The engine's kernel == the textbook kernel
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_gives_the_textbook_logits_and_gradients(name: str) -> None:
    textbook = make_lm(**CONFIGS[name]).train()  # dropout 0: training mode is deterministic
    fast = both_engines(textbook)[1]
    tokens = random_tokens(3, 10)
    (ref_logits, ref_grads), (fast_logits, fast_grads) = (logits_and_grads(m, tokens) for m in (textbook, fast))
    torch.testing.assert_close(fast_logits, ref_logits, atol=ATOL, rtol=ATOL)
    assert ref_grads.keys() == fast_grads.keys()
    for n, grad in ref_grads.items():
        assert grad is not None and grad.abs().sum() > 0, n
        torch.testing.assert_close(fast_grads[n], grad, atol=ATOL, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def logits_and_grads(model: LanguageModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``model``'s logits for ``tokens`` and the gradients of its next-token loss, by parameter name."""
    logits = model(tokens)
    F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _kernel_inputs(n_kv_heads: int, T_q: int, T_k: int, with_bias: bool, with_mask: bool, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, T_q, 8, generator=g)
    k, v = torch.randn(2, n_kv_heads, T_k, 8, generator=g), torch.randn(2, n_kv_heads, T_k, 8, generator=g)
    bias = -torch.rand(HEADS, T_q, T_k, generator=g) * 3 if with_bias else None
    mask = torch.rand(2, 1, T_q, T_k, generator=g) > 0.3 if with_mask else None
    if mask is not None:
        mask[1, 0, 0] = False  # a query with nothing to attend to
    return q, k, v, bias, mask


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("T_q,T_k", [(6, 6), (3, 7), (1, 5)])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_attend_equals_attend(causal: bool, with_bias: bool, with_mask: bool, n_kv_heads: int,
                                   T_q: int, T_k: int, need_weights: bool) -> None:
    inputs = _kernel_inputs(n_kv_heads, T_q, T_k, with_bias, with_mask)
    outputs = []
    for kernel in (attend, fast_attend):
        q, k, v, bias, mask = (None if x is None else x.clone().requires_grad_(x.is_floating_point())
                               for x in inputs)
        context, weights = kernel(q, k, v, mask, bias=bias, causal=causal, need_weights=need_weights)
        (context * torch.linspace(-1, 1, context.numel()).view_as(context)).sum().backward()
        grads = [x.grad for x in (q, k, v, bias) if x is not None]
        outputs.append((context.detach(), None if weights is None else weights.detach(), grads))
    (ref, ref_w, ref_grads), (fast, fast_w, fast_grads) = outputs
    assert not torch.isnan(fast).any()
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=ATOL)
    if need_weights:
        torch.testing.assert_close(fast_w, ref_w, atol=1e-6, rtol=ATOL)
    else:
        assert fast_w is None and ref_w is None
    for a, b in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
    if with_mask:  # the row with nothing to attend to: zeros, not NaN
        assert torch.equal(fast[1, :, 0], torch.zeros_like(fast[1, :, 0]))


def test_fast_attend_zeroes_rows_that_only_the_causal_mask_empties() -> None:
    """A query whose mask allows only later keys has nothing left once the look-ahead mask applies."""
    q, k, v, bias, _ = _kernel_inputs(2, 3, 5, True, False)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 0] = torch.tensor([False, False, False, True, True])  # query 0 is at position 2
    for b in (None, bias):
        ref, _ = attend(q, k, v, mask, bias=b, causal=True)
        fast, _ = fast_attend(q, k, v, mask, bias=b, causal=True, need_weights=False)
        assert torch.equal(ref[0, :, 0], torch.zeros_like(ref[0, :, 0]))
        torch.testing.assert_close(fast, ref, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_fast_attend_applies_the_inverse_temperature_to_the_bias_too(causal: bool) -> None:
    """``softmax(beta (q.k / sqrt(d) + bias))``: the fused kernel adds its mask after scaling; the bias needs beta."""
    q, k, v, bias, mask = _kernel_inputs(2, 4, 6, True, True)
    ref, _ = attend(q, k, v, mask, bias=bias, causal=causal, beta=0.6)
    fast, _ = fast_attend(q, k, v, mask, bias=bias, causal=causal, beta=0.6, need_weights=False)
    torch.testing.assert_close(fast, ref, atol=ATOL, rtol=ATOL)
    unscaled, _ = attend(q, k, v, mask, bias=bias, causal=causal)
    assert (unscaled - ref).abs().max() > 1e-3  # beta matters here


# --------------------------------------------------------------------------------------
# 7. Causality
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POSITIONS + ["rope-gqa2", "alibi-window4-gqa2", "llama"])
def test_the_future_does_not_leak(name: str) -> None:
    tokens = random_tokens(2, 10)
    for model in both_engines(make_lm(**CONFIGS[name])):
        for t in (0, 5, 9):
            with torch.no_grad():
                base, changed = model(tokens), model(other_token(tokens, t))
            torch.testing.assert_close(changed[:, :t], base[:, :t], atol=1e-6, rtol=0)
            assert (changed[:, t] - base[:, t]).abs().max() > 1e-3


@pytest.mark.parametrize("positions", ["sinusoidal", "learned", "rope", "alibi"])
def test_positions_tell_order_apart(positions: str) -> None:
    """Swapping two earlier tokens changes the last position's logits (not so without positions, one layer)."""
    tokens = random_tokens(2, 8)
    swapped = tokens.clone()
    swapped[:, [2, 5]] = tokens[:, [5, 2]]
    model, orderless = make_lm(positions=positions), make_lm(positions="none", layers=1)
    with torch.no_grad():
        assert (model(swapped)[:, -1] - model(tokens)[:, -1]).abs().max() > 1e-3
        torch.testing.assert_close(orderless(swapped)[:, -1], orderless(tokens)[:, -1], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("positions", ["rope", "alibi", "learned"])
def test_a_model_trains_after_generating(positions: str) -> None:
    """Sampling (under ``torch.inference_mode``) mid-training must leave the model trainable: RoPE's cos/sin tables
    grown while sampling must not be inference tensors, which backward cannot save."""
    model = make_lm(positions=positions).train()
    list(generate(model, random_tokens(1, 4), 12, temperature=0))  # up to 16 positions seen in inference mode
    tokens = random_tokens(2, 8)
    logits = model(tokens)
    F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    assert all(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------------------
# 8. Validation
# --------------------------------------------------------------------------------------


def test_key_value_heads_must_divide_the_heads() -> None:
    for n_kv_heads in (3, 8, -1):
        with pytest.raises(ValueError, match="n_kv_heads"):
            TransformerConfig(d_model=D_MODEL, n_heads=HEADS, n_kv_heads=n_kv_heads).validate()
        with pytest.raises(ValueError, match="n_kv_heads"):
            MultiHeadAttention(D_MODEL, HEADS, n_kv_heads=n_kv_heads)
        with pytest.raises(ValueError, match="n_kv_heads"):
            Block(LMConfig(d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF, n_kv_heads=n_kv_heads))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LanguageModel(TransformerConfig(d_model=D_MODEL, n_heads=HEADS, n_kv_heads=3), VOCAB)


def test_qkv_bias_needs_bias_false() -> None:
    with pytest.raises(ValueError, match="qkv_bias: true .* set bias: false"):
        TransformerConfig(qkv_bias=True).validate()
    with pytest.raises(ValueError, match="qkv_bias"):
        LanguageModel(TransformerConfig(d_model=D_MODEL, n_heads=HEADS, qkv_bias=True), VOCAB)
    TransformerConfig(qkv_bias=True, bias=False).validate()


def test_rope_needs_an_even_head_size() -> None:
    cfg = TransformerConfig(d_model=12, n_heads=4, positions="rope")  # head size 3
    with pytest.raises(ValueError, match="even"):
        cfg.validate()
    with pytest.raises(ValueError, match="even"):
        LanguageModel(cfg, VOCAB)
    TransformerConfig(d_model=12, n_heads=4, positions="alibi").validate()  # only rope needs pairs


@pytest.mark.parametrize("option", [{"positions": "rope"}, {"positions": "alibi"}, {"n_kv_heads": 2},
                                    {"window": 4}, {"norm": "rmsnorm"}, {"activation": "swiglu"},
                                    {"qkv_bias": True, "bias": False}])
def test_an_encoder_decoder_refuses_language_model_options(option: dict) -> None:
    cfg = TransformerConfig(d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF, encoder_layers=1, decoder_layers=1, **option)
    key = next(iter(option))
    with pytest.raises(ValueError, match=f"{key}: {option[key]}"):
        Transformer(cfg, VOCAB, VOCAB)


# --------------------------------------------------------------------------------------
# 9. float64 gradcheck
# --------------------------------------------------------------------------------------


def test_rotary_positions_gradcheck() -> None:
    rope = RotaryPositions(6)
    x = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rope(x, 3), (x,))


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_attend_with_a_bias_gradcheck(n_kv_heads: int) -> None:
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, n_kv_heads, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, n_kv_heads, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    mask = torch.rand(1, 1, 3, 5, generator=g) > 0.2
    mask[..., torch.arange(3), torch.arange(2, 5)] = True  # every query keeps the key at its own position

    def f(q, k, v, bias):
        return attend(q, k, v, mask, bias=bias, causal=True)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
