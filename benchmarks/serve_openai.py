"""What the OpenAI-compatible API costs: ``/v1/chat/completions`` against ``/generate`` on the same load, one server.

    flock /tmp/attnkit-bench.lock python benchmarks/serve_openai.py            # trains a model first (~2 min)
    flock /tmp/attnkit-bench.lock python benchmarks/serve_openai.py --run runs/smol

The model: ``--run`` (a language-model run with a chat template), or ``configs/shakespeare-char.yaml`` trained for
``--updates`` updates with blocks of 256 characters and the play's chat template (:data:`PLAY`: the user is ROMEO,
the model answers as JULIET) and no end of turn, so that a chat's answer ends where ``/generate``'s does. The load:
``--streams`` concurrent clients, each one streamed greedy request of ``--new-tokens`` tokens, a question of
``generate_race.PROMPT_CHARS`` characters of tiny Shakespeare's validation tail (or a line of ``--prompts``) each.
The two contenders get the same prompts: ``/v1/chat/completions`` the question as the user's message, ``/generate`` the
conversation as the run's chat template renders it (what the chat route encodes; ``prompt_tokens`` of each are
recorded), so both decode the same ids, and ``same`` says whether every answer's text was ``/generate``'s (with an
instruct model's end of turn the chat stops earlier: then compare tokens/s). One server (``attnkit serve RUN``, a
subprocess on a free port, as ``generate_race.py`` serves); the contenders one at a time, after an untimed warm-up
round of each, their rounds interleaved over ``--repeats`` rounds (the first contender alternating). A round's
tokens/s: the tokens generated (``/generate``'s last event's ``tokens``, the chat's ``usage.completion_tokens``,
asked for with ``stream_options.include_usage``) over the round's wall time. The client is ``serve.py``'s raw
HTTP/1.1 one, and it parses every event's JSON for both contenders.

Target (issue 57): the compatible API keeps >= 95% of ``/generate``'s tokens/s (``ratio``: the median round of the
chat over the median round of ``/generate``). Writes ``benchmarks/results/serve-openai.json`` (every run kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.inference.chat import run_template  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from generate_race import prompts, serving, train_model  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "serve-openai.json"
GOAL_RATIO = 0.95
#: The chat template of the model trained here: a play, the user speaking as ROMEO, the model as JULIET.
PLAY = ("{% for m in messages %}{{ 'ROMEO' if m['role'] == 'user' else 'JULIET' }}:\n{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}JULIET:\n{% endif %}")
CONTENDERS = ("/generate", "/v1/chat/completions")


def requests(run: Path, questions: list[str], new_tokens: int) -> dict[str, list[bytes]]:
    """Each contender's request bodies for ``questions`` (module doc)."""
    loaded = load_run(run)
    template, name = run_template(loaded, run.name), run.name
    out: dict[str, list[bytes]] = {path: [] for path in CONTENDERS}
    for question in questions:
        messages = [{"role": "user", "content": question}]
        out["/generate"].append(json.dumps({"prompt": template.render(messages), "max_new_tokens": new_tokens,
                                            "temperature": 0, "stream": True}).encode())
        out["/v1/chat/completions"].append(json.dumps({
            "model": name, "messages": messages, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}).encode())
    return out


async def stream_one(url: str, path: str, body: bytes) -> dict:
    """One streamed request on its own connection: seconds to the first piece of text, seconds in all, tokens,
    prompt tokens and the text."""
    from serve import RawClient
    start, first, pieces, tokens, prompt = time.perf_counter(), None, [], 0, 0
    async with RawClient(url) as client:
        async for data in client.events(path, body):
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if path == "/generate":
                piece = event.get("token", "")
                if "tokens" in event:
                    tokens, prompt = event["tokens"], event["prompt_tokens"]
            elif event["choices"]:
                piece = event["choices"][0]["delta"].get("content") or ""
            else:
                piece = ""
                tokens, prompt = event["usage"]["completion_tokens"], event["usage"]["prompt_tokens"]
            if piece:
                pieces.append(piece)
                first = first or time.perf_counter() - start
    return {"ttft_s": first or float("nan"), "seconds": time.perf_counter() - start, "tokens": tokens,
            "prompt_tokens": prompt, "text": "".join(pieces)}


async def load(url: str, path: str, bodies: list[bytes]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(url, path, b) for b in bodies))
    return list(results), time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="serve-openai-"))
    if args.run is None:
        (work / "play.jinja").write_text(PLAY, encoding="utf-8")
        run = train_model(work, args.updates, [f"data.chat_template={work / 'play.jinja'}"])
    else:
        run = args.run
    questions = (Path(args.prompts).read_text(encoding="utf-8").splitlines()[:args.streams] if args.prompts
                 else prompts(args.streams))
    bodies = requests(run, questions, args.new_tokens)
    rounds: dict[str, list[dict]] = {path: [] for path in CONTENDERS}
    texts: dict[str, list[str]] = {}
    with serving(run, args.threads) as port:
        url = f"http://127.0.0.1:{port}"
        for path in CONTENDERS:  # warm-up
            asyncio.run(load(url, path, bodies[path]))
        for r in range(args.repeats):
            for path in CONTENDERS[::-1] if r % 2 else CONTENDERS:
                results, wall = asyncio.run(load(url, path, bodies[path]))
                tokens = sum(x["tokens"] for x in results)
                rounds[path].append({"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                                     "ttft_s_median": statistics.median(x["ttft_s"] for x in results),
                                     "prompt_tokens": sum(x["prompt_tokens"] for x in results)})
                texts[path] = [x["text"] for x in results]
                print(f"{path}: {rounds[path][-1]['tok_s']:.0f} tok/s, {tokens} tokens", flush=True)
    median = {path: statistics.median(x["tok_s"] for x in rounds[path]) for path in CONTENDERS}
    return {**stamp(), "cpu": cpu_model(), "command": " ".join(["python benchmarks/serve_openai.py", *sys.argv[1:]]),
            "run": str(args.run) if args.run else f"configs/shakespeare-char.yaml, {args.updates} updates",
            "threads": args.threads, "streams": args.streams, "new_tokens": args.new_tokens,
            "rounds": rounds, "median_tok_s": median,
            "ratio": median["/v1/chat/completions"] / median["/generate"], "goal_ratio": GOAL_RATIO,
            "same": texts["/generate"] == texts["/v1/chat/completions"]}


def ratio(run: dict) -> float:
    """The headline: the chat route's median tokens/s over ``/generate``'s."""
    return run["ratio"]


def markdown_table(runs: list[dict]) -> str:
    """Each run of ``runs`` (``report.py`` gives the latest of each host kind): each contender's median tokens/s and
    time to the first token, every round, the ratio and whether it met the target."""
    parts = []
    for run in runs:
        rows = []
        for path in CONTENDERS:
            rounds = run["rounds"][path]
            rows.append([f"`{path}`", f"{run['median_tok_s'][path]:,.0f}",
                         f"{statistics.median(r['ttft_s_median'] for r in rounds) * 1000:.1f}",
                         ", ".join(f"{r['tok_s']:,.0f}" for r in rounds)])
        table = markdown(["route", "tokens/s (median round)", "first token, ms (median)", "every round"], rows, "lrrl")
        met = "met" if run["ratio"] >= run["goal_ratio"] else "**not met**"
        parts.append(f"{table}\n\n{run['streams']} streams of {run['new_tokens']} greedy tokens, {run['threads']} "
                     f"thread(s), {run['cpu']}; ratio {run['ratio']:.3f} (target >= {run['goal_ratio']}: {met}), "
                     f"same texts: {run['same']}. {measured(run)}")
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a task: lm run with a chat template (default: train one briefly)")
    p.add_argument("--updates", type=int, default=300, help="updates of the model trained without --run")
    p.add_argument("--prompts", help="a file of questions, one a line (default: tiny Shakespeare's validation tail)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=32, help="concurrent streaming clients")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    args = p.parse_args()
    result = measure(args)
    append_run(args.out, result, args.note)
    print(markdown_table([result]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
