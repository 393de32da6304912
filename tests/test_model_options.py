"""The model options other published models need (``attnkit import``), each against its formula.

Marian (OPUS-MT): swish, sinusoids in halves, ``final_logits_bias``; BERT: gelu, no embedding scale,
a token-type row and a LayerNorm on the embeddings, LayerNorm epsilon 1e-12, a tanh pooler.
Every option is off by default, so the paper's model (and every checkpoint) is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnkit.classifier import TransformerClassifier
from attnkit.config.schema import DataConfig
from attnkit.data.documents import framed, reading_windows, window_length
from attnkit.lm import FeedForward
from attnkit.positions import TokenEmbedding, sinusoidal_table
from attnkit.transformer import Transformer, TransformerConfig
from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID

SMALL = dict(d_model=16, n_heads=2, d_ff=32, encoder_layers=2, decoder_layers=2, dropout=0.0, max_len=64)


def marian_table(n_positions: int, dim: int) -> np.ndarray:
    """transformers' MarianSinusoidalPositionalEmbedding.create_weight, restated in numpy."""
    enc = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_positions)])
    out = np.zeros((n_positions, dim))
    half = dim // 2
    out[:, :half] = np.sin(enc[:, 0::2])
    out[:, half:] = np.cos(enc[:, 1::2])
    return out


@pytest.mark.parametrize("dim", [8, 16, 64])
def test_position_layout_halves_is_marians_table(dim):
    got = sinusoidal_table(50, dim, "halves").numpy()
    np.testing.assert_allclose(got, marian_table(50, dim), atol=1e-6)
    interleaved = sinusoidal_table(50, dim).numpy()  # the same numbers, the paper's order
    np.testing.assert_allclose(np.sort(got, axis=1), np.sort(interleaved, axis=1), atol=1e-6)
    assert not np.allclose(got, interleaved)


@pytest.mark.parametrize("activation, formula", [("relu", lambda z: z.clamp(min=0)),
                                                 ("gelu", lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))),
                                                 ("swish", lambda z: z * torch.sigmoid(z))])
def test_feed_forward_activation(activation, formula):
    torch.manual_seed(0)
    ff = FeedForward(8, 16, activation=activation)
    x = torch.randn(3, 5, 8)
    expected = ff.w2(formula(ff.w1(x)))
    torch.testing.assert_close(ff(x), expected, atol=1e-6, rtol=1e-6)


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        FeedForward(8, 16, activation="tanh")  # type: ignore[arg-type]


def test_unscaled_embedding():
    torch.manual_seed(0)
    scaled, plain = TokenEmbedding(10, 16), TokenEmbedding(10, 16, scale=False)
    plain.load_state_dict(scaled.state_dict())
    tokens = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(scaled(tokens), plain(tokens) * 4.0)
    torch.testing.assert_close(plain(tokens), plain.weight[tokens])


def test_token_type_and_embedding_norm_are_berts_embedding_layer():
    """x = LayerNorm(E[tok] + P[pos] + T[0]) with epsilon 1e-12, then the layers."""
    torch.manual_seed(0)
    cfg = TransformerConfig(**SMALL, scale_embeddings=False, positions="learned", token_types=2,
                            embedding_norm=True, norm_eps=1e-12, activation="gelu")
    model = TransformerClassifier(cfg, 30, 2, pooling="first", pooler=True).eval()
    enc = model.encoder
    assert enc.embed_norm.eps == 1e-12 and all(layer.norm1.eps == 1e-12 for layer in enc.layers)
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, PAD_ID, PAD_ID]])
    expected = F.layer_norm(enc.embed.weight[tokens] + enc.positions.table.weight[:4] + enc.token_type.weight[0],
                            (16,), enc.embed_norm.weight, enc.embed_norm.bias, eps=1e-12)
    torch.testing.assert_close(enc.embed_input(tokens), expected)
    # the pooler: logits = W tanh(W_p h_0 + b_p) + b
    hidden, _, _ = enc(tokens)
    logits = model.head(torch.tanh(model.pooler(hidden[:, 0])))
    torch.testing.assert_close(model(tokens), logits)
    # a second segment row exists (a checkpoint's table keeps its shape) but one segment reads row 0 only
    with torch.no_grad():
        enc.token_type.weight[1].add_(100.0)
    torch.testing.assert_close(model(tokens), logits)


def test_output_bias_starts_at_zero_and_is_added():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**SMALL, output_bias=True, activation="swish", position_layout="halves"),
                        20, 20).eval()
    assert torch.count_nonzero(model.out_proj.bias) == 0
    with torch.no_grad():
        model.out_proj.bias.copy_(torch.randn(20))
    src, tgt = torch.tensor([[4, 5, 6, EOS_ID]]), torch.tensor([[BOS_ID, 7, 8]])
    hidden = model.features(src, tgt)
    torch.testing.assert_close(model(src, tgt), hidden @ model.tgt_embed.weight.T + model.out_proj.bias)
    # the cached step-by-step decoder reads the same inputs as teacher forcing (positions in halves included)
    state = model.init_decoder(src)
    for t in range(3):
        logits, state, _ = model.decode_step(tgt[:, t], state)
        torch.testing.assert_close(logits, model(src, tgt)[:, t], atol=1e-5, rtol=1e-5)


def test_defaults_are_the_papers_model():
    """No option adds a tensor by default: every earlier checkpoint keeps its keys."""
    torch.manual_seed(0)
    keys = set(Transformer(TransformerConfig(**SMALL), 20, 20).state_dict())
    assert not any("token_type" in k or "embed_norm" in k or k == "out_proj.bias" for k in keys)
    assert "pooler.weight" not in TransformerClassifier(TransformerConfig(**SMALL), 20, 2).state_dict()


def test_framed_windows_hold_bos_and_eos_within_max_len():
    data = DataConfig(train="x", valid="y", max_len=6, frame=True)
    assert window_length(data) == 4
    assert framed([7, 8], data) == [BOS_ID, 7, 8, EOS_ID]
    assert framed([], data) == [BOS_ID, EOS_ID]
    windows = [framed(w, data) for w in reading_windows(list(range(10, 20)), window_length(data), empty=[])]
    assert all(len(w) <= 6 and w[0] == BOS_ID and w[-1] == EOS_ID for w in windows)
    plain = DataConfig(train="x", valid="y", max_len=6)
    assert window_length(plain) == 6 and framed([], plain) == [PAD_ID] and framed([7], plain) == [7]
