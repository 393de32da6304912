"""Where a served language model loses time against the same model offline: the first token, and 32 streams. A probe.

    flock /tmp/attnkit-bench.lock python experiments/serve_breakdown.py --run RUN [--threads 1] [--requests 20]

``benchmarks/generate_race.py`` holds ``attnkit serve`` to two bars of issue 37: the time to the first streamed
token at one client against one forward pass of the prompt, timed offline in a warm loop (at most 1.5x), and 32
concurrent streams against the offline batch of 32 (at least 0.8x). This probe splits both, at one thread count
(``--threads``, the server's and the offline model's), with the race's model, prompts and greedy 128 new tokens.

The first token:

* the offline forward pass of the prompt (the race's yardstick call) in four states of the process: in a warm
  loop (after three others, as the race times it); right after a greedy decode of 128 tokens (as a request that
  follows another finds it); after that decode and a heap trim (:func:`~attnkit.common.memory.release_free_memory`,
  which the server runs when a busy spell ends); and after 0.3 s idle. The states are interleaved;
* ``attnkit serve RUN``, one streaming client at a time, each request right after the last (two scrapes of
  ``/metrics`` between), with the server's own clock read from ``/metrics`` after every request: ``parse``
  (request in -> queued), ``queue`` (queued -> the worker took it) and the server's time to the first token
  (request in -> first token chosen). So ``first step`` = server time - parse - queue (the prompt's forward pass
  and choosing the token, in the worker), and ``outside`` = client time - server time (connecting, uvicorn
  before the app, handing the token to the event loop, sending it, the client reading it).

32 streams, tokens/s:

* offline: ``attnkit.sampling.generate`` on the batch of 32 (the race's ``attnkit float32`` contender), and the
  server's own continuous batcher (:class:`~attnkit.serve.generation.ContinuousGeneration`: rows, text streams,
  a token event per row and step) run on the same 32 prompts in this process, without HTTP, interleaved;
* served: 32 concurrent streaming clients, as the race serves them.

Writes ``benchmarks/results/lm-serve-breakdown.json`` (every run kept); :func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the race's prompts, server and client, and the tables
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import generate_race  # noqa: E402
from attnkit.common.measure import stamp  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "lm-serve-breakdown.json"
STATES = ("warm loop", "after a decode", "after a decode and a trim", "after 0.3 s idle")
NEW, STREAMS = generate_race.NEW_TOKENS, generate_race.STREAMS


def offline(run: Path, threads: int, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of one forward pass of the prompt (its first token chosen), ``repeats`` times in each of
    :data:`STATES`; and tokens/s of the batch of :data:`STREAMS` prompts by ``generate`` and by the server's
    continuous batcher, ``repeats`` times each."""
    from attnkit.common.memory import release_free_memory
    from attnkit.engine.continuous_lm import Sampling
    from attnkit.sampling import generate
    from attnkit.serve.generation import GenerationJob
    from attnkit.serve.servables import load_servable
    torch.set_num_threads(threads)
    servable = load_servable(run, threads)  # the server's model (the engine's fast paths), batcher and prompts
    model, batcher = servable.run.model.eval(), servable.stepper
    ids = [servable.prompt_ids(p, NEW, NEW, False)[0] for p in generate_race.prompts(1)]
    batch = [servable.prompt_ids(p, NEW, NEW, False)[0] for p in generate_race.prompts(STREAMS)]
    x = torch.tensor(ids)

    def forward() -> float:
        start = time.perf_counter()
        model.step(x, model.init_state())[0].argmax(-1).tolist()
        return time.perf_counter() - start

    def decode() -> None:
        for _ in generate(model, ids, NEW, temperature=0.0, ignore_eos=True):
            pass

    def batch_generate() -> float:
        start, tokens = time.perf_counter(), 0
        for step in generate(model, batch, NEW, temperature=0.0, ignore_eos=True):
            tokens += step.numel()
        return tokens / (time.perf_counter() - start)

    def batch_continuous() -> float:
        events: list[dict] = []
        jobs = [GenerationJob(p, NEW, Sampling(0.0, 0, 1.0), 0, (), events.append) for p in batch]
        start = time.perf_counter()
        results = batcher.run(jobs)
        return sum(r.tokens for r in results) / (time.perf_counter() - start)

    before = {"warm loop": lambda: [forward() for _ in range(3)], "after a decode": decode,
              "after a decode and a trim": lambda: (decode(), release_free_memory()),
              "after 0.3 s idle": lambda: time.sleep(0.3)}
    times: dict[str, list[float]] = {state: [] for state in STATES}
    rates: dict[str, list[float]] = {"generate": [], "continuous": []}
    with torch.inference_mode():
        for _ in range(3):
            forward()
        for _ in range(repeats):  # interleaved, so that drift on the machine reaches them all alike
            for state in STATES:
                before[state]()
                times[state].append(forward())
        batch_generate(), batch_continuous()  # warm-up
        for _ in range(max(repeats // 4, 3)):
            rates["generate"].append(batch_generate())
            rates["continuous"].append(batch_continuous())
    return times, rates


def _sums(url: str) -> dict[str, float]:
    """The server's histogram sums that time a request's stages (``/metrics``), by name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "attnkit_serve_stage_seconds_sum" and s.labels["stage"] in ("parse", "queue"):
                out[s.labels["stage"]] = s.value
            elif s.name == "attnkit_serve_time_to_first_token_seconds_sum":
                out["server"] = s.value
    return out


def served(run: Path, threads: int, requests: int, compiled: bool) -> tuple[list[dict[str, float]], list[float]]:
    """Per request of one client: its time to the first token and the server's stages, in seconds; then the tokens/s
    of :data:`STREAMS` concurrent streams, several times (``compiled``: the server with ``--compile``)."""
    with generate_race.serving(run, threads, compiled=compiled) as port:
        url, prompt = f"http://127.0.0.1:{port}", generate_race.prompts(1)
        for _ in range(3):  # warm-up
            asyncio.run(generate_race.served_load(port, prompt))
        rows, before = [], _sums(url)
        for _ in range(requests):
            (first, _, _), = asyncio.run(generate_race.served_load(port, prompt))[0]
            after = _sums(url)
            d = {k: after[k] - before.get(k, 0.0) for k in after}
            rows.append({"client": first, "parse": d["parse"], "queue": d["queue"], "server": d["server"]})
            before = _sums(url)  # after the scrape: the next request's stages alone
        streams = []
        for _ in range(max(requests // 4, 3)):
            results, wall = asyncio.run(generate_race.served_load(port, generate_race.prompts(STREAMS)))
            streams.append(sum(r[2] for r in results) / wall)
        return rows, streams


def measure(run: Path, threads: int, requests: int, compiled: bool) -> dict:
    first, streams = served(run, threads, requests, compiled)
    forward, rates = offline(run, threads, requests)
    return {**stamp(), "cpu": cpu_model(), "threads": threads, "compiled": compiled, "run": str(run), "new_tokens": NEW,
            "prompt_chars": generate_race.PROMPT_CHARS, "served": first, "forward_s": forward,
            "streams_tok_s": {"offline generate": rates["generate"], "offline continuous batcher":
                              rates["continuous"], "served": streams}}


def markdown_table(data: dict) -> str:
    parts = []
    for run in data["runs"]:
        def median(values: list[float]) -> float:
            return statistics.median(values)

        def ms(seconds: float) -> str:
            return f"{seconds * 1000:.2f} ms"

        served = run["served"]
        med = {k: median([r[k] for r in served]) for k in ("client", "parse", "queue")}
        step = median([r["server"] - r["parse"] - r["queue"] for r in served])
        outside = median([r["client"] - r["server"] for r in served])
        warm = median(run["forward_s"]["warm loop"])
        rows = [["served: first token at the client", ms(med["client"]), f"{med['client'] / warm:.2f}x"],
                ["- outside the server's clock (connect, send, deliver)", ms(outside), ""],
                ["- parse (request in -> queued)", ms(med["parse"]), ""],
                ["- queue (queued -> the worker takes it)", ms(med["queue"]), ""],
                ["- first step (the prompt's forward pass in the worker, the token chosen)", ms(step),
                 f"{step / warm:.2f}x"]]
        rows += [[f"offline forward pass, {state}", ms(median(run["forward_s"][state])),
                  f"{median(run['forward_s'][state]) / warm:.2f}x"] for state in STATES]
        rates = run["streams_tok_s"]
        first = median(rates["offline generate"])
        streams = [[name, f"{median(v):.0f}", " / ".join(f"{x:.0f}" for x in v), f"{median(v) / first:.2f}x"]
                   for name, v in rates.items()]
        note = f" {run['note']}" if run.get("note") else ""
        parts.append(markdown(["the first token (medians)", "time", "of the warm forward pass"], rows, "lrr")
                     + "\n\n" + markdown([f"{STREAMS} prompts, tokens/s", "median", "every pass",
                                          "of offline generate"], streams, "lrrr")
                     + f"\n\n{run['cpu']}, server{' (--compile)' if run.get('compiled') else ''} and offline model "
                       f"at {run['threads']} thread(s); "
                       f"{len(served)} one-client requests of a {run['prompt_chars']}-character prompt, greedy, "
                       f"{run['new_tokens']} new tokens; each offline state {len(run['forward_s']['warm loop'])} "
                       f"times, interleaved; {measured(run)}.{note}")
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a task: lm run (generate_race.py's model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="serve with --compile (the prompt's pass compiled)")
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    args = p.parse_args()
    result = measure(args.run, args.threads, args.requests, args.compile)
    append_run(OUT, result, args.note)
    print(json.dumps({k: v for k, v in result.items() if k not in ("served", "forward_s")}, indent=2))
    print(markdown_table({"runs": [result]}))


if __name__ == "__main__":
    main()
