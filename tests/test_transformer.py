"""Multi-head attention, Transformer layers and models against torch.nn, plus invariances."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit import (
    DecoderLayer,
    EncoderLayer,
    KVCache,
    LayerOptions,
    MultiHeadAttention,
    SinusoidalPositions,
    Transformer,
    causal_mask,
    padding_mask,
    preset,
)

D, H, FF = 32, 4, 64


def copy_mha(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ours.in_proj.weight.copy_(theirs.in_proj_weight)
        ours.in_proj.bias.copy_(theirs.in_proj_bias)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)


def randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture
def mha_pair() -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    theirs = nn.MultiheadAttention(D, H, batch_first=True)
    randomize(theirs, 0)
    ours = MultiHeadAttention(D, H)
    copy_mha(ours, theirs)
    return ours.eval(), theirs.eval()


def test_self_attention_with_padding_and_causal_masks_equals_torch(mha_pair) -> None:
    ours, theirs = mha_pair
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, D, generator=g)
    ids = torch.tensor([[5] * 7, [5] * 4 + [0] * 3, [5] * 6 + [0]])
    keep = padding_mask(ids)  # (B, 1, T), True = real
    mask = keep[:, None] & causal_mask(7)  # (B, 1, T, T)
    out, w, _ = ours(x, None, mask, need_weights=True)
    ref, ref_w = theirs(x, x, x, key_padding_mask=~keep[:, 0], attn_mask=~causal_mask(7), need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.mean(1), ref_w, atol=1e-5, rtol=1e-5)
    fused, none, _ = ours(x, None, mask)  # fused kernel path
    assert none is None
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)


def test_cross_attention_with_padding_equals_torch(mha_pair) -> None:
    ours, theirs = mha_pair
    g = torch.Generator().manual_seed(2)
    x, mem = torch.randn(2, 5, D, generator=g), torch.randn(2, 9, D, generator=g)
    keep = padding_mask(lengths=torch.tensor([9, 6]))  # (B, 1, S)
    out, _, _ = ours(x, mem, keep[:, None])
    ref, _ = theirs(x, mem, mem, key_padding_mask=~keep[:, 0])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dk_differs_from_dv_and_per_head_weights() -> None:
    mha = MultiHeadAttention(D, n_heads=2, d_k=5, d_v=7).eval()
    x = torch.randn(2, 4, D)
    out, w, _ = mha(x, need_weights=True)
    assert out.shape == (2, 4, D) and w.shape == (2, 2, 4, 4)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 4))


def test_self_attention_cache_appends_and_cross_cache_projects_once(mha_pair) -> None:
    ours, _ = mha_pair
    g = torch.Generator().manual_seed(3)
    x, mem = torch.randn(2, 6, D, generator=g), torch.randn(2, 4, D, generator=g)
    full, _, _ = ours(x, None, causal_mask(6))
    cache, steps = KVCache(), []
    for t in range(6):
        y, _, cache = ours(x[:, t: t + 1], None, None, cache=cache)
        steps.append(y)
    assert cache.k.shape == (2, H, 6, D // H)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)

    cross, _, cross_cache = ours(x[:, :1], mem, None, cache=KVCache())
    k_first = cross_cache.k
    _, _, cross_cache = ours(x[:, 1:2], mem * 0, None, cache=cross_cache)  # memory not projected again
    assert cross_cache.k is k_first


def copy_layer(ours: nn.Module, theirs: nn.Module, decoder: bool) -> None:
    copy_mha(ours.self_attn, theirs.self_attn)
    if decoder:
        copy_mha(ours.cross_attn, theirs.multihead_attn)
    pairs = [(ours.ff.w1, theirs.linear1), (ours.ff.w2, theirs.linear2), (ours.norm1, theirs.norm1),
             (ours.norm2, theirs.norm2)] + ([(ours.norm3, theirs.norm3)] if decoder else [])
    with torch.no_grad():
        for a, b in pairs:
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_equals_torch(norm_first: bool) -> None:
    theirs = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    randomize(theirs, 4)
    ours = EncoderLayer(D, H, FF, LayerOptions(dropout=0.0, norm_first=norm_first))
    copy_layer(ours, theirs, decoder=False)
    ours.eval(), theirs.eval()
    x = torch.randn(3, 6, D)
    lengths = torch.tensor([6, 3, 5])
    keep = padding_mask(lengths=lengths)
    out, _ = ours(x, keep[:, None])
    with torch.inference_mode():
        ref = theirs(x, src_key_padding_mask=~keep[:, 0])
    for b, n in enumerate(lengths.tolist()):  # torch's fast path may zero padded rows; compare real ones
        torch.testing.assert_close(out[b, :n], ref[b, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_equals_torch(norm_first: bool) -> None:
    theirs = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    randomize(theirs, 5)
    ours = DecoderLayer(D, H, FF, LayerOptions(dropout=0.0, norm_first=norm_first))
    copy_layer(ours, theirs, decoder=True)
    ours.eval(), theirs.eval()
    g = torch.Generator().manual_seed(6)
    x, mem = torch.randn(2, 5, D, generator=g), torch.randn(2, 7, D, generator=g)
    keep = padding_mask(lengths=torch.tensor([7, 4]))
    out, _, _ = ours(x, mem, causal_mask(5), keep[:, None])
    ref = theirs(x, mem, tgt_mask=~causal_mask(5), memory_key_padding_mask=~keep[:, 0])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sinusoidal_positions_are_the_papers_formula() -> None:
    pe = SinusoidalPositions(8, max_len=50)(50)
    for pos in (0, 1, 17, 49):
        for i in range(4):
            angle = torch.tensor(pos / 10000 ** (2 * i / 8), dtype=torch.float64)
            assert abs(pe[pos, 2 * i].item() - torch.sin(angle).item()) < 1e-6
            assert abs(pe[pos, 2 * i + 1].item() - torch.cos(angle).item()) < 1e-6


def small_model(norm_first: bool = False, positions: str = "sinusoidal", share: bool = True) -> Transformer:
    torch.manual_seed(7)
    cfg = preset("tiny", d_model=D, n_heads=H, d_ff=FF, norm_first=norm_first, positions=positions,
                 share_embeddings=share, dropout=0.1)
    return Transformer(cfg, 40, 40 if share else 30).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    src = torch.randint(4, 30, (3, 7), generator=g)
    src[1, 4:] = 0
    src[2, 6:] = 0
    tgt = torch.randint(4, 30, (3, 6), generator=g)
    tgt[:, 0] = 2
    return src, tgt


@pytest.mark.parametrize("norm_first", [False, True])
def test_appending_padding_changes_nothing(norm_first: bool) -> None:
    model = small_model(norm_first)
    src, tgt = batch()
    logits = model(src, tgt)
    padded_src = torch.cat([src, torch.zeros(3, 5, dtype=torch.long)], dim=1)
    padded_tgt = torch.cat([tgt, torch.zeros(3, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded_src, padded_tgt)[:, :6], logits, atol=1e-5, rtol=1e-5)


def test_future_target_tokens_do_not_leak() -> None:
    model = small_model()
    src, tgt = batch()
    logits = model(src, tgt)
    changed = tgt.clone()
    changed[:, 3:] = torch.randint(4, 30, (3, 3))
    torch.testing.assert_close(model(src, changed)[:, :3], logits[:, :3], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm_first,positions,share",
                         [(False, "sinusoidal", True), (True, "learned", False)])
@pytest.mark.parametrize("use_cache", [True, False])
def test_step_by_step_decoding_equals_full_forward(norm_first, positions, share, use_cache) -> None:
    model = small_model(norm_first, positions, share)
    src, tgt = batch()
    full = model(src, tgt)  # (B, T, V)
    state = model.init_decoder(src, use_cache=use_cache)
    for t in range(tgt.size(1)):
        logits, state, attn = model.decode_step(tgt[:, t], state, need_weights=True)
        torch.testing.assert_close(logits, full[:, t], atol=1e-5, rtol=1e-5)
        assert attn.shape == (3, 7)
        torch.testing.assert_close(attn.sum(-1), torch.ones(3))
        assert attn[1, 4:].abs().sum() == 0  # nothing on source padding


def test_state_select_reorders_rows() -> None:
    model = small_model()
    src, tgt = batch()
    state = model.init_decoder(src)
    _, state, _ = model.decode_step(tgt[:, 0], state)
    index = torch.tensor([2, 0, 0])
    picked = state.select(index)
    logits, _, _ = model.decode_step(tgt[index, 1], picked)
    ref = model(src[index], tgt[index, :2])[:, 1]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_tied_and_shared_embeddings() -> None:
    model = small_model(share=True)
    assert model.out_proj.weight is model.encoder.embed.weight is model.tgt_embed.weight
    separate = small_model(share=False)
    assert separate.tgt_embed is not separate.encoder.embed
    assert separate.out_proj.weight is separate.tgt_embed.weight


def test_presets_match_the_paper() -> None:
    base, big = preset("base"), preset("big")
    assert (base.d_model, base.n_heads, base.d_ff, base.encoder_layers, base.decoder_layers, base.dropout) == \
        (512, 8, 2048, 6, 6, 0.1)
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


def test_training_gradients_reach_every_parameter() -> None:
    model = small_model(share=False).train()
    src, tgt = batch()
    model(src, tgt).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("need_weights", [False, True])
def test_unscaled_dot_score_equals_scaled_with_queries_divided_by_sqrt_dk(need_weights: bool) -> None:
    torch.manual_seed(11)
    scaled, unscaled = MultiHeadAttention(D, H).eval(), MultiHeadAttention(D, H, score="dot").eval()
    unscaled.load_state_dict(scaled.state_dict())
    with torch.no_grad():  # q.k / sqrt(d_k) == (q / sqrt(d_k)).k: rows 0..H*d_k of in_proj make the queries
        unscaled.in_proj.weight[: D] /= (D // H) ** 0.5
        unscaled.in_proj.bias[: D] /= (D // H) ** 0.5
    x, memory = torch.randn(2, 5, D), torch.randn(2, 7, D)
    for mem, mask in ((None, causal_mask(5)), (memory, padding_mask(lengths=torch.tensor([7, 4])).unsqueeze(1))):
        want, want_w, _ = scaled(x, mem, mask, need_weights=need_weights)
        got, got_w, _ = unscaled(x, mem, mask, need_weights=need_weights)
        torch.testing.assert_close(got, want)
        if need_weights:
            torch.testing.assert_close(got_w, want_w)


def test_attention_score_config_reaches_every_attention_layer() -> None:
    from attnkit.common.errors import UserError
    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig

    data = {"data": {"train": "t.de", "valid": "v.de"}, "model": {"transformer": {"attention_score": "dot"}}}
    cfg = load_config(RunConfig, data)
    model = Transformer(cfg.model.transformer, 30, 30)
    scores = {m.score for m in model.modules() if isinstance(m, MultiHeadAttention)}
    assert scores == {"dot"} and len([m for m in model.modules() if isinstance(m, MultiHeadAttention)]) == 9
    assert {m.score for m in Transformer(preset("tiny"), 30, 30).modules()
            if isinstance(m, MultiHeadAttention)} == {"scaled_dot"}
    with pytest.raises(UserError, match="attention_score"):
        load_config(RunConfig, data, ["model.transformer.attention_score=additive"])
    with pytest.raises(ValueError, match="scaled_dot or dot"):
        MultiHeadAttention(D, H, score="general")
