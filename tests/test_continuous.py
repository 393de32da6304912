"""Continuous (iteration-level) greedy decoding: sentences that join and leave a running batch decode exactly as
greedy search decodes each alone; and the serving worker that drives it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from attnkit import Transformer, preset
from attnkit.common.errors import UserError
from attnkit.engine import to_eager
from attnkit.engine.continuous import ContinuousGreedy, supports_continuous
from attnkit.search import greedy_search
from attnkit.serve.batching import Limits, ModelWorker
from attnkit.vocab import EOS_ID

VOCAB = 40


def model(norm_first: bool, positions: str = "sinusoidal", fast: bool = False, eos_bias: float = 2.0,
          max_len: int = 64) -> Transformer:
    """A random tiny Transformer whose ``</s>`` logit is raised, so sentences end after a few tokens, at
    different steps (a model that never ends would only test the length budget)."""
    torch.manual_seed(11)
    m = Transformer(preset("tiny", dropout=0.0, norm_first=norm_first, positions=positions, max_len=max_len),
                    VOCAB, VOCAB)
    bias = torch.zeros(VOCAB)
    bias[EOS_ID] = eos_bias
    m.out_proj.register_forward_hook(lambda _module, _inputs, logits: logits + bias)
    return (to_eager(m) if fast else m).eval()


def sources(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=g).tolist() + [EOS_ID] for length in lengths]


def alone(m: Transformer, src: list[int], **budget: float) -> tuple[list[int], float]:
    with torch.inference_mode():
        (h,) = greedy_search(m, torch.tensor([src]), **budget)
    return h.tokens, h.score


def run_staggered(decoder: ContinuousGreedy, srcs: list[list[int]], join_every: int = 2, group: int = 3
                  ) -> dict[int, tuple[list[int], float]]:
    """Add ``group`` sources every ``join_every`` steps until all have joined, then step until all ended; returns
    source index -> (tokens, score)."""
    out: dict[int, tuple[list[int], float]] = {}
    index: dict[int, int] = {}
    pending, step = list(range(len(srcs))), 0
    while pending or decoder.running:
        if pending and step % join_every == 0:
            joining, pending = pending[:group], pending[group:]
            handles, ended = decoder.add([srcs[i] for i in joining])
            index.update(zip(handles, joining, strict=True))
            out.update({index[f.handle]: (f.tokens, f.score) for f in ended})
        out.update({index[f.handle]: (f.tokens, f.score) for f in decoder.step()})
        step += 1
        assert step < 500
    return out


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_rows_that_join_and_leave_decode_as_greedy_search_alone(norm_first: bool, fast: bool) -> None:
    m = model(norm_first, fast=fast)
    srcs = sources(14)
    got = run_staggered(ContinuousGreedy(m), srcs)
    assert sorted(got) == list(range(len(srcs)))
    lengths = set()
    for i, src in enumerate(srcs):
        tokens, score = alone(m, src)
        assert got[i][0] == tokens, f"source {i}"
        assert got[i][1] == pytest.approx(score, abs=1e-4)
        lengths.add(len(tokens))
    assert len(lengths) > 2  # the sentences ended at different steps: rows really left a running batch


def test_learned_positions_and_a_short_budget() -> None:
    """Each row reads its own position (learned table), and a row stops at its own budget floor(a * S + b)."""
    m = model(True, positions="learned", eos_bias=-5.0)  # </s> rarely wins: most rows run to the budget
    srcs = sources(9, seed=6)
    got = run_staggered(ContinuousGreedy(m, max_len_a=0.5, max_len_b=1.0), srcs, join_every=1, group=2)
    for i, src in enumerate(srcs):
        tokens, _ = alone(m, src, max_len_a=0.5, max_len_b=1.0)
        assert got[i][0] == tokens
        assert len(tokens) <= int(0.5 * len(src) + 1.0)


def test_budget_is_cut_at_the_models_positions() -> None:
    m = model(False, eos_bias=-50.0, max_len=32)  # never ends: every row runs to its budget
    decoder = ContinuousGreedy(m, max_len_a=4.0, max_len_b=10.0)  # 4 x 12 + 10 > max_len 32
    (handle,), ended = decoder.add([sources(1)[0][:11] + [EOS_ID]])
    assert not ended
    while not (done := decoder.step()):
        pass
    assert done[0].handle == handle and len(done[0].tokens) == 32


def test_padding_columns_are_dropped_as_rows_leave() -> None:
    m = model(False, eos_bias=-50.0)
    decoder = ContinuousGreedy(m, max_len_a=0.0, max_len_b=3.0)  # every row emits 3 tokens
    decoder.add([[5] * 12 + [EOS_ID]])
    decoder.step()
    decoder.add([[6, 7, EOS_ID]])  # joins two steps later, with a shorter source
    assert decoder.width == 13 and decoder.valid.shape == (2, 2)
    assert decoder.valid.tolist() == [[True, True], [False, True]]  # the late row's first key column is padding
    ended = decoder.step()  # the first row emits its third token and leaves
    assert len(ended) == 1 and decoder.running == 1
    assert decoder.width == 3  # the long source's columns went with it
    assert decoder.valid.tolist() == [[True, True]]  # and so did the column only it used
    assert decoder.caches[0].k.size(2) == 2 and decoder.cross[0].k.size(2) == 3
    assert len(decoder.step()) == 1 and decoder.running == 0 and decoder.width == 0


def test_only_transformers_decode_continuously() -> None:
    assert supports_continuous(model(False)) and not supports_continuous(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="Transformer"):
        ContinuousGreedy(torch.nn.Linear(2, 2))


# -- the worker driving a stepper ----------------------------------------------------------------------


class CountingStepper:
    """A stepper whose text ``"n"`` ends after n steps with the result ``"n!"``; records every step's rows."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.left: dict[int, int] = {}
        self.texts: dict[int, str] = {}
        self.steps: list[list[str]] = []
        self.handles = 0
        self.gate = gate
        self.fail_at: int | None = None

    @property
    def running(self) -> int:
        return len(self.left)

    @property
    def width(self) -> int:
        return 4 if self.left else 0

    def start(self, texts: list[str]) -> list[int]:
        if "bad" in texts:
            raise UserError("cannot start 'bad'")
        if "boom" in texts:
            raise RuntimeError("a bug while starting")
        handles = list(range(self.handles, self.handles + len(texts)))
        self.handles += len(texts)
        for h, t in zip(handles, texts, strict=True):
            self.left[h], self.texts[h] = int(t), t
        return handles

    def step(self) -> list[tuple[int, str]]:
        if self.gate is not None:
            self.gate.wait(10)
        self.steps.append(sorted(self.texts[h] for h in self.left))
        if self.fail_at == len(self.steps):
            raise RuntimeError("a bug")
        ended = []
        for h in list(self.left):
            self.left[h] -= 1
            if self.left[h] == 0:
                del self.left[h]
                ended.append((h, self.texts[h] + "!"))
        return ended

    def abandon(self) -> None:
        self.left.clear()


def test_worker_joins_jobs_between_steps_and_answers_each_as_it_ends() -> None:
    gate = threading.Event()
    stepper = CountingStepper(gate)
    whole_calls: list[list[str]] = []

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_batch=4, max_wait_ms=0))
        run = lambda texts: texts  # noqa: E731  (never called for stepped jobs)
        first = worker.submit(("greedy",), run, ["3"], stepper=stepper)
        await asyncio.sleep(0.2)  # the worker is inside the first step, held by the gate
        second = worker.submit(("greedy",), run, ["1", "2"], stepper=stepper)
        third = worker.submit(("greedy",), run, ["5", "1"], stepper=stepper)  # 5 texts would be too many
        beam = worker.submit(("beam",), lambda texts: whole_calls.append(texts) or [t + "?" for t in texts], ["b"])
        fourth = worker.submit(("greedy",), run, ["1"], stepper=stepper)  # behind the beam job: waits for it
        gate.set()
        results = await asyncio.gather(first, second, third, beam, fourth)
        worker.close(timeout=10)
        return results, worker.stats()

    results, stats = asyncio.run(scenario())
    assert results == [["3!"], ["1!", "2!"], ["5!", "1!"], ["b?"], ["1!"]]
    # the second job joined at the next step; the third when two texts had ended (at most 4 running)
    assert stepper.steps[:4] == [["3"], ["1", "2", "3"], ["1", "2", "3", "5"], ["5"]]
    assert whole_calls == [["b"]]
    assert stepper.steps[-2:] == [["5"], ["1"]]  # the job queued behind the beam job ran after it, alone
    assert stats["texts"] == 7 and stats["batches"] == len(stepper.steps) + 1  # + the beam batch
    assert stats["batch_texts"] == sum(len(s) for s in stepper.steps) + 1


def test_worker_answers_a_text_it_cannot_start_and_fails_the_jobs_in_flight_on_a_bug() -> None:
    stepper = CountingStepper()
    stepper.fail_at = 2

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_batch=8, max_wait_ms=50))
        run = lambda texts: texts  # noqa: E731
        jobs = [worker.submit(("g",), run, texts, stepper=stepper) for texts in (["1"], ["bad"], ["3"])]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        after = await worker.submit(("g",), run, ["2"], stepper=stepper)  # the worker goes on
        worker.close(timeout=10)
        return [*results, after]

    one, bad, three, after = asyncio.run(scenario())
    assert one == ["1!"]  # ended at the first step, before the bug
    assert isinstance(bad, UserError)
    assert isinstance(three, RuntimeError)  # in flight when the step failed
    assert after == ["2!"]


def test_a_bug_while_starting_fails_the_jobs_in_flight_and_the_worker_goes_on() -> None:
    gate = threading.Event()
    stepper = CountingStepper(gate)

    async def scenario() -> list:
        worker = ModelWorker("test", Limits(max_batch=8, max_wait_ms=0))
        run = lambda texts: texts  # noqa: E731
        first = worker.submit(("g",), run, ["3"], stepper=stepper)
        await asyncio.sleep(0.2)  # in its first step, held by the gate
        boom = worker.submit(("g",), run, ["boom"], stepper=stepper)
        gate.set()
        results = await asyncio.gather(first, boom, return_exceptions=True)
        only_bad = await asyncio.gather(worker.submit(("g",), run, ["bad"], stepper=stepper), return_exceptions=True)
        after = await worker.submit(("g",), run, ["1"], stepper=stepper)
        worker.close(timeout=10)
        return [*results, *only_bad, after, worker.stats()]

    first, boom, bad, after, stats = asyncio.run(scenario())
    assert isinstance(first, RuntimeError) and isinstance(boom, RuntimeError)  # "3" was in flight
    assert isinstance(bad, UserError)
    assert after == ["1!"]
    assert stats["batch_texts"] == 2 and stats["batches"] == 2  # the steps of "3" and of "1"; none for "bad"
