"""Serving: `attnkit serve` under concurrent clients, against offline batched decoding, and under malformed requests.

    flock /tmp/attnkit-bench.lock python benchmarks/serve.py --run runs/multi30k-de-en

1. Offline: ``translate_texts`` on the test_2016_flickr German sentences (greedy), in this process
   with the server's thread count, before the server starts and again after the clients (beside the
   idle server): the throughput batching should reach, the mean of the two. Also offline in calls of as
   many consecutive sentences as each client level has (8, 32): the most a server can batch for them.
2. The real server (``python -m attnkit serve RUN --port 0``, a subprocess on 127.0.0.1) driven by
   1, 8 and 32 concurrent clients (:class:`RawClient`: raw asyncio HTTP/1.1, one keep-alive connection
   each, its CPU per request recorded), each sending one sentence per request (greedy): latency
   p50 / p90 / p95 / p99, sentences/s, the mean batch the server formed, how many translations equal
   the offline ones, and where a request's time went by the server's own measure (``GET /metrics``:
   the mean milliseconds of each stage, parse, queue, compute and serialise, over the level's requests).
   ``--batching`` is the server's for a run's greedy translations: ``whole`` (the default; requests
   merged into whole batches) or ``continuous`` (texts join the running decoding batch at every step).
3. 1,000 requests, malformed ones (bad JSON, wrong types, non-finite numbers, huge bodies, 10,000
   texts, unknown model, empty bodies and lists, invalid UTF-8, lone surrogates, over-long texts,
   unknown fields, attention for 64 texts) mixed with good ones and with requests for the attention of
   the largest batch the server allows that (``--max-attention-texts`` texts of 1,000 characters):
   every bad one must get a 4xx JSON error, every good one a 200; the server's resident memory (RSS)
   before and after, sent ``--mixes`` times (RSS read at each mix's end and again ``SETTLE_S`` later).

Appends the run to ``--out`` (default ``benchmarks/results/serving/<run>-t<threads>.json``; one file per engine and
server configuration, every run kept); :func:`markdown_engines` and :func:`markdown_stages` render them. Every loop
is bounded; everything stays on the loopback interface.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnkit.data.readers import read_lines  # noqa: E402
from attnkit.export import Translator, open_translator  # noqa: E402
from attnkit.serve.batching import TRIM_EVERY_S, Limits  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, races, runs_of  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"
RESULTS = ROOT / "benchmarks" / "results" / "serving"
#: Issue 27's targets: 32 clients >= 80% of the same engine's offline throughput; one client's p50 <= 40 ms
#: (attnkit's engine) or 25 ms (CTranslate2); the RSS after the hostile mix within 10% of before.
GOAL_RATIO, GOAL_RSS_RATIO = 0.80, 1.10
GOAL_P50_MS = {"attnkit": 40.0, "CTranslate2": 25.0}
#: The server's RSS is read again this long after each hostile mix: by then its worker has been idle long enough
#: to give freed memory back (TRIM_EVERY_S), as it was before the mix (the offline run after the clients).
SETTLE_S = 2 * TRIM_EVERY_S


# --------------------------------------------------------------------------------------
# The server process
# --------------------------------------------------------------------------------------


def start_server(run: str, threads: int, extra: list[str], timeout: float = 300) -> tuple[str, subprocess.Popen]:
    """``attnkit serve RUN`` on a free loopback port; (base URL, process) once it listens."""
    cmd = [sys.executable, "-m", "attnkit", "serve", run, "--host", "127.0.0.1", "--port", "0",
           "--threads", str(threads), *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stdout=subprocess.PIPE,
                            text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    match = re.search(r"(http://127\.0\.0\.1:\d+)/", line[0]) if line else None
    if not match:
        proc.kill()
        sys.exit(f"the server did not start: {line}")
    return match[1], proc


def engine_name(translator: Translator, precision: str = "float32") -> str:
    """``attnkit float32``, ``attnkit bf16`` or ``CTranslate2 int8`` (an export's quantization)."""
    if translator.exported is None:
        return f"attnkit {precision}"
    return f"CTranslate2 {translator.exported.quantization}"


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (Linux /proc)."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------


class RawClient:
    """One keep-alive HTTP/1.1 connection on asyncio streams, no HTTP library: a request is pre-built bytes, a
    response its status line, its headers up to ``Content-Length`` and that many bytes. The load generator
    shares the server's two cores, so it must cost little: httpx spent about as much CPU per request as the
    server (issue 27); this client's cost is measured and reported (``client_cpu_ms``)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)

    async def __aenter__(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()

    async def _send(self, path: str, body: bytes) -> bytes:
        """POST ``body`` to ``path``; the response's status line and headers."""
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
        return await self.reader.readuntil(b"\r\n\r\n")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = await self._send(path, body)
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        data = await self.reader.readexactly(int(length[1])) if length else b""
        return int(head[9:12]), data

    async def events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST, then the data of each server-sent event of the (chunked) answer as it arrives."""
        head = await self._send(path, body)
        if head[9:12] != b"200" or b"chunked" not in head.lower():
            raise RuntimeError(f"{path}: expected a chunked 200 answer, got {head[:80]!r}")
        pending = b""
        while size := int((await self.reader.readline()).strip(), 16):  # a chunk: its size in hex, then its bytes
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *complete, pending = pending.split(b"\n\n")
            for event in complete:
                if event.startswith(b"data: "):
                    yield event[6:]
        await self.reader.readline()  # the blank line after the last (empty) chunk


async def drive(url: str, sentences: list[str], clients: int) -> dict:
    """``clients`` concurrent clients translate ``sentences`` one per request; latency and throughput, and the
    client's own CPU time per request."""
    latencies: list[float] = []
    outputs: list[str | None] = [None] * len(sentences)
    failures = 0
    queue = list(range(len(sentences)))[::-1]
    bodies = [json.dumps({"texts": [s], "beam": 1}, ensure_ascii=False).encode("utf-8") for s in sentences]

    async def client() -> None:  # one connection each
        nonlocal failures
        async with RawClient(url) as http:
            while queue:
                i = queue.pop()
                start = time.perf_counter()
                status, data = await http.post("/translate", bodies[i])
                latencies.append(time.perf_counter() - start)
                if status == 200:
                    outputs[i] = json.loads(data)["translations"][0]
                else:
                    failures += 1

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    q = statistics.quantiles([x * 1000 for x in latencies], n=100, method="inclusive")
    return {"clients": clients, "requests": len(sentences), "failures": failures, "seconds": round(seconds, 2),
            "sent_per_s": round(len(sentences) / seconds, 1), "p50_ms": round(q[49], 1), "p90_ms": round(q[89], 1),
            "p95_ms": round(q[94], 1), "p99_ms": round(q[98], 1),
            "client_cpu_ms": round(1000 * cpu / len(sentences), 2), "outputs": outputs}


STAGES = ("parse", "queue", "compute", "serialise")


def stage_totals(url: str) -> dict[str, tuple[float, int]]:
    """``{stage: (seconds summed, observations)}`` of the server's ``attnkit_serve_stage_seconds`` (GET /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {stage: [0.0, 0] for stage in STAGES}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name != "attnkit_serve_stage_seconds":
            continue
        for sample in family.samples:
            stage = sample.labels.get("stage")
            if stage in totals and sample.name.endswith("_sum"):
                totals[stage][0] += sample.value
            elif stage in totals and sample.name.endswith("_count"):
                totals[stage][1] += int(sample.value)
    return {stage: (s, n) for stage, (s, n) in totals.items()}


def stage_means_ms(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Mean milliseconds per observation of each stage between two :func:`stage_totals` readings."""
    return {stage: round(1000 * (after[stage][0] - before[stage][0]) / max(after[stage][1] - before[stage][1], 1), 2)
            for stage in STAGES}


def long_texts(sentences: list[str], count: int = 64, chars: int = 1000) -> list[str]:
    """``count`` texts of test sentences joined up to ``chars`` characters: the largest request the server allows."""
    texts, i = [], 0
    for _ in range(count):
        text = ""
        while len(text) + len(sentences[i % len(sentences)]) + 1 <= chars:
            text, i = f"{text} {sentences[i % len(sentences)]}".strip(), i + 1
        texts.append(text)
    return texts


def malformed_requests(n: int, sentences: list[str], seed: int = 0, attention: int = 0
                       ) -> list[tuple[str, bool, bytes, dict]]:
    """``n`` requests ``(kind, good, body, headers)``: about one in four good, the rest of 14 bad kinds; and
    ``attention`` more requests, spread among them, asking for the attention maps of the largest batch the
    server allows that (``--max-attention-texts`` texts of up to 1,000 characters)."""
    json_type = {"Content-Type": "application/json"}

    def body(obj: object) -> bytes:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")

    bad = {
        "bad JSON": lambda s: body({"texts": [s]})[:-3],
        "texts not a list": lambda s: body({"texts": s}),
        "texts of numbers": lambda s: body({"texts": [1, 2.5, None]}),
        "beam a string": lambda s: body({"texts": [s], "beam": "4"}),
        "beam 0": lambda s: body({"texts": [s], "beam": 0}),
        "lenpen NaN": lambda s: b'{"texts": ["x"], "beam": 2, "lenpen": NaN}',
        "huge body (2 MB)": lambda s: body({"texts": [s * 100] * 200}),
        "10,000 texts": lambda s: body({"texts": ["Ein Hund."] * 10_000}),
        "text of 5,000 characters": lambda s: body({"texts": ["a" * 5000]}),
        "unknown model": lambda s: body({"model": "no-such-model", "texts": [s]}),
        "empty body": lambda s: b"",
        "empty list of texts": lambda s: body({"texts": []}),
        "invalid UTF-8": lambda s: body({"texts": [s]}).replace(b"\xc3", b"\xff") + b"\xff\xfe",
        "lone surrogate": lambda s: b'{"texts": ["Ein \\ud800 Hund"]}',
        "unknown field": lambda s: body({"texts": [s], "beams": 4}),
        "attention for 64 texts": lambda s: body({"texts": [s] * 64, "attention": True}),
    }
    good = {
        "good": lambda s: body({"texts": [s], "beam": 1}),
        "good, an empty text": lambda s: body({"texts": ["", s], "beam": 1}),
    }
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.25:
            kind = rng.choice(sorted(good))
            out.append((kind, True, good[kind](sentences[i % len(sentences)]), json_type))
        else:
            kind = rng.choice(sorted(bad))
            out.append((kind, False, bad[kind](sentences[i % len(sentences)]), json_type))
    most = Limits().max_attention_texts
    heavy = body({"texts": long_texts(sentences, count=most), "beam": 1, "attention": True})
    for k in range(attention):
        out.insert((k + 1) * len(out) // (attention + 1), (f"good, attention, {most} texts of 1,000 characters",
                                                          True, heavy, json_type))
    return out


async def send_malformed(url: str, requests: list[tuple[str, bool, bytes, dict]], clients: int) -> dict:
    """Send ``requests`` from ``clients`` concurrent clients; count how each kind was answered."""
    by_kind: dict[str, dict[str, int]] = {}
    queue = list(range(len(requests)))[::-1]

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while queue:
                await one(http, *requests[queue.pop()])

    async def one(http: httpx.AsyncClient, kind: str, good: bool, content: bytes, headers: dict) -> None:
        counts = by_kind.setdefault(kind, {"sent": 0, "as_expected": 0})
        counts["sent"] += 1
        status: int | str = "no answer"
        try:
            r = await http.post("/translate", content=content, headers=headers)
            status = r.status_code
            is_json_error = r.headers.get("content-type") == "application/json" and "error" in r.json()
            ok = status == 200 if good else (400 <= status < 500 and is_json_error)
        except (httpx.HTTPError, ValueError):  # no answer, or an answer that is not JSON
            ok = False
        counts["as_expected"] += ok
        if not ok:
            counts.setdefault("unexpected", []).append(status)

    await asyncio.gather(*(client() for _ in range(clients)))
    return by_kind


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=str(ROOT / "runs" / "multi30k-de-en"),
                   help="a de->en translation run (attnkit's engine) or its `attnkit export` (CTranslate2's)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, offline and in the server (default: 1; on the shared 2-core machine 2 threads "
                        "wait for each other, benchmarks/README.md)")
    p.add_argument("--sentences", type=int, default=1000, help="test_2016_flickr sentences per client level")
    p.add_argument("--single-client-sentences", type=int, default=300,
                   help="sentences sent by the single client (one at a time, so it takes longest)")
    p.add_argument("--clients", default="1,8,32", help="client levels (default: 1,8,32)")
    p.add_argument("--malformed", type=int, default=1000, help="requests in the malformed mix (default: 1000)")
    p.add_argument("--attention-requests", type=int, default=4,
                   help="attention requests of the largest allowed batch in the mix (a run only; default: 4)")
    p.add_argument("--precision", choices=["float32", "bf16"], default="float32",
                   help="a run's precision, offline (bfloat16 autocast) and in the server (--precision)")
    p.add_argument("--mixes", type=int, default=2, help="times the hostile mix is sent, RSS read after each "
                   "(default: 2: the first also warms what attention requests need, the second shows whether "
                   "memory keeps growing)")
    p.add_argument("--max-batch", type=int, default=32, help="the server's --max-batch")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's --max-wait-ms")
    p.add_argument("--batching", choices=["whole", "continuous"], default="whole",
                   help="the server's --batching for a run's greedy translations (an export always batches whole)")
    p.add_argument("--out", help=f"the results file (default {RESULTS}/<run>-t<threads>.json)")
    args = p.parse_args()
    source = DATA / "test_2016_flickr.de.gz"
    if not source.exists():
        sys.exit(f"{source} is missing: this benchmark needs ../shared/data/multi30k beside the repository")
    sentences = read_lines(source)[: args.sentences]
    levels = [int(c) for c in args.clients.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()

    # 1. offline, batched, in this process (before the server starts; again after the clients, beside the idle
    # server: other sessions share this machine, and the mean of the two is less at the mercy of one moment)
    torch.set_num_threads(args.threads)
    translator = open_translator(args.run, threads=args.threads)
    if translator.exported is not None and args.precision != "float32":
        sys.exit(f"--precision {args.precision} is for a run; an export computes in its own quantization")
    engine = engine_name(translator, args.precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    with autocast:
        translator.translate(sentences[:64], beam=1, lenpen=0.0)  # warm-up: weights and kernels in cache

    def offline_run(when: str) -> tuple[list[str], dict]:
        start = time.perf_counter()
        with autocast:
            out = [h[0] for h in translator.translate(sentences, beam=1, lenpen=0.0)]
        seconds = time.perf_counter() - start
        measured = {"when": when, "seconds": round(seconds, 2), "sent_per_s": round(len(sentences) / seconds, 1)}
        print(f"offline, {when}: {measured}", flush=True)
        return out, measured

    offline_out, first = offline_run("before the server started")

    def offline_in_client_batches(clients: int) -> float:
        """Sentences/s offline in the batches ``clients`` one-sentence clients can at most make: ``clients``
        consecutive sentences per call, sorted only within it. A server cannot batch more than its clients have
        in flight, so this bounds what it can reach at that level, whatever it does."""
        start = time.perf_counter()
        with autocast:
            for i in range(0, len(sentences), clients):
                translator.translate(sentences[i:i + clients], beam=1, lenpen=0.0)
        rate = round(len(sentences) / (time.perf_counter() - start), 1)
        print(f"offline, {clients} sentences per call: {rate} sentences/s", flush=True)
        return rate

    in_client_batches = {clients: offline_in_client_batches(clients) for clients in levels if clients > 1}

    # 2. the server under 1, 8, 32 clients
    batching = args.batching if translator.exported is None else "whole"
    url, proc = start_server(args.run, args.threads, ["--precision", args.precision, "--max-batch", str(args.max_batch),
                                                      "--max-wait-ms", str(args.max_wait_ms), "--max-queue", "1024",
                                                      "--batching", batching])
    try:
        asyncio.run(drive(url, sentences[:64], 8))  # warm-up, not measured
        levels_out = []
        for clients in levels:
            subset = sentences[: args.single_client_sentences] if clients == 1 else sentences
            before, stages_before = httpx.get(f"{url}/health").json()["models"], stage_totals(url)
            result = asyncio.run(drive(url, subset, clients))
            after, stages_after = httpx.get(f"{url}/health").json()["models"], stage_totals(url)
            (name,) = after
            batches = after[name]["batches"] - before[name]["batches"]
            batch_texts = after[name].get("batch_texts", 0) - before[name].get("batch_texts", 0)
            outputs = result.pop("outputs")
            # texts per model call: per batch, or (continuous batching) running texts per decoding step
            result.update(mean_batch=round((batch_texts or len(subset)) / max(batches, 1), 1),
                          stage_ms=stage_means_ms(stages_before, stages_after),
                          identical_to_offline=sum(o == ref for o, ref in zip(outputs, offline_out, strict=False)))
            levels_out.append(result)
            print(f"{clients} clients: {result}", flush=True)
        again, second = offline_run("after the clients, beside the idle server")
        offline = {"sentences": len(sentences), "batch_size": 64, "runs": [first, second],
                   "same_output_twice": again == offline_out,
                   "in_client_batches": {str(n): rate for n, rate in in_client_batches.items()},
                   "sent_per_s": round((first["sent_per_s"] + second["sent_per_s"]) / 2, 1)}
        for result in levels_out:
            result["vs_offline"] = round(result["sent_per_s"] / offline["sent_per_s"], 3)
            if result["clients"] in in_client_batches:
                result["vs_offline_in_client_batches"] = round(
                    result["sent_per_s"] / in_client_batches[result["clients"]], 3)

        # 3. malformed requests mixed with good ones
        heavy = args.attention_requests if translator.run is not None else 0  # an export has no attention
        requests = malformed_requests(args.malformed, sentences, attention=heavy)
        rss_start, rss_at_end, rss_after = rss_mb(proc.pid), [], []
        by_kind: dict[str, dict[str, int]] = {}
        for _ in range(args.mixes):  # the first warms what attention needs; the next show the steady state
            for kind, counts in asyncio.run(send_malformed(url, requests, 8)).items():
                for key, n in counts.items():
                    by_kind.setdefault(kind, {}).setdefault(key, 0)
                    by_kind[kind][key] += n
            rss_at_end.append(rss_mb(proc.pid))
            time.sleep(SETTLE_S)
            rss_after.append(rss_mb(proc.pid))
        rss_end = rss_after[0]
        alive = httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=120)
    bad = {k: v for k, v in by_kind.items() if not k.startswith("good")}
    good = {k: v for k, v in by_kind.items() if k.startswith("good")}
    malformed = {
        "requests": len(requests) * args.mixes, "clients": 8, "mixes": args.mixes,
        "rss_after_each_mix_mb": [round(x, 1) for x in rss_after], "settle_s": SETTLE_S,
        "rss_at_each_mix_end_mb": [round(x, 1) for x in rss_at_end],
        "bad": sum(v["sent"] for v in bad.values()), "bad_4xx_json": sum(v["as_expected"] for v in bad.values()),
        "good": sum(v["sent"] for v in good.values()), "good_200": sum(v["as_expected"] for v in good.values()),
        "by_kind": dict(sorted(by_kind.items())), "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
        "rss_ratio": round(rss_end / rss_start, 3), "alive_after": alive, "exit_code_after_sigterm": exit_code,
    }
    results = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
        "command": " ".join(["python", "benchmarks/serve.py", *sys.argv[1:]]),
        "model": Path(args.run).name, "engine": engine, "client": "raw asyncio HTTP/1.1, one connection per client",
        "test": "test_2016_flickr (de)", "decoding": "greedy", "threads": args.threads,
        "server": {"max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "precision": args.precision,
                   "batching": batching},
        "offline": offline, "clients": levels_out, "malformed": malformed,
        "goals": {"ratio_32_clients": GOAL_RATIO, "p50_ms_1_client": GOAL_P50_MS[engine.split()[0]],
                  "rss_ratio": GOAL_RSS_RATIO},
        "machine": {"torch": torch.__version__, "cpu": cpu_model() or platform.processor() or platform.machine(),
                    "cores": os.cpu_count()},
    }
    out = Path(args.out or RESULTS / f"{Path(args.run).name}-t{args.threads}.json")
    append_run(out, results)
    print(markdown_engines([results]))
    print(f"wrote {out}")


def _batching(r: dict) -> str:
    """How the run's server batched greedy translations (runs before ``--batching`` batched whole)."""
    return r["server"].get("batching", "whole")


def configuration(run: dict) -> list[tuple[str, dict]]:
    """The race of each engine and server configuration: engine, threads, batching, wait."""
    return [(f"{run['engine']}, {run['threads']} thread{'s' if run['threads'] != 1 else ''}, {_batching(run)} "
             f"batches, wait {run['server']['max_wait_ms']:g} ms", run)]


def share_of_offline(run: dict) -> float | None:
    """32 clients' sentences/s over offline's, the headline."""
    return next((c["vs_offline"] for c in run["clients"] if c["clients"] == 32), None)


def _engine_rows(runs: list[dict]) -> list[dict]:
    """Runs by engine, then threads."""
    return sorted(runs, key=lambda r: (r.get("engine", ""), r["threads"], _batching(r), r["date"]))


def _served_cell(level: dict) -> str:
    """``sentences/s (x offline; x offline in calls of as many sentences as clients)``; runs before that second
    ratio was measured show the first alone."""
    ratios = [f"{level['vs_offline']:.2f}"]
    if "vs_offline_in_client_batches" in level:
        ratios.append(f"{level['vs_offline_in_client_batches']:.2f}")
    return f"{level['sent_per_s']:,.1f} ({'; '.join(ratios)})"


def markdown_engines(runs: list[dict]) -> str:
    """Each engine offline and served (1, 8, 32 clients), at each thread count."""
    rows = []
    for r in _engine_rows(runs):
        by, m, off = {c["clients"]: c for c in r["clients"]}, r["malformed"], r["offline"]
        served = [_served_cell(by[n]) if n in by else "" for n in (8, 32)]
        small = off.get("in_client_batches", {})
        one = f"{by[1]['p50_ms']:.1f} / {by[1].get('p90_ms', by[1]['p95_ms']):.1f}" if 1 in by else ""
        again = "".join(f" -> {x:,.0f} ({x / m['rss_end_mb']:.2f}x)" for x in m.get("rss_after_each_mix_mb", [])[1:])
        if "rss_at_each_mix_end_mb" in m:  # read SETTLE_S after each mix; also at its end
            again += f"; read {m['settle_s']:g} s after each; at its end: " + " / ".join(
                f"{x:,.0f}" for x in m["rss_at_each_mix_end_mb"])
        rows.append([r["engine"], r["threads"], _batching(r), f"{r['server']['max_wait_ms']:g}",
                     " / ".join(f"{x['sent_per_s']:,.1f}" for x in off["runs"]),
                     " / ".join(f"{small[n]:,.1f}" for n in ("8", "32") if n in small), one,
                     *served, f"{m['bad_4xx_json']:,} / {m['bad']:,}",
                     f"{m['rss_start_mb']:,.0f} -> {m['rss_end_mb']:,.0f} ({m['rss_ratio']:.2f}x){again}",
                     f"{r['date'][:10]}, `{r['commit']}`"])
    return markdown(["engine", "threads", "batching", "wait ms", "offline sentences/s (before / after)",
                     "offline in calls of 8 / 32 sentences", "1 client p50 / p90 ms",
                     "8 clients sentences/s (x offline; x offline in calls of 8)",
                     "32 clients sentences/s (x offline; x offline in calls of 32)",
                     "malformed: 4xx JSON", "server RSS MB: before -> after the hostile mix (x before) -> after "
                     "it again (x after the first)", "measured"], rows, "lrlrrrrrrrrl")


def markdown_stages(results: dict[str, dict], clients: int = 32) -> str:
    """Where a request's time goes at ``clients`` concurrent clients, by the server's own measure, per engine: the
    latest run of each configuration and host kind (``{path: contents}`` of the results files)."""
    latest = [race.runs[-1] for race in races([pair for run in runs_of(results) for pair in configuration(run)])]
    rows = []
    for r in _engine_rows(latest):
        for c in (c for c in r["clients"] if c["clients"] == clients):
            stages = c.get("stage_ms") or {}
            rows.append([r["engine"], r["threads"], _batching(r), f"{r['server']['max_wait_ms']:g}", c["clients"],
                         *(f"{stages.get(s, 0):.2f}" for s in STAGES),
                         f"{sum(stages.values()):.1f}", f"{c['p50_ms']:.1f}", f"{c.get('client_cpu_ms', 0):.2f}"])
    return markdown(["engine", "threads", "batching", "wait ms", "clients", "parse ms", "queue ms", "compute ms",
                     "serialise ms", "server total ms", "p50 latency ms", "client CPU ms per request"], rows,
                    "lrlrrrrrrrrr")


if __name__ == "__main__":
    main()
