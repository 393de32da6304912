"""Tests for greedy and beam search against mock single-step decoders."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from attnkit.search import (
    Hypothesis,
    StepDecoder,
    beam_search,
    greedy_search,
    length_penalty,
    max_lengths,
)

BOS, EOS, PAD = 0, 1, 2


@dataclass
class TableState:
    """Mock decoder state: a per-row context id and source length, plus the step count."""

    ctx: torch.Tensor  # (B,)
    src_len: torch.Tensor  # (B,)
    step: int

    def select(self, index: torch.Tensor) -> TableState:
        return TableState(self.ctx[index], self.src_len[index], self.step)


class TableModel:
    """Next-token logits from a fixed random table indexed by (context, step, previous token).

    The context is ``src[:, 0] % n_ctx``, so sentences of one batch decode differently. The
    cross-attention at each step is one-hot at source position ``prev % src_len``, which lets
    tests check that attention histories follow their beams. Every ``prev`` is recorded.
    """

    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def __init__(self, seed: int, vocab: int = 7, n_ctx: int = 3, steps: int = 8, eos_bias: float = 0.0):
        gen = torch.Generator().manual_seed(seed)
        self.table = 2.0 * torch.randn(n_ctx, steps, vocab, vocab, generator=gen)  # (ctx, step, prev, next)
        self.table[..., EOS] += eos_bias
        self.table[..., BOS] = float("-inf")  # bos and pad are never emitted
        self.table[..., PAD] = float("-inf")
        self.prevs: list[torch.Tensor] = []

    def init_decoder(self, src: torch.Tensor) -> TableState:
        return TableState(src[:, 0] % self.table.size(0), (src != PAD).sum(dim=1), 0)

    def decode_step(
        self, prev: torch.Tensor, state: TableState, need_weights: bool = False
    ) -> tuple[torch.Tensor, TableState, torch.Tensor | None]:
        self.prevs.append(prev.clone())
        step = min(state.step, self.table.size(1) - 1)
        logits = self.table[state.ctx, step, prev]  # (B, V)
        weights = F.one_hot(prev % state.src_len, 10).float() if need_weights else None  # (B, S=10)
        return logits, TableState(state.ctx, state.src_len, state.step + 1), weights


@dataclass
class PrefixState:
    prefixes: list[tuple[int, ...]]

    def select(self, index: torch.Tensor) -> PrefixState:
        return PrefixState([self.prefixes[i] for i in index.tolist()])


class PrefixModel:
    """Next-token probabilities looked up by the emitted prefix; unknown prefixes emit eos.

    Tokens missing from a distribution get probability 0 (logit -inf).
    """

    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], vocab: int = 8):
        self.table, self.vocab = table, vocab

    def init_decoder(self, src: torch.Tensor) -> PrefixState:
        return PrefixState([()] * src.size(0))

    def decode_step(
        self, prev: torch.Tensor, state: PrefixState, need_weights: bool = False
    ) -> tuple[torch.Tensor, PrefixState, torch.Tensor | None]:
        prefixes = [p if t == BOS else (*p, t) for p, t in zip(state.prefixes, prev.tolist(), strict=True)]
        logits = torch.full((len(prefixes), self.vocab), float("-inf"))  # (B, V)
        for row, prefix in enumerate(prefixes):
            for token, prob in self.table.get(prefix, {EOS: 1.0}).items():
                logits[row, token] = math.log(prob)
        return logits, PrefixState(prefixes), None


def make_src(lengths: list[int], width: int = 10, seed: int = 0) -> torch.Tensor:
    """Right-padded (B, width) sources of the given real lengths, first tokens distinct mod 3."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for row, length in enumerate(lengths):
        src[row, :length] = torch.randint(3, 20, (length,), generator=gen)
        src[row, 0] = 3 + row
    return src


def replay(model: StepDecoder, src: torch.Tensor, hyp: Hypothesis) -> float:
    """Score ``hyp`` by feeding its tokens (and eos) to the model one sentence at a time."""
    state = model.init_decoder(src.unsqueeze(0))
    prev, total = BOS, torch.zeros(1)
    for token in hyp.tokens + ([EOS] if hyp.ended_with_eos else []):
        logits, state, _ = model.decode_step(torch.tensor([prev]), state)
        total = total + F.log_softmax(logits.float(), dim=-1)[:, token]
        prev = token
    return total.item()


def test_length_penalty_is_gnmt_formula() -> None:
    assert length_penalty(7, 0.0) == 1.0
    assert length_penalty(1, 1.0) == 1.0
    assert length_penalty(3, 0.6) == pytest.approx((8 / 6) ** 0.6)


def test_max_lengths_count_real_source_tokens() -> None:
    src = torch.tensor([[5, 6, 7, PAD], [5, PAD, PAD, PAD]])
    assert max_lengths(src, PAD).tolist() == [53, 51]
    assert max_lengths(src, PAD, 1.5, 0.6).tolist() == [5, 2]  # floor(5.1), floor(2.1)
    assert max_lengths(src, PAD, 0.0, 0.0).tolist() == [1, 1]  # at least one step


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lenpen", [0.0, 0.6])
def test_beam_size_one_equals_greedy(seed: int, lenpen: float) -> None:
    model, src = TableModel(seed), make_src([7, 3, 5, 1], seed=seed)
    greedy = greedy_search(model, src, max_len_a=0.5, max_len_b=2)
    beams = beam_search(model, src, beam_size=1, lenpen=lenpen, max_len_a=0.5, max_len_b=2)
    assert {h.ended_with_eos for h in greedy} == {True, False}  # both endings are exercised
    for g, (b,) in zip(greedy, beams, strict=True):
        assert (b.tokens, b.score, b.ended_with_eos) == (g.tokens, g.score, g.ended_with_eos)
        assert g.norm_score == g.score


def test_beam_finds_higher_probability_than_greedy() -> None:
    # greedy: 3 (0.6) then 5 (0.55) then eos -> 0.33; beam: 4 (0.4) then eos (0.9) -> 0.36
    table = {(): {3: 0.6, 4: 0.4}, (3,): {5: 0.55, 6: 0.45}, (4,): {EOS: 0.9, 7: 0.1}}
    model, src = PrefixModel(table), make_src([4])
    (greedy,) = greedy_search(model, src)
    (best, second), = beam_search(model, src, beam_size=2, lenpen=0.0, n_best=2)
    assert greedy.tokens == [3, 5] and greedy.score == pytest.approx(math.log(0.33), abs=1e-6)
    assert best.tokens == [4] and best.score == pytest.approx(math.log(0.36), abs=1e-6)
    assert second.tokens == [3, 5] and second.score == pytest.approx(greedy.score, abs=1e-6)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_hypotheses_stop_at_eos_and_finished_rows_are_not_extended(search: str) -> None:
    model, src = TableModel(3, eos_bias=1.0), make_src([6, 2, 4, 3])
    if search == "greedy":
        hyps = [(row, h) for row, h in enumerate(greedy_search(model, src))]
        steps = [len(h.tokens) + 1 for _, h in hyps]
        assert all(h.ended_with_eos for _, h in hyps) and len(set(steps)) > 1
        # row count at step t == sentences still decoding at t: finished rows were dropped
        assert [len(p) for p in model.prevs] == [sum(s > t for s in steps) for t in range(max(steps))]
    else:
        results = beam_search(model, src, beam_size=3, n_best=3)
        hyps = [(row, h) for row, nbest in enumerate(results) for h in nbest]
        sizes = [len(p) for p in model.prevs]
        assert sizes[0] == 4 * 3 and sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]
        assert all(size % 3 == 0 for size in sizes)
    assert all(EOS not in p.tolist() for p in model.prevs)  # eos is never fed back
    for row, hyp in hyps:
        assert EOS not in hyp.tokens
        # the score covers exactly the tokens and one eos: nothing was emitted after it
        assert hyp.score == pytest.approx(replay(TableModel(3, eos_bias=1.0), src[row], hyp), abs=1e-5)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_max_length_cut_without_eos(beam_size: int) -> None:
    model, src = TableModel(4, eos_bias=float("-inf")), make_src([5, 2])
    limits = max_lengths(src, PAD, 0.5, 1).tolist()  # [3, 2]
    for row, nbest in enumerate(beam_search(model, src, beam_size=beam_size, n_best=beam_size,
                                            max_len_a=0.5, max_len_b=1)):
        assert len(nbest) == beam_size
        for hyp in nbest:
            assert not hyp.ended_with_eos and len(hyp.tokens) == limits[row]
            assert hyp.score == pytest.approx(replay(model, src[row], hyp), abs=1e-5)
            assert hyp.norm_score == pytest.approx(hyp.score / length_penalty(limits[row], 0.6))
    for row, hyp in enumerate(greedy_search(model, src, max_len_a=0.5, max_len_b=1)):
        assert not hyp.ended_with_eos and len(hyp.tokens) == limits[row]


def test_at_max_length_cut_beams_and_eos_endings_compete_by_score() -> None:
    # step 0: eos ends [] (0.5), beams [3], [4]; step 1 is the last (max length 2) and one slot is
    # left: [3, 5] (cut, 0.27) beats [4] eos (0.2), both of length 2
    table = {(): {EOS: 0.5, 3: 0.3, 4: 0.2}, (3,): {5: 0.9, EOS: 0.1}, (4,): {EOS: 1.0}}
    (first, second), = beam_search(PrefixModel(table), make_src([2]), beam_size=2, n_best=2, lenpen=0.0,
                                   max_len_a=0, max_len_b=2)
    assert (first.tokens, first.ended_with_eos) == ([], True)
    assert (second.tokens, second.ended_with_eos) == ([3, 5], False)
    assert second.score == pytest.approx(math.log(0.27), abs=1e-6)


def test_length_penalty_changes_the_ranking() -> None:
    # short: [3] eos, p = 0.51 (length 2); long: [4, 5, 6] eos, p = 0.49 (length 4)
    table = {(): {3: 0.51, 4: 0.49}, (4,): {5: 1.0}, (4, 5): {6: 1.0}}
    model, src = PrefixModel(table), make_src([3])
    for alpha, winner in [(0.0, [3]), (0.6, [4, 5, 6])]:
        short = math.log(0.51) / ((5 + 2) / 6) ** alpha
        long = math.log(0.49) / ((5 + 4) / 6) ** alpha
        (first, second), = beam_search(model, src, beam_size=2, lenpen=alpha, n_best=2)
        assert first.tokens == winner
        expected = sorted([(short, [3]), (long, [4, 5, 6])], reverse=True)
        assert [first.norm_score, second.norm_score] == pytest.approx([e[0] for e in expected], abs=1e-6)
        assert [first.tokens, second.tokens] == [e[1] for e in expected]


@pytest.mark.parametrize("n_best", [1, 3, 5])
def test_n_best_sorted_distinct(n_best: int) -> None:
    model, src = TableModel(5, eos_bias=0.5), make_src([6, 4, 2])
    for nbest in beam_search(model, src, beam_size=5, n_best=n_best):
        assert len(nbest) == n_best
        norms = [h.norm_score for h in nbest]
        assert norms == sorted(norms, reverse=True)
        assert len({(tuple(h.tokens), h.ended_with_eos) for h in nbest}) == n_best
    with pytest.raises(ValueError, match="n_best"):
        beam_search(model, src, beam_size=2, n_best=3)


def test_wide_beam_is_exhaustive() -> None:
    # tokens {3, 4}, max length 3: 1 + 2 + 4 hypotheses end with eos, 8 are cut at length 3
    model, src = TableModel(6, vocab=5), make_src([1])
    (hyps,) = beam_search(model, src, beam_size=16, n_best=15, lenpen=0.6, max_len_a=0, max_len_b=3)
    expected = {((), True)}
    for length in (1, 2, 3):
        for n in range(2**length):
            path = tuple(3 + (n >> i & 1) for i in range(length))
            expected |= {(path, length < 3), (path, False)} if length == 3 else {(path, True)}
    assert {(tuple(h.tokens), h.ended_with_eos) for h in hyps} == expected
    for hyp in hyps:
        assert hyp.score == pytest.approx(replay(model, src[0], hyp), abs=1e-5)
    assert [h.norm_score for h in hyps] == sorted((h.norm_score for h in hyps), reverse=True)


@pytest.mark.parametrize("seed", range(3))
def test_batched_equals_one_at_a_time(seed: int) -> None:
    model, src = TableModel(seed, eos_bias=-0.5), make_src([8, 2, 5, 1], seed=seed)
    kwargs = {"max_len_a": 0.5, "max_len_b": 2, "need_weights": True}
    greedy = greedy_search(model, src, **kwargs)
    beams = beam_search(model, src, beam_size=3, n_best=3, **kwargs)
    for row in range(src.size(0)):
        (single,) = greedy_search(model, src[row : row + 1], **kwargs)
        assert _same(single, greedy[row])
        (single_beam,) = beam_search(model, src[row : row + 1], beam_size=3, n_best=3, **kwargs)
        assert all(_same(a, b) for a, b in zip(single_beam, beams[row], strict=True))


def _same(a: Hypothesis, b: Hypothesis) -> bool:
    same_attention = a.attention is None and b.attention is None or torch.equal(a.attention, b.attention)
    return (a.tokens, a.score, a.norm_score, a.ended_with_eos) == (b.tokens, b.score, b.norm_score,
                                                                  b.ended_with_eos) and same_attention


@pytest.mark.parametrize("beam_size", [None, 1, 3])
def test_attention_shape_and_history(beam_size: int | None) -> None:
    model, src = TableModel(7, eos_bias=0.5), make_src([6, 3, 9])
    if beam_size is None:
        hyps = greedy_search(model, src, need_weights=True)
    else:
        hyps = [nbest[0] for nbest in beam_search(model, src, beam_size=beam_size, need_weights=True)]
    for row, hyp in enumerate(hyps):
        src_len = int((src[row] != PAD).sum())
        assert hyp.attention is not None
        assert hyp.attention.shape == (len(hyp.tokens) + int(hyp.ended_with_eos), src_len)
        # the mock attends to position prev % src_len: each row must belong to this beam's path
        prevs = torch.tensor([BOS] + hyp.tokens)[: hyp.attention.size(0)]
        assert hyp.attention.argmax(dim=1).tolist() == (prevs % src_len).tolist()
    assert all(h.attention is None for h in greedy_search(model, src))
