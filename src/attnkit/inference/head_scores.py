"""What each attention head does: four scores per layer x head, read off its causal self-attention weights.

For one head's weights ``a`` ``(T, T)`` (row ``t``: how position ``t`` spreads its attention over the keys
``u <= t``; rows sum to 1), each score is a mean over rows of the weight on some keys, so it lies in [0, 1]::

    score              formula                                                 a head near 1 ...
    previous_token  =  1/(T-1) sum_{t=1}^{T-1} a[t, t-1]                       reads the token just before it
    sink            =  1/(T-1) sum_{t=1}^{T-1} a[t, 0]                         parks its attention on the first
                                                                               token (the "attention sink")
    local_window    =  1/(T-w) sum_{t=w}^{T-1} sum_{u=t-w+1}^{t} a[t, u]       looks no further back than w
    induction       =  1/n sum_{t=n}^{2n-1} a[t, t-n+1],                       finds the previous occurrence of
                       on the sequence [r_1..r_n, r_1..r_n]                    its token and reads what followed

The previous-token, sink and local-window scores skip the rows with nothing to choose: row 0 (it can only
attend to itself) and, for the window, the rows ``t < w`` (their window is everything). A score with no row
left to average (a text of one token, or of ``w`` tokens or fewer) is NaN.

The induction score is measured, as Olsson et al. (2022, "In-context learning and induction heads", section 2)
measure it, on a sequence the model cannot have memorised: ``n`` random tokens, then the same ``n`` again. On
the second copy, position ``t`` holds the token that stood at ``t - n``; an induction head attends from ``t``
to ``t - n + 1``, the token that followed it last time, which its partner, a previous-token head in an earlier
layer, has marked (Elhage et al. 2021, "A mathematical framework for transformer circuits"). The random tokens
are ordinary (non-special) ids from a seeded generator, all different within a copy when the vocabulary has
enough of them, so the previous occurrence is unique; the score is the mean over a batch of such sequences.

Where they come from: previous-token and positional heads, Voita et al. (2019, "Analyzing multi-head
self-attention"); the attention sink, Xiao et al. (2023, "Efficient streaming language models with attention
sinks"); local attention windows, Beltagy et al. (2020, "Longformer").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["HeadScores", "head_scores", "induction_score", "induction_scores", "local_window_score",
           "previous_token_score", "repeated_random_tokens", "sink_score"]

#: How many positions back the local-window score counts (the key itself included).
LOCAL_WINDOW = 8
#: Length ``n`` of the random sequence that is repeated for the induction score, and how many such sequences.
REPEAT_LENGTH, REPEAT_BATCH = 32, 4


def _check(weights: Tensor, what: str) -> int:
    """``T`` of ``weights`` ``(..., T, T)``. :raises ValueError: the last two dims are not square."""
    if weights.dim() < 2 or weights.size(-1) != weights.size(-2):
        raise ValueError(f"{what} takes attention weights of shape (..., T, T), got {tuple(weights.shape)}")
    return weights.size(-1)


def _nan(weights: Tensor) -> Tensor:
    """A NaN score per head: ``(...)`` for ``weights`` ``(..., T, T)``."""
    return torch.full(weights.shape[:-2], float("nan"), dtype=weights.dtype, device=weights.device)


def previous_token_score(weights: Tensor) -> Tensor:
    """Mean weight on the previous token, ``1/(T-1) sum_{t>=1} a[t, t-1]``: ``(..., T, T)`` -> ``(...)``."""
    T = _check(weights, "previous_token_score")
    if T < 2:
        return _nan(weights)
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # (..., T-1): a[t, t-1] for t = 1..T-1


def sink_score(weights: Tensor) -> Tensor:
    """Mean weight on the first token, ``1/(T-1) sum_{t>=1} a[t, 0]`` (row 0 skipped: it has no choice):
    ``(..., T, T)`` -> ``(...)``."""
    T = _check(weights, "sink_score")
    if T < 2:
        return _nan(weights)
    return weights[..., 1:, 0].mean(-1)  # (..., T-1) -> (...)


def local_window_score(weights: Tensor, window: int = LOCAL_WINDOW) -> Tensor:
    """Mean share of attention on the last ``window`` positions, the key itself included,
    ``1/(T-w) sum_{t>=w} sum_{t-w<u<=t} a[t, u]`` (rows ``t < w`` skipped: their window is everything):
    ``(..., T, T)`` -> ``(...)``."""
    T = _check(weights, "local_window_score")
    if window < 1:
        raise ValueError(f"the local window must be at least 1 position, got {window}")
    if T <= window:
        return _nan(weights)
    t = torch.arange(T, device=weights.device)
    back = t[:, None] - t[None, :]  # (T, T): t - u, how far back key u is from query t
    band = (back >= 0) & (back < window)  # (T, T): u in t-w+1 .. t
    share = (weights * band).sum(-1)  # (..., T): each row's weight inside its window
    return share[..., window:].mean(-1)


def induction_score(weights: Tensor) -> Tensor:
    """Mean weight, on the second copy of ``[r_1..r_n, r_1..r_n]``, on the token after the previous occurrence,
    ``1/n sum_{t=n}^{2n-1} a[t, t-n+1]`` (Olsson et al. 2022): ``(..., 2n, 2n)`` -> ``(...)``."""
    T = _check(weights, "induction_score")
    if T < 2 or T % 2:
        raise ValueError(f"induction_score takes the weights of a sequence repeated twice, (..., 2n, 2n); got T={T}")
    n = T // 2
    # diagonal -(n-1): a[i + n - 1, i] for i = 0..n; i >= 1 are the rows t = n..2n-1 and their keys t - n + 1
    return weights.diagonal(offset=-(n - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)


def repeated_random_tokens(batch: int, n: int, low: int, high: int, generator: torch.Generator) -> Tensor:
    """``batch`` rows of ``n`` random ids from ``low..high-1``, each row then repeated: ``(batch, 2n)``.

    Within a copy the ids are all different when ``high - low >= n`` (a random permutation's first ``n``), else
    drawn independently.
    """
    if n < 1 or high <= low:
        raise ValueError(f"need n >= 1 and ids to draw from; got n={n}, ids {low}..{high - 1}")
    if high - low >= n:
        rows = [torch.randperm(high - low, generator=generator)[:n] for _ in range(batch)]
        first = torch.stack(rows) + low  # (batch, n)
    else:
        first = torch.randint(low, high, (batch, n), generator=generator)  # (batch, n)
    return torch.cat([first, first], dim=1)  # (batch, 2n)


class AttentionModel(Protocol):
    """What :func:`induction_scores` needs of a model (:class:`attnkit.lm.LanguageModel` has it)."""

    training: bool

    def attention_weights(self, tokens: Tensor) -> list[Tensor]: ...  # (B, T) -> per layer (B, H, T, T)
    def parameters(self): ...
    def train(self, mode: bool = True): ...


def induction_scores(model: AttentionModel, vocab_size: int, *, low: int, n: int = REPEAT_LENGTH,
                     batch: int = REPEAT_BATCH, seed: int = 0) -> Tensor:
    """:func:`induction_score` of every head of ``model`` on ``batch`` repeated random sequences -> ``(L, H)``.

    :param vocab_size: ids are drawn from ``low..vocab_size-1`` (``low``: the first id that is not special).
    :param n: the length of one copy (the sequence is ``2n`` long).
    :param seed: the generator's seed: the same sequences, the same scores.
    """
    tokens = repeated_random_tokens(batch, n, low, vocab_size, torch.Generator().manual_seed(seed))  # (B, 2n)
    device = next(model.parameters()).device
    was_training = model.training
    model.train(False)
    try:
        with torch.inference_mode():
            weights = torch.stack(model.attention_weights(tokens.to(device))).float().cpu()  # (L, B, H, 2n, 2n)
    finally:
        model.train(was_training)
    return induction_score(weights).mean(1)  # (L, B, H) -> (L, H)


@dataclass(frozen=True)
class HeadScores:
    """The four scores of every head, each ``(L, H)`` (see the module docstring).

    :param previous_token: ``sink``, ``local_window``: from the weights over one text.
    :param induction: from ``repeats`` random sequences of ``repeat_length`` tokens, each given twice.
    :param window: ``w`` of ``local_window``; ``text_length``: ``T`` of the text.
    """

    previous_token: Tensor
    sink: Tensor
    local_window: Tensor
    induction: Tensor
    window: int
    text_length: int
    repeat_length: int
    repeats: int

    def named(self) -> dict[str, Tensor]:
        """Short name -> ``(L, H)`` scores, in the order of the table and the figures."""
        return {"previous token": self.previous_token, "sink (first token)": self.sink,
                f"local (last {self.window})": self.local_window, "induction": self.induction}

    def notes(self) -> dict[str, str]:
        """Short name -> what it measures, in one line."""
        names = list(self.named())
        text = f"over the text's {self.text_length} tokens"
        return {names[0]: f"mean weight on the token before, {text}",
                names[1]: f"mean weight on the first token, {text}",
                names[2]: f"mean share on the last {self.window} tokens (itself included), {text}",
                names[3]: f"mean weight on the token after the previous occurrence of the current one, on "
                          f"{self.repeats} random sequences of {self.repeat_length} tokens given twice"}

    def table(self) -> str:
        """One line per layer and head: ``layer head previous sink local induction`` (NaN: no row to average)."""
        names = ["previous", "sink", f"local-{self.window}", "induction"]
        lines = ["layer  head  " + "  ".join(f"{name:>9}" for name in names)]
        columns = list(self.named().values())  # 4 x (L, H)
        L, H = self.induction.shape
        for layer in range(L):
            for head in range(H):
                values = "  ".join(f"{float(c[layer, head]):9.3f}" for c in columns)
                lines.append(f"{layer:5d}  {head:4d}  {values}")
        return "\n".join(lines)


def head_scores(model: AttentionModel, text_weights: list[Tensor], vocab_size: int, *, low: int,
                window: int = LOCAL_WINDOW, n: int = REPEAT_LENGTH, batch: int = REPEAT_BATCH,
                seed: int = 0) -> HeadScores:
    """Every score of every head: three from ``text_weights``, per layer ``(H, T, T)`` (one text's causal
    self-attention), and the induction score from ``model`` on repeated random sequences
    (:func:`induction_scores`, which ``vocab_size``, ``low``, ``n``, ``batch`` and ``seed`` configure)."""
    if not text_weights:
        raise ValueError("head_scores needs the attention weights of at least one layer")
    text = torch.stack([w.float().cpu() for w in text_weights])  # (L, H, T, T)
    return HeadScores(previous_token_score(text), sink_score(text), local_window_score(text, window),
                      induction_scores(model, vocab_size, low=low, n=n, batch=batch, seed=seed),
                      window, text.size(-1), n, batch)
