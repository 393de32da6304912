"""Does the GIL switch interval of ``attnkit serve`` matter for a language model's streams? A probe.

    flock /tmp/attnkit-bench.lock python experiments/serve_switch_interval.py --run RUN [--intervals 0.005 0.001]

The model worker (one thread) and uvicorn's event loop (another) share CPython's GIL. A thread that wants it while
the other runs Python code waits up to the switch interval (CPython's default: 5 ms), so a token's event can wait
that long to be sent, and a decode step as long for the loop. ``attnkit serve`` sets
:data:`attnkit.serve.app.SWITCH_INTERVAL_S` (CPython's default, kept after this probe); this probe starts the
server once per interval (patching that constant), the intervals alternating over ``--rounds`` rounds, and
measures what ``benchmarks/generate_race.py`` measures when serving (its :func:`served`): one streaming client
(time to the first token, tokens/s), then 32 concurrent streams (tokens/s), greedy, 128 new tokens each, with the
server at ``--threads`` threads. The prompt's forward pass (the race's yardstick for the first token) is timed in
this process at the end.

Writes ``benchmarks/results/gil-switch-interval.json`` (every run kept); :func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the race's served(), and the markdown helpers
sys.path.insert(0, str(ROOT / "src"))

import generate_race  # noqa: E402
from attnkit.common.measure import stamp  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gil-switch-interval.json"


def server_command(interval: float) -> list[str]:
    """``python -m attnkit`` with the server's switch interval set to ``interval``."""
    return [sys.executable, "-c",
            "import runpy, sys; import attnkit.serve.app as app; "
            f"app.SWITCH_INTERVAL_S = {interval!r}; sys.argv = ['attnkit', *sys.argv[1:]]; "
            "runpy.run_module('attnkit', run_name='__main__', alter_sys=True)"]


def measure(run: Path, intervals: list[float], threads: int, rounds: int) -> dict:
    results: dict[str, list[dict]] = {str(i): [] for i in intervals}
    for _ in range(rounds):
        for interval in intervals:
            generate_race.ATTNKIT = server_command(interval)
            results[str(interval)].append(generate_race.served(run, threads, repeats=3))
    forward = generate_race.prompt_forward_seconds(run, threads)
    return {**stamp(), "cpu": cpu_model(), "threads": threads, "run": str(run), "rounds": rounds,
            "prompt_forward_s": forward, "intervals": results}


def markdown_table(data: dict) -> str:
    parts = []
    for run in data["runs"]:
        rows = []
        for interval, served in run["intervals"].items():
            ttft = [s["ttft_s"] for r in served for s in r["single"]]
            one = [s["tok_s"] for r in served for s in r["single"]]
            many = [s["tok_s"] for r in served for s in r["streams"]]
            rows.append([f"{float(interval) * 1000:g} ms", f"{statistics.median(ttft) * 1000:.1f} ms",
                         f"{statistics.median(ttft) / run['prompt_forward_s']:.2f}x",
                         f"{statistics.median(one):.0f}", f"{statistics.median(many):.0f}", str(len(ttft))])
        note = f" {run['note']}" if run.get("note") else ""
        parts.append(markdown(["switch interval", "first token, 1 client (median)", "of the prompt's forward",
                               "1 client tok/s (median)", "32 streams tok/s (median)", "passes"], rows, "lrrrrr")
                     + f"\n\n{run['cpu']}, server at {run['threads']} thread(s), prompt forward "
                       f"{run['prompt_forward_s'] * 1000:.1f} ms; {run['rounds']} rounds; {measured(run)}.{note}")
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a task: lm run")
    p.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.001], help="seconds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    args = p.parse_args()
    result = measure(args.run, args.intervals, args.threads, args.rounds)
    append_run(OUT, result, args.note)
    print(markdown_table({"runs": [result]}))


if __name__ == "__main__":
    main()
