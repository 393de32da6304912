"""Tests for `GET /metrics` (attnkit.serve.metrics) and the worker's length-aware batching with a token budget
(attnkit.serve.batching): the app in process (Starlette's TestClient runs its lifespan, so its workers) with the
tiny translation run; the worker on its own with made-up lengths; served outputs still equal offline ones."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from attnkit.cli import main
from attnkit.inference.translate import translate_texts
from attnkit.serve.app import create_app
from attnkit.serve.batching import BatchRecord, Limits, ModelWorker
from attnkit.serve.servables import RunServable
from attnkit.tasks import load_run

with warnings.catch_warnings():  # Starlette >= 1 asks for httpx2 under its TestClient; httpx still works
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
    from fastapi.testclient import TestClient

TEXTS = ["3. März 2021", "May 1, 1999", "12.10.1999", "Sonntag, 3. März 2024", "1999-05-01", "2021年3月3日",
         "Montag, 12. Oktober 1999", "1. 1. 2000"]


@pytest.fixture(scope="module")
def dates(translation_run: Path) -> RunServable:
    return RunServable(load_run(translation_run), "dates")


@pytest.fixture(scope="module")
def continuous_dates(dates: RunServable) -> RunServable:
    """The same run with greedy translations batched continuously (``attnkit serve --batching continuous``)."""
    return RunServable(dates.run, "dates", continuous=True)


def offline(servable: RunServable, texts: list[str]) -> list[str]:
    """What `attnkit translate --beam 1` gives for each text, one at a time."""
    run = servable.run
    return [translate_texts(run.model, run.tok, [t], beam=1, lenpen=run.cfg.decode_lenpen)[0][0] for t in texts]


def scrape(client: TestClient, **headers: str) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` parsed by prometheus_client's own parser: (sample name, labels) -> value."""
    r = client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


# -- GET /metrics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batching", ["whole", "continuous"])
def test_metrics_count_requests_batches_and_stages(dates, continuous_dates, batching):
    n = len(TEXTS)
    servable = continuous_dates if batching == "continuous" else dates
    app = create_app([servable], Limits(max_wait_ms=0))
    with TestClient(app) as client:
        served = []
        for text in TEXTS:  # one after the other: one batch each
            r = client.post("/translate", json={"texts": [text], "beam": 1})
            assert r.status_code == 200, r.text
            served.append(r.json()["translations"][0])
        assert client.post("/translate", json={"texts": ["x"], "beam": 0}).status_code == 422
        assert client.get("/nowhere/at/all").status_code == 404
        health = client.get("/health").json()["models"]["dates"]
        samples = scrape(client)

    assert served == offline(dates, TEXTS)
    assert value(samples, "attnkit_serve_requests_total", route="/translate", status="200") == n
    assert value(samples, "attnkit_serve_requests_total", route="/translate", status="422") == 1
    assert value(samples, "attnkit_serve_requests_total", route="other", status="404") == 1  # no label per path
    assert value(samples, "attnkit_serve_requests_total", route="/health", status="200") == 1
    assert value(samples, "attnkit_serve_request_seconds_count", route="/translate") == n + 1
    # one observation per batch the worker ran (continuous: per decoding step); the texts add up
    assert health["texts"] == n
    assert value(samples, "attnkit_serve_batch_texts_count", model="dates") == health["batches"]
    assert value(samples, "attnkit_serve_batch_texts_sum", model="dates") == health["batch_texts"]
    if batching == "whole":
        assert health["batches"] == n and health["batch_texts"] == n
        # a batch of one text is as many tokens as that text (the 422 never reached the worker)
        assert value(samples, "attnkit_serve_batch_tokens_sum", model="dates") == sum(dates.lengths(TEXTS))
    else:  # one text at a time: each step decodes one row as wide as its source with </s>
        assert health["batches"] > n and health["batch_texts"] == health["batches"]
        tokens = value(samples, "attnkit_serve_batch_tokens_sum", model="dates")
        assert min(dates.lengths(TEXTS)) * health["batches"] < tokens <= (max(dates.lengths(TEXTS)) + 1) * \
            health["batches"]
    assert value(samples, "attnkit_serve_queue_wait_seconds_count", model="dates") == n
    for stage in ("parse", "queue", "compute", "serialise"):
        assert value(samples, "attnkit_serve_stage_seconds_count", model="dates", stage=stage) == n, stage
        assert value(samples, "attnkit_serve_stage_seconds_sum", model="dates", stage=stage) >= 0
    compute = value(samples, "attnkit_serve_stage_seconds_sum", model="dates", stage="compute")
    latency = value(samples, "attnkit_serve_request_seconds_sum", route="/translate")
    assert 0 < compute < latency  # the model's time is part of the requests' time
    assert value(samples, "attnkit_serve_queued_texts", model="dates") == 0


def test_concurrent_greedy_requests_share_the_running_batch(continuous_dates):
    """Continuous batching in the app: requests sent at once join one running decoding batch, each answered with
    what it gets alone; a beam request among them runs in a whole batch of its own."""
    texts = TEXTS * 3
    with TestClient(create_app([continuous_dates], Limits(max_wait_ms=5))) as client:
        def one(text: str, beam: int = 1) -> str:
            r = client.post("/translate", json={"texts": [text], "beam": beam})
            assert r.status_code == 200, r.text
            return r.json()["translations"][0]

        with ThreadPoolExecutor(len(texts) + 1) as pool:
            beam = pool.submit(one, TEXTS[0], 2)
            served = list(pool.map(one, texts))
        health = client.get("/health").json()["models"]["dates"]
    assert served == offline(continuous_dates, texts)
    run = continuous_dates.run
    assert beam.result() == translate_texts(run.model, run.tok, [TEXTS[0]], beam=2, lenpen=run.cfg.decode_lenpen)[0][0]
    assert health["texts"] == len(texts) + 1
    assert health["batch_texts"] > health["batches"]  # decoding steps ran several requests' texts at once


def test_metrics_needs_the_api_key_when_one_is_set(dates):
    with TestClient(create_app([dates], api_key="s3cret")) as client:
        r = client.get("/metrics")
        assert r.status_code == 401 and "API key missing" in r.json()["error"]
        samples = scrape(client, Authorization="Bearer s3cret")
    assert value(samples, "attnkit_serve_requests_total", route="/metrics", status="401") == 1
    with TestClient(create_app([dates])) as client:  # no key: open, like /health
        assert client.get("/metrics").status_code == 200


def test_each_app_has_its_own_registry(dates):
    with TestClient(create_app([dates])) as one, TestClient(create_app([dates])) as other:
        one.get("/health")
        assert value(scrape(one), "attnkit_serve_requests_total", route="/health", status="200") == 1
        assert value(scrape(other), "attnkit_serve_requests_total", route="/health", status="200") == 0


# -- length-aware batching within a token budget ---------------------------------------------------


def held_worker(limits: Limits):
    """A worker whose first batch waits for ``gate``, so that everything submitted meanwhile is queued together;
    ``started`` is set once the worker runs a batch, ``calls`` records each batch's texts, ``records`` each
    BatchRecord."""
    gate, started, calls, records = threading.Event(), threading.Event(), [], []

    def run(texts: list[str]) -> list[str]:
        started.set()
        gate.wait(10)
        calls.append(texts)
        return [t.upper() for t in texts]

    worker = ModelWorker("test", limits, records.append)
    return worker, run, gate, started, calls, records


async def taken(started: threading.Event) -> None:
    """Until the worker has taken the held job and waits at the gate (however busy the machine)."""
    assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)


def test_short_requests_are_not_batched_with_a_long_one_past_the_budget():
    async def scenario(first_is_long: bool) -> list[list[str]]:
        worker, run, gate, started, calls, records = held_worker(Limits(max_batch=8, max_batch_tokens=100,
                                                                        max_wait_ms=0))
        held = worker.submit(("k",), run, ["held"], [1])
        await taken(started)
        jobs = [(["long"], [60]), (["s1"], [5]), (["s2", "s3"], [6, 4]), (["s4"], [5])]
        if not first_is_long:
            jobs = jobs[1:2] + jobs[:1] + jobs[2:]
        futures = [worker.submit(("k",), run, texts, lengths) for texts, lengths in jobs]
        gate.set()
        results = await asyncio.gather(held, *futures)
        worker.close(timeout=10)
        assert results[1:] == [[t.upper() for t in texts] for texts, _ in jobs]
        assert all(r.tokens <= 100 for r in records)
        return calls[1:]

    # the short ones run together, the long one alone, whichever came first (5 x 60 tokens > 100)
    assert asyncio.run(scenario(first_is_long=True)) == [["long"], ["s1", "s2", "s3", "s4"]]
    assert asyncio.run(scenario(first_is_long=False)) == [["s1", "s2", "s3", "s4"], ["long"]]


def test_batches_stay_within_the_budget_and_group_similar_lengths():
    budget, rng = 120, random.Random(0)
    lengths = [rng.choice([2, 3, 4, 5, 30, 35, 40, 150]) for _ in range(60)]

    async def scenario() -> tuple[list[list[str]], list[BatchRecord]]:
        worker, run, gate, started, calls, records = held_worker(Limits(max_batch=16, max_batch_tokens=budget,
                                                                        max_wait_ms=0))
        held = worker.submit(("k",), run, ["held"], [1])
        await taken(started)
        futures = [worker.submit(("k",), run, [f"t{i}"], [n]) for i, n in enumerate(lengths)]
        gate.set()
        results = await asyncio.gather(held, *futures)
        worker.close(timeout=10)
        assert results[1:] == [[f"T{i}"] for i in range(len(lengths))]
        return calls[1:], records[1:]

    calls, records = asyncio.run(scenario())
    assert sorted(t for batch in calls for t in batch) == sorted(f"t{i}" for i in range(len(lengths)))
    for batch, record in zip(calls, records, strict=True):
        longest = max(lengths[int(t[1:])] for t in batch)
        assert record.texts == len(batch) <= 16 and record.tokens == len(batch) * longest  # padded: size x longest
        assert record.tokens <= budget or len(batch) == 1  # only a text over the budget on its own exceeds it
        if longest == 150:
            assert len(batch) == 1
    assert len(records) == len(calls) < len(lengths) / 2  # batches are filled: far fewer than one per text
    # grouping by length pads less than taking the queue in order under the same limits
    fifo, queue = 0, list(lengths)
    while queue:
        batch = [queue.pop(0)]
        for n in list(queue):
            if len(batch) < 16 and (len(batch) + 1) * max(batch + [n]) <= budget:
                batch.append(n)
                queue.remove(n)
        fifo += len(batch) * max(batch)
    assert sum(r.tokens for r in records) < fifo


def test_length_grouped_batches_give_the_offline_translations(dates):
    texts = TEXTS * 3
    lengths = dates.lengths(texts)
    assert lengths == [len(ids) for ids in dates.run.tok.encode_src(texts)]
    budget = 2 * max(lengths)  # several batches, mixed lengths split

    async def scenario() -> tuple[list[list[str]], list[BatchRecord]]:
        records: list[BatchRecord] = []
        worker = ModelWorker("dates", Limits(max_batch=8, max_batch_tokens=budget, max_wait_ms=50), records.append)
        run = lambda batch: dates.translate(batch, beam=1, n_best=1, lenpen=dates.info.lenpen)  # noqa: E731
        futures = [worker.submit(("translate",), run, [t], dates.lengths([t])) for t in texts]
        results = await asyncio.gather(*futures)
        worker.close(timeout=60)
        return results, records

    results, records = asyncio.run(scenario())
    assert [r[0][0] for r in results] == offline(dates, texts)
    assert sum(r.texts for r in records) == len(texts) and len(records) < len(texts)
    assert all(r.tokens <= budget for r in records)


# -- the command line ------------------------------------------------------------------------------


def test_help_names_the_metrics_route_and_the_token_budget(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "GET /metrics" in out and "Prometheus" in out
    assert "--max-batch-tokens N" in out and f"(default: {Limits().max_batch_tokens})" in out
    assert "/classify, /generate, /metrics and /v1/" in out  # the API key covers them


def test_max_batch_tokens_must_be_positive(translation_run, capsys):
    assert main(["serve", str(translation_run), "--max-batch-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-batch-tokens" in err


def test_a_lone_request_does_not_wait_but_concurrent_ones_still_merge():
    """One client alone gains nothing from waiting (issue 27: it waited max_wait_ms in the queue every time);
    once a batch answered several requests, the next ones wait for their peers as before."""
    records: list = []

    async def scenario() -> list[list[str]]:
        calls: list[list[str]] = []

        def run(texts: list[str]) -> list[str]:
            calls.append(texts)
            return texts

        worker = ModelWorker("lone", Limits(max_batch=8, max_wait_ms=2000), records.append)
        for text in ("a", "b", "c"):  # one client, one request at a time: each runs at once
            assert await asyncio.wait_for(worker.submit(("k",), run, [text]), timeout=1.5) == [text]
        # two clients at once (queued under the worker's lock, so it cannot take the first alone in between):
        # the second joins the first's batch ...
        with worker._cond:
            first = worker.submit(("k",), run, ["d"])
            second = worker.submit(("k",), run, ["e"])
        await asyncio.gather(first, second)
        # ... and after a batch of two, a request waits for its peer to come back
        third = worker.submit(("k",), run, ["f"])
        await asyncio.sleep(0.3)
        fourth = worker.submit(("k",), run, ["g"])
        await asyncio.gather(third, fourth)
        worker.close(timeout=10)
        return calls

    calls = asyncio.run(scenario())
    assert calls == [["a"], ["b"], ["c"], ["d", "e"], ["f", "g"]]
    assert all(max(r.waits) < 1.0 for r in records[:3])  # the lone requests: far below max_wait_ms (2 s)


def test_the_worker_gives_freed_memory_back_when_idle_and_while_busy(monkeypatch):
    """After work, a pause of TRIM_EVERY_S returns freed heap pages (malloc_trim); under steady load at most
    every TRIM_EVERY_S. So the RSS follows what the server holds, not its largest request (issue 27, item 7)."""
    from attnkit.common.memory import release_free_memory
    from attnkit.serve import batching

    assert release_free_memory() in (True, False)  # callable anywhere; True with glibc
    calls: list[float] = []
    monkeypatch.setattr(batching, "release_free_memory", lambda: calls.append(time.monotonic()))
    monkeypatch.setattr(batching, "TRIM_EVERY_S", 0.2)

    async def scenario() -> None:
        worker = ModelWorker("trim", Limits(max_wait_ms=0))
        await asyncio.sleep(0.5)
        assert calls == []  # nothing ran: nothing to give back
        await worker.submit(("k",), lambda texts: texts, ["a"])
        await asyncio.sleep(0.6)
        assert len(calls) == 1  # once after the pause, not again while idle
        for _ in range(30):  # busy for about 0.6 s without a pause of 0.2 s
            await worker.submit(("k",), lambda texts: time.sleep(0.02) or texts, ["b"])
        worker.close(timeout=10)
        assert 2 <= len(calls) <= 6

    asyncio.run(scenario())


def test_freeze_long_lived_keeps_full_collections_off_what_exists():
    """After freeze_long_lived, what existed is out of the collector's sight (a full collection no longer visits it)
    and garbage made later is still collected. In a process of its own: frozen objects are never freed."""
    import subprocess
    import sys

    script = """
import gc
from attnkit.common.memory import freeze_long_lived
keep = [[i] for i in range(50_000)]  # long-lived containers, as a server's models and app
frozen = freeze_long_lived()
assert frozen >= 50_000, frozen
class Cycle:
    pass
a, b = Cycle(), Cycle()
a.other, b.other = b, a  # garbage only the collector can free
del a, b
assert gc.collect() >= 2  # later garbage is still collected
assert gc.get_freeze_count() == frozen  # the frozen objects stayed out of the collection
assert len(gc.get_objects()) < 50_000  # the collector's generations no longer hold the long-lived ones
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_idle_worker_holds_no_answer():
    """Once a batch is answered and the caller has let go of its answer, nothing in the worker keeps it alive while
    it waits for more work: otherwise the idle trim could not give an attention answer's megabytes back."""
    import gc
    import weakref

    class Answer:
        pass

    made: list[weakref.ref] = []

    def run(texts: list[str]) -> list[Answer]:
        answers = [Answer() for _ in texts]
        made.extend(weakref.ref(a) for a in answers)
        return answers

    async def scenario() -> None:
        worker = ModelWorker("hold", Limits(max_wait_ms=0))
        assert len(await worker.submit(("k",), run, ["a", "b"])) == 2
        for _ in range(100):  # the worker reaches its wait a moment after answering
            gc.collect()
            if all(ref() is None for ref in made):
                break
            await asyncio.sleep(0.02)
        alive = sum(ref() is not None for ref in made)
        worker.close(timeout=10)
        assert alive == 0

    asyncio.run(scenario())


def test_release_soon_trims_after_a_pause_and_attention_answers_ask_for_it(monkeypatch, dates):
    """``release_soon`` (memory freed after the worker's work, as a large answer once sent) gives memory back after
    an idle TRIM_EVERY_S; an answer with attention asks for it once its last byte is sent."""
    import subprocess
    import sys

    from attnkit.serve import batching

    # in a process of its own: it changes how this one allocates
    shared = subprocess.run([sys.executable, "-c", "from attnkit.common.memory import share_one_heap; "
                             "print(share_one_heap())"], capture_output=True, text=True, check=True).stdout.strip()
    assert shared in ("True", "False")  # True with glibc; a no-op elsewhere
    calls: list[float] = []
    monkeypatch.setattr(batching, "release_free_memory", lambda: calls.append(time.monotonic()))
    monkeypatch.setattr(batching, "TRIM_EVERY_S", 0.2)
    worker = ModelWorker("soon", Limits())
    try:
        time.sleep(0.4)
        assert calls == []  # nothing ran, nothing asked
        asked_at = time.monotonic()
        worker.release_soon()
        for _ in range(150):
            if calls:
                break
            time.sleep(0.02)
        assert len(calls) == 1 and calls[0] - asked_at >= 0.2  # once, after the pause
    finally:
        worker.close(timeout=10)

    asked: list[str] = []
    monkeypatch.setattr(batching.ModelWorker, "release_soon", lambda self: asked.append("asked"))
    with TestClient(create_app([dates])) as client:
        assert client.post("/translate", json={"texts": TEXTS[:1]}).status_code == 200
        assert asked == []  # a small answer: the trim after its batch is enough
        response = client.post("/translate", json={"texts": TEXTS[:2], "attention": True})
        assert response.status_code == 200 and len(response.json()["attention"]) == 2
        assert asked == ["asked"]
