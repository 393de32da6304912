"""Length filters and token-budget batches: which examples a model sees together, and padded.

* Length filtering after tokenization: :func:`filter_lengths`, :func:`filter_examples`.
* Token-budget batching: :func:`make_batches` (length-bucketed, shuffled per epoch),
  :class:`EpochBatches` (a task's batches, made once per epoch), :func:`padding_fraction`,
  :func:`pad_batch`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch
from numpy.typing import ArrayLike

from ..common.numeric import round_up
from ..config.schema import RunConfig

#: Multiplier that mixes ``seed`` and ``epoch`` into one shuffling seed (a prime, so that
#: ``(seed, epoch)`` pairs do not collide for any realistic number of epochs).
_EPOCH_SEED_STRIDE = 100003


@dataclass
class FilterStats:
    """What :func:`filter_examples` kept and why it dropped the rest.

    :param kept: pairs kept.
    :param empty: pairs dropped because a side had no tokens.
    :param too_long: pairs dropped because a side had more than ``max_len`` tokens.
    :param max_len: the limit used.
    """

    kept: int
    empty: int
    too_long: int
    max_len: int

    @property
    def total(self) -> int:
        """Number of pairs looked at."""
        return self.kept + self.empty + self.too_long

    def __add__(self, other: FilterStats) -> FilterStats:
        """The counts of two parts of one corpus (filtered with the same ``max_len``)."""
        return FilterStats(self.kept + other.kept, self.empty + other.empty, self.too_long + other.too_long,
                           self.max_len)

    def __str__(self) -> str:
        return (f"kept {self.kept} of {self.total} pairs (dropped {self.empty} with an empty side, "
                f"{self.too_long} with a side longer than {self.max_len} tokens)")


def filter_lengths(src_lens: ArrayLike, tgt_lens: ArrayLike, max_len: int) -> tuple[np.ndarray, FilterStats]:
    """Which pairs to keep, from their side lengths: both sides non-empty and at most ``max_len`` tokens.

    :return: a boolean mask over the pairs and the counts.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    src, tgt = np.asarray(src_lens, dtype=np.int64), np.asarray(tgt_lens, dtype=np.int64)
    empty = (src == 0) | (tgt == 0)
    too_long = ~empty & ((src > max_len) | (tgt > max_len))
    keep = ~(empty | too_long)
    return keep, FilterStats(kept=int(keep.sum()), empty=int(empty.sum()), too_long=int(too_long.sum()),
                             max_len=max_len)


def filter_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int
) -> tuple[list[int], FilterStats]:
    """Keep the token-id pairs whose sides are both non-empty and at most ``max_len`` long (:func:`filter_lengths`).

    :param examples: ``(src_ids, tgt_ids)`` per example.
    :param max_len: longest allowed side, in tokens (inclusive).
    :return: indices of kept examples (ascending) and the counts.
    """
    keep, stats = filter_lengths([len(s) for s, _ in examples], [len(t) for _, t in examples], max_len)
    return np.flatnonzero(keep).tolist(), stats


def python_random_floats(seed: str | int, n: int) -> np.ndarray:
    """``[random.Random(seed).random() for _ in range(n)]`` as a float64 array, without a Python loop.

    Python's ``random`` and numpy's legacy ``RandomState`` are the same Mersenne Twister with the
    same 53-bit double construction, so numpy continues from Python's seeded state.
    """
    version, state, _ = random.Random(seed).getstate()
    rs = np.random.RandomState()
    rs.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
    return rs.random_sample(n)


class Batches(Sequence[list[int]]):
    """An epoch's batches (lists of example indices), held as two arrays rather than millions of ints.

    Batch ``b`` is ``order[starts[b]:ends[b]]``. Indexing gives a list of ints; equality with
    another :class:`Batches` or a list of lists compares the batches.
    """

    def __init__(self, order: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.order, self.starts, self.ends = order, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> list[int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...

    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.order[self.starts[i]: self.ends[i]].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Batches):
            return (len(self) == len(other) and np.array_equal(self.ends - self.starts, other.ends - other.starts)
                    and all(np.array_equal(self.array(b), other.array(b)) for b in range(len(self))))
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(self[b] == list(o) for b, o in enumerate(other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  -- mutable-looking, compared by value

    def array(self, b: int) -> np.ndarray:
        """Batch ``b`` as an array view (no Python ints)."""
        return self.order[self.starts[b]: self.ends[b]]

    def __repr__(self) -> str:
        return f"Batches({len(self)} batches of {len(self.order)} examples)"


def make_batches(
    src_lens: ArrayLike,
    tgt_lens: ArrayLike | None,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    pad_multiple: int = 1,
) -> Batches:
    """Group example indices into batches of similar length under a padded-token budget.

    1. Sort indices by (padded length of the longer side, padded target length, source
       length, seeded random key): a batch's size is set by its longer side, and within
       that, examples whose target *and* source lengths are close sit together, so both
       sides pad little (sorting by target length alone left a quarter of the source side
       padding on Multi30k). Equal lengths are mixed differently each epoch.
    2. Walk the sorted order, adding examples to the current batch while
       ``n_examples * max(longest src, longest tgt in the batch) <= max_tokens``; the
       budget counts *padded* positions of the longer side. An example longer than the
       budget on its own gets a batch of its own.
    3. When ``shuffle``, shuffle the batch order with
       ``random.Random(seed * 100003 + epoch)``.

    The result depends only on the lengths, ``seed`` and ``epoch``; every index appears in
    exactly one batch. Lengths may be lists or arrays (memory-mapped ones included): the work
    is done in numpy, so millions of examples need a few arrays, not millions of Python objects.

    :param src_lens: length of each source sequence (as fed to the model).
    :param tgt_lens: length of each target sequence, or None for classification.
    :param max_tokens: padded-token budget per batch.
    :param seed: run seed.
    :param epoch: epoch number (changes tie-breaking and batch order).
    :param shuffle: shuffle batch order (training) or keep it sorted by length (evaluation).
    :param pad_multiple: batches will be padded to a multiple of this length (see :func:`pad_batch`);
        the budget counts those positions.
    :return: the batches, each a list of example indices.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    src = np.asarray(src_lens, dtype=np.int64)
    n = len(src)
    if tgt_lens is not None and len(tgt_lens) != n:
        raise ValueError(f"src_lens and tgt_lens differ in length: {n} vs {len(tgt_lens)}")
    tgt = np.asarray(tgt_lens, dtype=np.int64) if tgt_lens is not None else np.zeros(n, dtype=np.int64)
    tie_keys = python_random_floats(f"attnkit.make_batches:{seed}:{epoch}", n)
    longer = np.maximum(src, tgt)
    order = np.lexsort((tie_keys, src, round_up(tgt, pad_multiple), round_up(longer, pad_multiple)))  # last key first
    if n < 1 << 31:
        order = order.astype(np.int32)  # kept for the whole epoch: half the memory
    del tie_keys
    size = round_up(np.maximum(longer[order], 1), pad_multiple)  # non-decreasing along `order`
    del longer

    # Greedy fill: example j joins the batch that starts at s iff (j - s + 1) * size[j] <= max_tokens
    # (size is non-decreasing, so size[j] is the batch's longest); a batch never exceeds
    # max_tokens // size[s] examples, so only that window is looked at.
    starts: list[int] = []
    s = 0
    while s < n:
        starts.append(s)
        window = size[s + 1: s + 1 + max(max_tokens // int(size[s]), 1)]
        over = np.flatnonzero(np.arange(2, len(window) + 2) * window > max_tokens)
        s += 1 + (int(over[0]) if len(over) else len(window))
    bounds = np.array([*starts, n], dtype=np.int64)
    batch_ids = list(range(len(starts)))
    if shuffle:
        random.Random(seed * _EPOCH_SEED_STRIDE + epoch).shuffle(batch_ids)
    return Batches(order, bounds[:-1][batch_ids], bounds[1:][batch_ids])


def padding_fraction(
    batches: Sequence[Sequence[int]], src_lens: ArrayLike, tgt_lens: ArrayLike | None,
    pad_multiple: int = 1,
) -> float:
    """Fraction of padded positions over all source (and target) positions of ``batches``.

    Each batch is padded to its own longest source and, separately, longest target
    (rounded up to ``pad_multiple``, as :func:`pad_batch` does).

    :return: ``padded / total`` in [0, 1]; 0.0 when there are no positions.
    """
    total = real = 0
    sides = [np.asarray(src_lens)] if tgt_lens is None else [np.asarray(src_lens), np.asarray(tgt_lens)]
    arrays = (batches.array(b) for b in range(len(batches))) if isinstance(batches, Batches) else batches
    for batch in arrays:
        if len(batch) == 0:
            continue
        for lens in sides:
            side = lens[np.asarray(batch)]
            total += len(side) * round_up(int(side.max()), pad_multiple)
            real += int(side.sum())
    return 0.0 if total == 0 else (total - real) / total


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, multiple: int = 1) -> torch.Tensor:
    """Right-pad id sequences into one tensor.

    Padding to a multiple of a few tokens keeps the number of distinct batch shapes small, which
    matters on CPUs: oneDNN compiles and keeps a kernel per matmul shape.

    :param seqs: B sequences of token ids, lengths may differ (and may be 0).
    :param pad_id: id written into padded positions.
    :param multiple: pad the length up to a multiple of this.
    :return: LongTensor of shape (B, T) with T = max length rounded up to ``multiple``.
    """
    if len(seqs) == 0:
        raise ValueError("pad_batch needs at least one sequence")
    t_max = padded_length(max(len(s) for s in seqs), multiple)
    return torch.tensor([list(s) + [pad_id] * (t_max - len(s)) for s in seqs], dtype=torch.long)  # (B, T)


def padded_length(longest: int, multiple: int) -> int:
    """The batch length for a longest sequence: rounded up to ``multiple``, and at least one position when
    ``multiple > 1`` (so an all-empty batch still has a shape the model accepts)."""
    return round_up(max(longest, 1 if multiple > 1 else 0), multiple)



class EpochBatches:
    """A task's training batches: length-bucketed by :func:`attnkit.data.batching.make_batches`, shuffled per epoch,
    made once per epoch (the trainer asks for the same epoch's batches many times)."""

    def __init__(self, cfg: RunConfig, src_lens: np.ndarray, tgt_lens: np.ndarray | None = None) -> None:
        self.cfg, self.src_lens, self.tgt_lens = cfg, src_lens, tgt_lens
        self._made: tuple[int, Batches] | None = None

    def __call__(self, epoch: int) -> Batches:
        if self._made is None or self._made[0] != epoch:
            t = self.cfg.train
            self._made = epoch, make_batches(self.src_lens, self.tgt_lens, t.max_tokens, seed=t.seed, epoch=epoch,
                                             pad_multiple=t.pad_multiple)
        return self._made[1]

