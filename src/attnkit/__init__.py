"""attnkit: attention and the Transformer as the seeds describe them, trained and inspected on a CPU.

Where things are (the layout is the architecture):

- :mod:`attnkit.attention`   — masks, score functions, softmax/hard normalizers, the kernel :func:`attend`
- :mod:`attnkit.multihead`   — :class:`MultiHeadAttention` (grouped-query option) and its :class:`KVCache`
- :mod:`attnkit.positions`   — the token embedding; sinusoidal, learned, RoPE, ALiBi positions
- :mod:`attnkit.lm`          — the GPT whole: :class:`LMConfig`, :class:`Block`, :class:`LanguageModel`
- :mod:`attnkit.layers`      — the encoder-decoder's layers
- :mod:`attnkit.transformer` — the encoder-decoder :class:`Transformer` and its presets
- :mod:`attnkit.classifier`  — the encoder-only :class:`TransformerClassifier`
- :mod:`attnkit.rnn`         — :class:`RNNSeq2Seq` with and without attention
- :mod:`attnkit.search`      — greedy and beam search over the shared single-step interface
- :mod:`attnkit.engine`      — every speed trick, apart: :func:`attnkit.engine.to_eager` swaps them in

Everything else is a package named for its role, imports pointing down (``tests/test_layout.py``):
``common`` < the textbook < ``engine``, ``config`` < ``data`` < ``runs`` < ``inference`` < ``viz``,
``tasks`` < ``interop`` < ``training``, ``export`` < ``serve`` < ``cli``.
"""

from .attention import (
    AdditiveScore,
    GeneralScore,
    attend,
    attention_override,
    causal_mask,
    dot_score,
    hard_attention,
    make_scorer,
    padding_mask,
    scaled_dot_score,
    sliding_window_mask,
    soft_attention,
)
from .classifier import TransformerClassifier
from .layers import DecoderLayer, EncoderLayer, LayerOptions
from .lm import Block, FeedForward, LanguageModel, LMConfig
from .multihead import KVCache, MultiHeadAttention
from .positions import ALiBi, RotaryPositions, SinusoidalPositions, TokenEmbedding
from .rnn import RNNConfig, RNNSeq2Seq
from .transformer import PRESETS, Transformer, TransformerConfig, preset

__version__ = "0.1.0"

__all__ = [
    "ALiBi", "AdditiveScore", "Block", "DecoderLayer", "EncoderLayer", "FeedForward", "GeneralScore", "KVCache",
    "LMConfig", "LanguageModel", "LayerOptions", "MultiHeadAttention", "PRESETS", "RNNConfig", "RNNSeq2Seq",
    "RotaryPositions", "SinusoidalPositions", "TokenEmbedding", "Transformer", "TransformerClassifier",
    "TransformerConfig", "attend", "attention_override", "causal_mask", "dot_score", "hard_attention", "make_scorer",
    "padding_mask", "preset", "scaled_dot_score", "sliding_window_mask", "soft_attention",
]
