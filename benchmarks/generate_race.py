"""The generation race: one language model, generated from by attnkit, transformers and CTranslate2, and served.

    flock /tmp/attnkit-bench.lock python benchmarks/generate_race.py            # trains a model first (~2 min)
    flock /tmp/attnkit-bench.lock python benchmarks/generate_race.py --run runs/shakespeare-char

The model: a ``task: lm`` run (``--run``, or ``configs/shakespeare-char.yaml`` with blocks of 256 characters
trained for ``--updates`` updates), exported with ``attnkit export --to huggingface`` (transformers'
``AutoModelForCausalLM`` reads it) and ``--to ctranslate2`` in float32 and int8, so every contender holds the
same weights. The workload: greedy decoding of ``NEW_TOKENS`` new tokens after prompts of ``PROMPT_CHARS``
characters of tiny Shakespeare's validation text, at batch 1 and batch 32 (32 different prompts of one
length). Every contender runs in a process of its own (one library's thread pool slows another's in a shared
process) and is timed one at a time, ``--repeats`` times at each thread count (1 and 2), after an
untimed warm-up pass of the whole batch, the passes of the contenders interleaved; a row reports the best thread
count and every pass. attnkit runs eagerly and compiled (``attnkit.engine.compiled_decoding``: a static cache,
the prompt's pass and a step compiled ahead of time, on the warm-up pass; the warm-up times are kept, as the cost
of compiling). Eager bf16 runs under autocast; compiled bf16 holds its weights in bf16 (the compiled step
refuses autocast); compiled int8 decodes through a copy with int8 weights (``attnkit.engine.quantize``,
weight-only: its activations stay float32, where CTranslate2's int8 quantizes them too). Tokens per second count
the tokens each contender generated (a row that stopped at ``</s>`` counts what it made), and ``same`` says
whether its greedy tokens equal attnkit's float32 ones.

Served (``attnkit serve RUN``, a subprocess on a free port, ``--max-streams 64``), eager and with ``--engine
compiled`` (each prompt's pass and the running rows' steps compiled ahead of time): one streaming client, then 32
concurrent streaming clients (:data:`CLIENT`), each greedy for ``NEW_TOKENS`` tokens. Reported: the served tokens/s
against the offline batch-32 rate of the same engine (attnkit float32, eager or compiled; runs before the server's
steps were compiled, at ``354f4e9`` and earlier, served compiled prompts only), and the time to the first streamed
token at one client against one forward pass of the prompt, timed offline in a fresh process:
``LanguageModel.step`` on the prompt (eager), and the compiled prompt pass (what ``--engine compiled`` serves with).

Targets (issue 37): attnkit >= 2x transformers; >= 1x CTranslate2 float32 and >= 0.8x int8 at batch 1;
32 served streams >= 0.8x the offline batch; time to first token <= 1.5x a forward pass of the prompt.
Writes ``benchmarks/results/generate-race.json`` (every run kept); :func:`markdown_table` renders it.

On a GPU (``--device cuda``, issue 37's GPU check), every contender runs there: attnkit, transformers, CTranslate2
(where its build finds the CUDA libraries it needs; else the row says why not) and the server
(``attnkit serve --device cuda``), and the run goes to ``benchmarks/results/generate-race-gpu.json``. ``--set``
overrides the briefly trained model's config, for a model big enough to keep a GPU busy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.sampling import generate  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.training.runtime import cpu_has_fast_bf16  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "generate-race.json"
OUT_GPU = ROOT / "benchmarks" / "results" / "generate-race-gpu.json"
TEXT = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
NEW_TOKENS, PROMPT_CHARS, BATCHES, STREAMS = 128, 64, (1, 32), 32
#: The streaming client of the served rows (earlier runs, without a ``client``, used httpx).
CLIENT = "raw HTTP/1.1 on asyncio streams, one connection per request"
ATTNKIT = [sys.executable, "-m", "attnkit"]


def prompts(n: int) -> list[str]:
    """``n`` prompts of :data:`PROMPT_CHARS` characters from the validation tail (the last 10%) of tiny Shakespeare."""
    text = TEXT.read_text(encoding="utf-8")
    tail = text[int(len(text) * 0.9):]
    step = (len(tail) - PROMPT_CHARS) // n
    return [tail[i * step: i * step + PROMPT_CHARS] for i in range(n)]


def train_model(work: Path, updates: int, settings: list[str]) -> Path:
    run = work / "lm"
    subprocess.run([*ATTNKIT, "train", "configs/shakespeare-char.yaml", "--run-dir", str(run),
                    f"train.max_updates={updates}", f"train.valid_every={updates}", "train.progress=false",
                    "data.block_size=256", "model.transformer.max_len=256", *settings],  # the prompt + 128 tokens
                   check=True, cwd=ROOT)
    return run


# -- the offline contenders: prompt ids (B, T) -> generated ids, a list per row -------------------


def attnkit_contender(run: Path, precision: str, compiled: bool, device: torch.device):
    from attnkit.engine import to_eager
    from attnkit.engine.compiled_decoding import CompiledDecoder
    model = to_eager(load_run(run, device).model).eval()
    bf16 = precision == "bf16"
    if compiled:  # compiled on the warm-up pass of each batch size; in bf16 its weights are bf16 (no autocast)
        model = CompiledDecoder(model.to(torch.bfloat16) if bf16 else model,
                                quantize="int8" if precision == "int8" else None)

    def run_batch(ids: list[list[int]]) -> list[list[int]]:
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and not compiled):
            steps = list(generate(model, ids, NEW_TOKENS, temperature=0.0, ignore_eos=True))
        return torch.stack(steps, 1).tolist()  # (B, NEW_TOKENS)

    return run_batch


def transformers_contender(hf: Path, device: torch.device):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).to(device).eval()

    def run_batch(ids: list[list[int]]) -> list[list[int]]:
        x = torch.tensor(ids, device=device)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return out[:, x.size(1):].tolist()

    return run_batch


def ctranslate2_contender(export: Path, threads: int, device: torch.device):
    from attnkit.export.ctranslate2_lm import ExportedGenerator
    engine = ExportedGenerator(export, threads=threads, device=device.type)

    def run_batch(ids: list[list[int]]) -> list[list[int]]:
        return engine.generate_batch(ids, NEW_TOKENS, temperature=0.0)

    return run_batch


def build_contender(name: str, run: Path, hf: Path, exports: dict[str, Path], threads: int, device: str):
    if name.startswith("attnkit"):
        return attnkit_contender(run, name.split()[-1], "compiled" in name, torch.device(device))
    if name.startswith("transformers"):
        return transformers_contender(hf, torch.device(device))
    return ctranslate2_contender(exports[name.split()[-1]], threads, torch.device(device))


def contender_process(conn, build, args: tuple, threads: int) -> None:
    """One contender in a process of its own, at ``threads``: ``build(*args)`` makes it (a function of a batch of
    prompt ids); it answers each batch it receives with ``("ok", (seconds, generated ids))`` (or ``("error",
    why)``) until it receives ``None``.

    A process each, because a library's thread pool slows the others' in a shared process: CTranslate2 brings
    its own OpenMP runtime, and after its two-thread contenders have run, every two-thread torch call in the same
    process is slowed."""
    torch.set_num_threads(threads)
    try:
        contender = build(*args)
        conn.send(("ok", None))
        while (ids := conn.recv()) is not None:
            start = time.perf_counter()
            out = contender(ids)
            conn.send(("ok", (time.perf_counter() - start, out)))
    except Exception as e:  # reported to the parent, which decides whether it is fatal
        conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


class Contender:
    """A :func:`contender_process` started (spawned: nothing inherited) and ready; calling it times one batch.

    :param timeout: the most seconds to wait for any answer (None: no limit); past it the process is killed and
        ``RuntimeError`` raised, as for a contender that failed."""

    def __init__(self, build, args: tuple, threads: int, timeout: float | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.conn, child = context.Pipe()
        self.process = context.Process(target=contender_process, daemon=True, args=(child, build, args, threads))
        self.process.start()
        child.close()  # the child's end lives in the child: if it dies, recv() here ends (EOFError), not hangs
        self.answer()

    def answer(self):
        if self.timeout is not None and not self.conn.poll(self.timeout):
            self.process.kill()
            raise RuntimeError(f"no answer within {self.timeout:g} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the process ended (exit status {self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(payload)
        return payload

    def __call__(self, ids: list[list[int]]) -> tuple[float, list[list[int]]]:
        """``(seconds the contender took, its generated ids)``, timed in its own process."""
        self.conn.send(ids)
        return self.answer()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:  # it ended already (after reporting an error)
            pass
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def ctranslate2_runs_on(export: Path, device: torch.device, missing: dict[str, str], name: str) -> bool:
    """Whether CTranslate2 opens ``export`` on ``device``, tried in a child process (a build without the CUDA
    libraries it was made for may abort the process); if not, ``missing[name]`` says why."""
    probe = f"import ctranslate2; ctranslate2.Generator({str(export)!r}, device={device.type!r})"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr.strip() or f"exit status {done.returncode}").splitlines()
        missing[name] = lines[-1]
        print(f"{name}: cannot run on {device.type}: {missing[name]}", flush=True)
    return done.returncode == 0


def offline(run: Path, hf: Path, exports: dict[str, Path], threads: list[int], repeats: int, device: torch.device
            ) -> tuple[list[dict], list[dict], dict[str, str]]:
    """Every contender at each thread count, its passes interleaved with the others' (pass 1 of each, then pass 2
    of each, ...), so that a slow spell of this shared machine falls on all of them alike. Also returns the
    contenders that could not run here, with why (CTranslate2 on a GPU without the CUDA libraries it needs)."""
    tok = load_run(run).tok
    ids = {b: tok.encode_src(prompts(b)) for b in BATCHES}
    if len({len(x) for b in BATCHES for x in ids[b]}) != 1:
        raise SystemExit("the prompts must all be one length in tokens (a character model gives that)")
    precisions = ["float32"] + (["bf16"] if fast_bf16(device) else [])
    names = [f"attnkit {p}" for p in precisions] + [f"attnkit compiled {p}" for p in [*precisions, "int8"]] + [
        "transformers generate"] + [f"CTranslate2 {q}" for q in exports]
    rows, warmups, reference, missing = [], [], {}, {}
    for t in threads:
        contenders: dict[str, Contender] = {}
        for name in names:  # each in its own process, at this thread count
            if name.startswith("CTranslate2") and device.type != "cpu" and not ctranslate2_runs_on(
                    exports[name.split()[-1]], device, missing, name):
                continue
            try:
                contenders[name] = Contender(build_contender, (name, run, hf, exports, t, device.type), t)
            except RuntimeError as e:
                if device.type == "cpu":
                    raise
                missing[name] = str(e)
                print(f"{name}: cannot run on {device.type}: {missing[name]}", flush=True)
        for b in BATCHES:
            for name, contender in list(contenders.items()):  # warm-up, the whole batch: compiles a compiled step
                try:
                    seconds, _ = contender(ids[b])
                except Exception as e:  # on a GPU, a contender that cannot run there is reported, not fatal
                    if device.type == "cpu":
                        raise
                    missing[name] = str(e)
                    print(f"{name}: cannot run on {device.type}: {missing[name]}", flush=True)
                    contenders.pop(name).close()
                    continue
                warmups.append({"contender": name, "threads": t, "batch": b, "seconds": seconds})
            for r in range(repeats):
                for name, contender in contenders.items():  # one at a time
                    seconds, out = contender(ids[b])
                    made = sum(len(x) for x in out)
                    if name == "attnkit float32":
                        reference.setdefault(b, out)
                    same = [x == y[: len(x)] for x, y in zip(out, reference[b], strict=True)]
                    rows.append({"contender": name, "threads": t, "batch": b, "repeat": r + 1,
                                 "tok_s": made / seconds, "tokens": made, "same_as_attnkit": sum(same) / len(same)})
                    print(f"{name}, {t} thread(s), batch {b}, pass {r + 1}: {made / seconds:.0f} tok/s "
                          f"(same greedy tokens as attnkit: {sum(same)}/{len(same)})", flush=True)
        for contender in contenders.values():
            contender.close()
    return rows, warmups, missing


# -- served ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_one(url: str, prompt: str, new_tokens: int = NEW_TOKENS) -> tuple[float, float, int]:
    """``(seconds to the first token, seconds in all, tokens)`` of one streamed greedy request, on its own
    connection of :class:`serve.RawClient` (the client shares the machine with the server, so it must cost little;
    served runs that name no ``client`` used httpx, whose parsing added milliseconds per event)."""
    from serve import RawClient
    start, first, tokens = time.perf_counter(), None, 0
    body = json.dumps({"prompt": prompt, "max_new_tokens": new_tokens, "temperature": 0, "stream": True}).encode()
    async with RawClient(url) as client:
        async for data in client.events("/generate", body):
            if b'"token"' in data and "token" in json.loads(data):
                tokens += 1
                first = first or time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start, tokens


async def served_load(port: int, texts: list[str], new_tokens: int = NEW_TOKENS
                      ) -> tuple[list[tuple[float, float, int]], float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_one(f"http://127.0.0.1:{port}", p, new_tokens) for p in texts))
    return list(results), time.perf_counter() - start


def serve_arguments(run: Path, port: int, threads: int, device: str, compiled: bool, streams: int = STREAMS
                    ) -> list[str]:
    """The ``attnkit`` arguments of the served rows' server (a running batch of up to ``streams`` rows)."""
    return ["serve", str(run), "--port", str(port), "--threads", str(threads), "--max-streams", str(2 * streams),
            "--max-batch", str(streams), "--device", device] + (["--engine", "compiled"] if compiled else [])


@contextmanager
def serving(run: Path, threads: int, device: str = "cpu", compiled: bool = False, streams: int = STREAMS
            ) -> Iterator[int]:
    """``attnkit serve RUN`` at ``threads`` threads on a free port (yielded once it answers), stopped after;
    ``compiled``: with ``--engine compiled``."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    server = subprocess.Popen([*ATTNKIT, *serve_arguments(run, port, threads, device, compiled, streams)], env=env,
                              stdout=subprocess.DEVNULL)
    try:
        import httpx
        for _ in range(600):
            if server.poll() is not None:
                raise SystemExit(f"attnkit serve exited with status {server.returncode} before answering")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit("attnkit serve did not answer within 5 minutes")
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def served(run: Path, threads: int, repeats: int, device: torch.device, compiled: bool = False,
           streams: int = STREAMS, new_tokens: int = NEW_TOKENS, texts: list[str] | None = None) -> dict:
    """One client, then ``streams`` concurrent ones, against ``attnkit serve RUN`` (``compiled``: with
    ``--engine compiled``, which compiles or loads its programs before it answers), each greedy for ``new_tokens``
    tokens after a prompt of ``texts`` (the one client's is the first; default: :func:`prompts`)."""
    texts = texts or prompts(streams)
    with serving(run, threads, device.type, compiled, streams) as port:
        asyncio.run(served_load(port, texts[:1], new_tokens))  # warm-up
        single, many = [], []
        for _ in range(repeats):
            results, _ = asyncio.run(served_load(port, texts[:1], new_tokens))
            single.append({"ttft_s": results[0][0], "tok_s": results[0][2] / results[0][1]})
            results, wall = asyncio.run(served_load(port, texts[:streams], new_tokens))
            many.append({"tok_s": sum(r[2] for r in results) / wall, "ttft_s_median": sorted(r[0] for r in results)
                         [len(results) // 2]})
            print(f"served{' compiled' if compiled else ''}, {threads} thread(s): 1 client {single[-1]['tok_s']:.0f} "
                  f"tok/s, first token {single[-1]['ttft_s'] * 1000:.1f} ms; {streams} streams "
                  f"{many[-1]['tok_s']:.0f} tok/s", flush=True)
        return {"threads": threads, "compiled": compiled, "steps": "compiled" if compiled else "eager",
                "client": CLIENT, "single": single, "streams": many}


def prompt_forward_seconds(run: Path, threads: int, device: torch.device, compiled: bool = False,
                           repeats: int = 20, prompt: str | None = None) -> float:
    """The median time of one forward pass over ``prompt`` (default: the first of :func:`prompts`;
    ``LanguageModel.step`` from an empty cache; ``compiled``: the compiled prompt pass that ``attnkit serve --engine
    compiled`` runs), its logits read back to the host as a served first token's are."""
    from attnkit.engine import to_eager
    from attnkit.engine.compiled_decoding import CompiledDecoder
    torch.set_num_threads(threads)
    loaded = load_run(run, device)
    model = to_eager(loaded.model).eval()
    forward = CompiledDecoder(model).prefill if compiled else lambda x: model.step(x, model.init_state())
    x = torch.tensor(loaded.tok.encode_src([prompt] if prompt is not None else prompts(1)), device=device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):  # the first compiles (or loads) the compiled pass
            start = time.perf_counter()
            forward(x)[0].argmax(-1).tolist()
            times.append(time.perf_counter() - start)
    return sorted(times[3:])[repeats // 2]


def measure(args: argparse.Namespace) -> dict:
    import ctranslate2
    import transformers
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="generate-race-"))
    run = args.run or train_model(work, args.updates, args.set)
    subprocess.run([*ATTNKIT, "export", str(run), "--to", "huggingface", "-o", str(work / "hf")], check=True)
    exports = {}
    for q in ("float32", "int8"):
        exports[q] = work / f"ct2-{q}"
        subprocess.run([*ATTNKIT, "export", str(run), "--to", "ctranslate2", "--quantization", q, "-o",
                        str(exports[q])], check=True)
    rows, warmups, missing = offline(run, work / "hf", exports, args.threads, args.repeats, device)
    serving = [served(run, t, args.repeats, device, c) for c in (False, True) for t in args.threads
               ] if not args.no_serve else []
    forward, forward_compiled = {}, {}
    for t in args.threads:
        for c, into in ((False, forward), (True, forward_compiled)):
            with multiprocessing.get_context("spawn").Pool(1) as pool:  # a fresh process: no other library's threads
                into[str(t)] = pool.apply(prompt_forward_seconds, (run, t, device, c))
    cfg = load_run(run).cfg.model.transformer
    command = " ".join(["python benchmarks/generate_race.py", *sys.argv[1:]])
    gpu = {"device": "cuda", "gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    return {**stamp(), "cpu": cpu_model(), **gpu, "bf16": fast_bf16(device), "torch": torch.__version__,
            "transformers": transformers.__version__, "ctranslate2": ctranslate2.__version__,
            "command": command, "not_run": missing,
            "model": {"layers": cfg.decoder_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
                      "parameters": sum(p.numel() for p in load_run(run).model.parameters())},
            "new_tokens": NEW_TOKENS, "prompt_chars": PROMPT_CHARS, "offline": rows, "warmups": warmups,
            "served": serving,
            "prompt_forward_s": forward, "prompt_forward_compiled_s": forward_compiled}


def fast_bf16(device: torch.device) -> bool:
    """Whether bfloat16 is a contender: a GPU that supports it, or a CPU with AVX512-BF16 / AMX."""
    return torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_fast_bf16()


def best(rows: list[dict], name: str, batch: int) -> tuple[float, list[float], int]:
    """``(best median tok/s over thread counts, that count's passes, its threads)`` of one contender."""
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["contender"] == name and r["batch"] == batch:
            by.setdefault(r["threads"], []).append(r["tok_s"])
    t = max(by, key=lambda k: sorted(by[k])[len(by[k]) // 2])
    passes = by[t]
    return sorted(passes)[len(passes) // 2], passes, t


def fastest_attnkit(run: dict) -> float | None:
    """The fastest attnkit contender's tokens/s at batch 1 (its best thread count), the headline."""
    rates = [best(run["offline"], n, 1)[0] for n in {r["contender"] for r in run["offline"]
                                                     if r["contender"].startswith("attnkit") and r["batch"] == 1}]
    return max(rates) if rates else None


def markdown_table(runs: list[dict]) -> str:
    """Tokens/s of each contender (best thread count, every pass), ratios, served; one table per run."""
    out = []
    for run in runs:
        rows, names = run["offline"], list(dict.fromkeys(r["contender"] for r in run["offline"]))
        # the columns of ratios: attnkit float32, and the compiled contenders of runs that have them
        yardsticks = ["attnkit float32"] + [n for n in ("attnkit compiled float32", "attnkit compiled int8")
                                            if n in names]
        compiled = len(yardsticks) > 1
        table = []
        for b in BATCHES:
            ours = [best(rows, n, b)[0] for n in yardsticks]
            for name in names:
                if not any(r["contender"] == name and r["batch"] == b for r in rows):
                    continue  # it could not run at this batch size (the run's not_run says why)
                rate, passes, t = best(rows, name, b)
                same = min(r["same_as_attnkit"] for r in rows if r["contender"] == name and r["batch"] == b)
                table.append([b, name, t, f"{rate:.0f}", " / ".join(f"{p:.0f}" for p in passes)]
                             + [f"{x / rate:.2f}x" for x in ours] + [f"{same:.0%}"])
        out.append(markdown(["batch", "contender", "threads", "tok/s (median)", "every pass"]
                            + [f"{n} is" for n in yardsticks] + ["same greedy tokens as attnkit float32"], table,
                            "rllrr" + "r" * len(yardsticks) + "r"))
        if compiled:
            first = {}
            for w in run["warmups"]:
                if "compiled" in w["contender"]:
                    first.setdefault(w["contender"], []).append(w["seconds"])
            if first:
                out.append("Compiling (each compiled contender's warm-up pass, at each thread count and batch size): "
                           + "; ".join(f"{name} {min(x):.0f} to {max(x):.0f} s" for name, x in first.items()) + ".")
        if run["served"]:
            offline32 = {False: best(rows, "attnkit float32", 32)[0]}
            if any(r["contender"] == "attnkit compiled float32" and r["batch"] == 32 for r in rows):
                offline32[True] = best(rows, "attnkit compiled float32", 32)[0]
            served_rows = []
            compiled_forward = run.get("prompt_forward_compiled_s", {})
            for s in run["served"]:
                forward = run["prompt_forward_s"][str(s["threads"])]
                ttft = sorted(x["ttft_s"] for x in s["single"])[len(s["single"]) // 2]
                rate = sorted(x["tok_s"] for x in s["streams"])[len(s["streams"]) // 2]
                other = compiled_forward.get(str(s["threads"]))
                steps = s.get("steps") == "compiled"  # earlier servers compiled their prompts only
                offline = offline32.get(steps, offline32[False])
                server = "compiled" if steps else "compiled prompts" if s.get("compiled") else "eager"
                served_rows.append([s["threads"], server,
                                    f"{ttft * 1000:.1f} ms", f"{forward * 1000:.1f} ms", f"{ttft / forward:.2f}x",
                                    f"{other * 1000:.1f} ms" if other else "-",
                                    f"{ttft / other:.2f}x" if other else "-",
                                    f"{rate:.0f}", f"{rate / offline:.2f}x"])
            out.append(markdown(["threads", "server", "first token, 1 client", "forward pass (eager)", "ratio",
                                 "forward pass (compiled)", "ratio", f"{STREAMS} streams tok/s",
                                 "of the offline batch 32 (same engine)"], served_rows, "rlrrrrrrr"))
            out.append(f"Streaming client: {run['served'][0].get('client', 'httpx')}.")
        m = run["model"]
        where = f"GPU: {run['gpu']} (host CPU {run['cpu']}; bf16: " if run.get("gpu") else f"CPU: {run['cpu']} (bf16: "
        not_run = "".join(f" {name} did not run there ({why})." for name, why in run.get("not_run", {}).items())
        out.append(f"Model: {m['layers']} layers x {m['d_model']}, {m['heads']} heads, {m['parameters']:,} "
                   f"parameters; greedy, {run['new_tokens']} new tokens. {where}"
                   f"{'yes' if run['bf16'] else 'no, so attnkit bf16 is not a contender'}).{not_run} {measured(run)}.")
    return "\n\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a task: lm run (default: train configs/shakespeare-char.yaml briefly)")
    p.add_argument("--updates", type=int, default=300, help="updates of the model trained without --run")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-serve", action="store_true", help="only the offline race")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where every contender runs (cuda: written to results/generate-race-gpu.json)")
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for the model trained without --run (e.g. model.transformer.d_model=768)")
    args = p.parse_args()
    result = measure(args)
    out = OUT_GPU if args.device == "cuda" else OUT
    append_run(out, result, args.note)
    print(markdown_table([result]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
