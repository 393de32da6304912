"""The generation race on real sizes: attnkit in every mode against transformers, CTranslate2 and llama.cpp, beside
the speed limit that this host's memory bandwidth sets.

    pip install --no-binary llama-cpp-python llama-cpp-python      # once, for the llama.cpp contenders
    flock /tmp/attnkit-bench.lock python benchmarks/generation_race.py
    flock /tmp/attnkit-bench.lock python benchmarks/generation_race.py --models smollm2 --llama ~/SmolLM2-135M

**Models** (``--models``):

* ``smollm2``: a random-weight Llama of SmolLM2-135M's shape (``benchmarks/smollm2_shape.py``: 30 layers, 576 wide,
  grouped-query 9/3, vocabulary 49,152; built once into ``WORK/cache/``), or with ``--llama DIR`` a Hugging Face
  Llama-family directory of the user's (a real SmolLM2-135M, say). ``attnkit import`` makes it a run; transformers
  and llama.cpp's converter read the directory itself.
* ``race``: the 4-layer race model of ``generate_race.py`` (``configs/shakespeare-char.yaml`` with blocks of 256,
  trained ``--updates`` updates into ``WORK/cache/``, or ``--run``); ``attnkit export --to huggingface`` makes the
  directory that transformers and the converter read.

Both are exported with ``attnkit export --to ctranslate2`` in float32 and int8, and converted to GGUF in F32, F16
and Q8_0 by the converter llama-cpp-python's source package vendors (``benchmarks/llama_cpp_peer.py``), so every
contender holds the same weights. A contender that cannot run on a model (an export or a conversion refused, a
mode that fails) gets a ``not_run`` entry with the reason, and the race goes on.

**Workload**: greedy decoding of ``--new-tokens`` (128) tokens after prompts of :data:`PROMPT_TOKENS` tokens cut from
tiny Shakespeare's validation part (the last 10%), at batch 1 and 32 (``--batches``; 32 different prompts), at 1 and
2 threads (``--threads``). Every contender runs in a process of its own, one at a time: started, warmed up with the
whole batch (which compiles a compiled step) and timed ``--repeats`` times at each batch size, then ended, so that
one copy of the model is in memory at a time. A row reports each contender at its best thread count with every pass.

**Contenders** (:func:`contenders`): attnkit in every mode of the engine switch (:func:`attnkit_decoder`: engine
``reference``, ``eager``, ``compiled``; weights float32, bf16, int8), transformers' ``generate`` (float32),
CTranslate2 float32 and int8, llama.cpp F32, F16 and Q8_0. The bf16 contenders run where the CPU has bf16 units
(AVX512-BF16 or AMX), or with ``--bf16``.

**Agreement**: every contender's greedy tokens (mapped to the Hugging Face model's ids) are compared with the first
attnkit float32 contender's (the reference engine's, the run's ``yardstick``): the share of rows that are equal, and
the share of tokens before each row's first difference. Rounding (bf16, int8) may turn a greedy choice between two
nearly equal tokens; on a real model, so may the end-of-text token, which transformers' ``min_new_tokens`` bans where
the others choose it and go on.

**The limit** (``benchmarks/bandwidth.py``): at batch 1 every weight is read once per token, so the host's read
bandwidth (measured here, the best of the thread counts) over the bytes of the weights read per token, in each
contender's weight format, bounds its tokens/s; each batch-1 row gives its share of that limit.

**Targets** (issue 55, :data:`TARGETS`), judged on the best attnkit mode of each weight format and written into the
run: at batch 1, attnkit >= llama.cpp and >= CTranslate2 at the same weight precision, >= 2x transformers, int8 at
>= 0.8 of the bandwidth limit; at batch 32, >= CTranslate2 float32.

Writes every run to ``benchmarks/results/generation-race.json`` (``--out``); :func:`markdown_table` renders runs, and
``benchmarks/report.py`` shows the latest of each model on each host kind with the count and spread of the runs.
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

import bandwidth  # noqa: E402
import llama_cpp_peer  # noqa: E402
import smollm2_shape  # noqa: E402
from attnkit.common.measure import stamp  # noqa: E402
from attnkit.data.tokenizer import Tokenizer  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from generate_race import Contender, prompt_forward_seconds, served, train_model  # noqa: E402
from tables import append_run, cpu_info, host_kind, markdown, measured, num  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "generation-race.json"
TEXT = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
WORK = Path.home() / ".cache" / "attnkit" / "races"
ATTNKIT = [sys.executable, "-m", "attnkit"]
PROMPT_TOKENS, NEW_TOKENS, BATCHES = 64, 128, (1, 32)
#: The engine switch's modes raced: (engine, weight format); int8 is ``--precision float32 --quantize int8``, which
#: the reference (the textbook's float layers) has not.
ATTNKIT_MODES = [("reference", "float32"), ("reference", "bf16")] + [
    (engine, weights) for engine in ("eager", "compiled") for weights in ("float32", "bf16", "int8")]


@dataclass(frozen=True)
class Spec:
    """One contender: ``kind`` attnkit / transformers / ctranslate2 / llama.cpp, the weight format it decodes with
    (:data:`bandwidth.FORMATS`), and the ids it reads and writes: ``attnkit`` (the run's, for attnkit and its
    CTranslate2 export) or ``original`` (the Hugging Face model's, for transformers and llama.cpp)."""

    name: str
    kind: str
    weights: str
    ids: str
    engine: str = ""
    path: str = ""  # the run, the Hugging Face directory, the export or the GGUF it reads


@dataclass
class RaceModel:
    """A model prepared for every contender: ``run`` (attnkit), ``hf`` (transformers, the converter), ``exports``
    (CTranslate2, by quantization), ``ggufs`` (llama.cpp, by weight type); ``not_run``: contenders that cannot run
    on it, with why."""

    name: str
    source: str
    run: Path
    hf: Path
    exports: dict[str, Path] = field(default_factory=dict)
    ggufs: dict[str, Path] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)


# -- the contenders, each built in its own process -------------------------------------------------------------


def attnkit_decoder(run: Path, engine: str, weights: str) -> tuple[object, object]:
    """What ``attnkit generate --engine ENGINE --precision P --quantize Q`` decodes with, and how it chooses each
    token, for :func:`attnkit.sampling.generate` (``weights``: float32, bf16 or int8, which is float32 with int8
    weights): the run loaded with that :class:`~attnkit.engine.Engine`, through
    :func:`~attnkit.engine.generation_decoder`."""
    from attnkit.engine import Engine, generation_decoder

    switch = Engine(engine, "bf16" if weights == "bf16" else "float32", "int8" if weights == "int8" else "none")
    return generation_decoder(load_run(run, engine=switch).model, switch)


def build_contender(spec: Spec, threads: int, new_tokens: int):
    """``spec`` made ready to decode, in the contender's process: a function of a batch of equal-length prompts
    (ids of ``spec.ids``) that returns ``new_tokens`` greedy ids per prompt."""
    if spec.kind == "attnkit":
        from attnkit.sampling import generate
        model, choose = attnkit_decoder(Path(spec.path), spec.engine, spec.weights)

        def run_batch(ids: list[list[int]]) -> list[list[int]]:
            with torch.inference_mode():
                steps = list(generate(model, ids, new_tokens, temperature=0.0, ignore_eos=True, choose=choose))
            return torch.stack(steps, 1).tolist()  # (B, new_tokens)

        return run_batch
    if spec.kind == "transformers":
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32).eval()
        pad = hf.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else pad

        def run_batch(ids: list[list[int]]) -> list[list[int]]:
            x = torch.tensor(ids)
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
            return out[:, x.size(1):].tolist()

        return run_batch
    if spec.kind == "ctranslate2":
        from attnkit.export.ctranslate2_lm import ExportedGenerator
        engine = ExportedGenerator(spec.path, threads=threads)
        return lambda ids: engine.generate_batch(ids, new_tokens, temperature=0.0)
    greedy = llama_cpp_peer.LlamaCppGreedy(Path(spec.path), threads, PROMPT_TOKENS + new_tokens)
    return lambda ids: greedy(ids, new_tokens)


def fast_bf16() -> bool:
    """Whether this CPU has bf16 units (AVX512-BF16 or AMX), which make bf16 a contender."""
    cpu = cpu_info()
    return bool(cpu.get("amx_bf16") or cpu.get("avx512_bf16"))


def contenders(model: RaceModel, bf16: bool) -> list[Spec]:
    """Every contender of the race on ``model``, attnkit's first (the first is the agreement's yardstick); the
    CTranslate2 and llama.cpp ones read ``model``'s exports and GGUFs, once :func:`export_peers` has made them."""
    specs = [Spec(f"attnkit {engine} {weights}", "attnkit", weights, "attnkit", engine, str(model.run))
             for engine, weights in ATTNKIT_MODES if bf16 or weights != "bf16"]
    specs.append(Spec("transformers float32", "transformers", "float32", "original", path=str(model.hf)))
    specs += [Spec(f"CTranslate2 {q}", "ctranslate2", q, "attnkit", path=str(model.exports.get(q, "")))
              for q in ("float32", "int8")]
    specs += [Spec(f"llama.cpp {t}", "llama.cpp", llama_cpp_peer.WEIGHTS[t], "original",
                   path=str(model.ggufs.get(t, ""))) for t in llama_cpp_peer.GGUF_TYPES]
    return specs


# -- preparing the models ---------------------------------------------------------------------------------------


def attnkit(*args: str) -> None:
    subprocess.run([*ATTNKIT, *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def prepare_smollm2(work: Path, cache: Path, args: argparse.Namespace) -> RaceModel:
    """The SmolLM2-shaped model (built into ``cache`` once per shape and seed), or ``--llama``, imported into
    ``work``."""
    if args.llama:
        hf, source = args.llama.resolve(), f"Hugging Face directory {args.llama.name}"
    else:
        config = smollm2_shape.shape(args.shape)
        hf = smollm2_shape.build(cache / f"smollm2-shape-seed{args.seed}", config, args.seed)
        source = f"random weights of SmolLM2-135M's shape (seed {args.seed})" + (
            f", changed: {' '.join(args.shape)}" if args.shape else "")
    attnkit("import", str(hf), "-o", str(work / "run"), "--force")
    return RaceModel("smollm2", source, work / "run", hf)


def prepare_race(work: Path, cache: Path, args: argparse.Namespace) -> RaceModel:
    """The 4-layer race model (trained into ``cache`` once per ``--updates`` and ``--set``), or ``--run``, exported
    to Hugging Face into ``work``."""
    if args.run:
        run, source = args.run.resolve(), f"run {args.run}"
    else:
        folder = cache / "-".join(["race", f"u{args.updates}", *args.set]).replace("/", "_")
        run = folder / "lm"  # where train_model trains
        if not (folder / "trained").exists():
            shutil.rmtree(folder, ignore_errors=True)
            train_model(folder, args.updates, args.set)
            (folder / "trained").write_text("")
        source = f"configs/shakespeare-char.yaml, block 256, {args.updates} updates" + (
            f", changed: {' '.join(args.set)}" if args.set else "")
    attnkit("export", str(run), "--to", "huggingface", "-o", str(work / "hf"), "--force")
    return RaceModel("race", source, run, work / "hf")


def export_peers(model: RaceModel, work: Path, cache: Path, wanted: set[str]) -> None:
    """CTranslate2 exports and GGUFs of ``model`` into ``work``, for the contenders in ``wanted`` (llama.cpp's
    converter extracted into ``cache``); what cannot be made goes to ``model.not_run``."""
    for q in ("float32", "int8"):
        if f"CTranslate2 {q}" not in wanted:
            continue
        out = work / f"ct2-{q}"
        done = subprocess.run([*ATTNKIT, "export", str(model.run), "--to", "ctranslate2", "--quantization", q,
                               "-o", str(out), "--force"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode == 0:
            model.exports[q] = out
        else:
            model.not_run[f"CTranslate2 {q}"] = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1]
    types = [t for t in llama_cpp_peer.GGUF_TYPES if f"llama.cpp {t}" in wanted]
    if not types:
        return
    version = llama_cpp_peer.installed_version()
    if version is None:
        for t in types:
            model.not_run[f"llama.cpp {t}"] = "llama-cpp-python is not installed (benchmarks/README.md says how)"
        return
    script = llama_cpp_peer.converter(cache / "llama-cpp-source", version)
    for t in types:
        try:
            model.ggufs[t] = llama_cpp_peer.convert(script, model.hf, work / f"model-{t}.gguf",
                                                    llama_cpp_peer.GGUF_TYPES[t])
        except RuntimeError as e:
            model.not_run[f"llama.cpp {t}"] = str(e)


# -- the race ---------------------------------------------------------------------------------------------------


def prompt_ids(tok: Tokenizer, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` prompts of :data:`PROMPT_TOKENS` tokens from tiny Shakespeare's validation part, as the run's ids and
    as the Hugging Face model's (``Tokenizer.original_ids``; the same for a run trained here)."""
    text = TEXT.read_text(encoding="utf-8")
    tail = text[int(len(text) * 0.9):]
    width = 8 * PROMPT_TOKENS  # characters: enough for PROMPT_TOKENS tokens of any of these tokenizers
    step = (len(tail) - width) // n
    ids = [x[:PROMPT_TOKENS] for x in tok.encode_src([tail[i * step: i * step + width] for i in range(n)])]
    if any(len(x) < PROMPT_TOKENS for x in ids):
        raise SystemExit(f"a prompt of {width} characters is shorter than {PROMPT_TOKENS} tokens")
    original = tok.original_ids
    return ids, [[original[i] for i in x] for x in ids]


def agreement(out: list[list[int]], yardstick: list[list[int]]) -> tuple[float, float]:
    """``(share of rows equal to the yardstick's, share of tokens before each row's first difference)``."""
    rows = prefix = 0
    for x, y in zip(out, yardstick, strict=True):
        same = next((k for k, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        rows += x == y
        prefix += same / max(len(y), 1)
    return rows / len(out), prefix / len(out)


def race(model: RaceModel, specs: list[Spec], tok: Tokenizer, args: argparse.Namespace
         ) -> tuple[list[dict], list[dict], str | None]:
    """Every contender of ``specs`` at every thread count, one process at a time (module doc): the timed passes
    (with their agreement with the yardstick), the warm-ups and the yardstick's name; contenders that fail go to
    ``model.not_run``."""
    prompts = {b: prompt_ids(tok, b) for b in args.batches}
    original = tok.original_ids
    rows, warmups, outputs = [], [], {}
    for t in args.threads:
        for spec in specs:
            if spec.name in model.not_run:
                continue
            try:
                contender = Contender(build_contender, (spec, t, args.new_tokens), t, args.timeout)
            except RuntimeError as e:
                model.not_run[spec.name] = str(e)
                print(f"{spec.name}: cannot run: {e}", flush=True)
                continue
            try:
                for b in args.batches:
                    ids = prompts[b][0] if spec.ids == "attnkit" else prompts[b][1]
                    seconds, _ = contender(ids)  # warm-up: compiles a compiled step
                    warmups.append({"contender": spec.name, "threads": t, "batch": b, "seconds": seconds})
                    for r in range(args.repeats):
                        seconds, out = contender(ids)
                        if spec.ids == "attnkit":
                            out = [[original[i] for i in x] for x in out]
                        outputs.setdefault((spec.name, b), out)
                        made = sum(len(x) for x in out)
                        rows.append({"contender": spec.name, "weights": spec.weights, "threads": t, "batch": b,
                                     "repeat": r + 1, "tok_s": made / seconds, "tokens": made})
                        print(f"{spec.name}, {t} thread(s), batch {b}, pass {r + 1}: {made / seconds:.1f} tok/s",
                              flush=True)
            except RuntimeError as e:
                model.not_run[spec.name] = str(e)
                print(f"{spec.name}: failed: {e}", flush=True)
            finally:
                contender.close()
    yardstick = next((s.name for s in specs if s.kind == "attnkit" and s.weights == "float32"
                      and any(k[0] == s.name for k in outputs)), None)
    for row in rows:
        if yardstick is not None:
            row["same_rows"], row["same_prefix"] = agreement(outputs[row["contender"], row["batch"]],
                                                             outputs[yardstick, row["batch"]])
    return rows, warmups, yardstick


def weight_shapes(model: nn.Module) -> tuple[list[tuple[int, int]], int]:
    """The matrices a decoding step reads ``(out, in)`` (every linear layer, the output layer too) and the count of
    the other parameters it reads (norms, biases; not the embedding and position tables, of which it reads a row)."""
    matrices = [m for m in model.modules() if isinstance(m, nn.Linear)]
    read = {id(m.weight) for m in matrices}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    vectors = sum(p.numel() for p in model.parameters() if id(p) not in read and id(p) not in tables)
    return [tuple(m.weight.shape) for m in matrices], vectors


def limits(shapes: list[tuple[int, int]], vectors: int, measured_bandwidth: list[dict]) -> dict:
    """The batch-1 limit of each weight format for a model of these matrices and other parameters
    (:func:`weight_shapes`): ``{format: {"bytes_per_token", "tok_s"}}`` at the best read bandwidth measured (module
    doc)."""
    best = max(b["read_gb_s"] for b in measured_bandwidth) * 1e9
    out = {}
    for fmt in bandwidth.FORMATS:
        size = bandwidth.matrix_bytes(shapes, vectors, fmt)
        out[fmt] = {"bytes_per_token": size, "tok_s": best / size}
    return out


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def best(rows: list[dict], name: str, batch: int) -> tuple[float, list[float], int] | None:
    """``(best median tok/s over thread counts, that count's passes, its threads)`` of one contender, or None."""
    by: dict[int, list[float]] = {}
    for r in rows:
        if r["contender"] == name and r["batch"] == batch:
            by.setdefault(r["threads"], []).append(r["tok_s"])
    if not by:
        return None
    t = max(by, key=lambda k: median(by[k]))
    return median(by[t]), by[t], t


#: Issue 55's targets: (what, batch, attnkit's weight format, the peer or "limit", the bar on the ratio).
TARGETS = [
    ("attnkit >= llama.cpp at the same weights (float32)", 1, "float32", "llama.cpp F32", 1.0),
    ("attnkit >= llama.cpp at the same weights (16-bit)", 1, "bf16", "llama.cpp F16", 1.0),
    ("attnkit >= llama.cpp at the same weights (8-bit)", 1, "int8", "llama.cpp Q8_0", 1.0),
    ("attnkit >= CTranslate2 at the same weights (float32)", 1, "float32", "CTranslate2 float32", 1.0),
    ("attnkit >= CTranslate2 at the same weights (int8)", 1, "int8", "CTranslate2 int8", 1.0),
    ("attnkit >= 2x transformers", 1, "float32", "transformers float32", 2.0),
    ("attnkit int8 >= 0.8 of the bandwidth limit", 1, "int8", "limit", 0.8),
    ("attnkit >= CTranslate2 float32 at batch 32", 32, "float32", "CTranslate2 float32", 1.0),
]


def attnkit_in(name: str, weights: str) -> bool:
    """Whether contender ``name`` is attnkit in the weight format ``weights`` (any mode)."""
    return name.startswith("attnkit ") and name.endswith(f" {weights}")


def asked_for(asked: set[str] | None, weights: str, peer: str) -> bool:
    """Whether a run that raced the contenders ``asked`` (None: all of them) raced a target's sides: attnkit in
    ``weights`` and ``peer`` (``"limit"``, the bandwidth limit, is always measured)."""
    if asked is None:
        return True
    return any(attnkit_in(name, weights) for name in asked) and (peer == "limit" or peer in asked)


def judge(rows: list[dict], limit: dict, asked: set[str] | None = None) -> list[dict]:
    """Each of :data:`TARGETS` that this run asked for (a batch size it raced; attnkit in the weight format and the
    peer among the contenders ``asked``, default all): attnkit's fastest mode of the weight format against the
    peer (or the limit); a target whose attnkit mode or peer did not run is kept with ``met`` None and why."""
    out = []
    raced = {r["batch"] for r in rows}
    for what, batch, weights, peer, bar in TARGETS:
        if batch not in raced or not asked_for(asked, weights, peer):
            continue
        ours = [(b[0], name) for name in dict.fromkeys(r["contender"] for r in rows)
                if attnkit_in(name, weights) and (b := best(rows, name, batch))]
        theirs = limit[weights]["tok_s"] if peer == "limit" else (best(rows, peer, batch) or [None])[0]
        target = {"target": what, "batch": batch, "peer": peer, "bar": bar}
        if not ours or theirs is None:
            missing = f"attnkit {weights}" if not ours else peer
            out.append({**target, "attnkit": None, "ratio": None, "met": None,
                        "why": f"{missing} did not run at batch {batch}"})
            continue
        rate, name = max(ours)
        out.append({**target, "attnkit": name, "ratio": rate / theirs, "met": rate / theirs >= bar})
    return out


#: The served bars (issue 55, item 4): the first token of one client within this many forward passes of its prompt,
#: and N concurrent streams at least this share of the offline batch of N (the same engine and weights).
FIRST_TOKEN_BAR, STREAMS_BAR = 1.5, 0.8


def serve_race(model: RaceModel, tok: Tokenizer, args: argparse.Namespace
               ) -> tuple[list[dict], dict[str, float], list[int]]:
    """``attnkit serve`` on ``model``'s run with ``--engine`` :attr:`args.serve_engine`, at each thread count: one
    streaming client, then as many at once as the largest batch raced (``generate_race.served``), with the offline
    race's prompts (:func:`prompt_ids`, as text); beside it, the median time of one forward pass over the one
    client's prompt by the same engine, in a fresh process (``generate_race.prompt_forward_seconds``). Also the
    prompts' lengths in tokens as the server reads them (the text of ``PROMPT_TOKENS`` tokens, encoded again)."""
    import multiprocessing
    compiled, cpu, streams = args.serve_engine == "compiled", torch.device("cpu"), max(args.batches)
    texts = tok.decode_src(prompt_ids(tok, streams)[0])
    out, forward = [], {}
    for t in args.threads:
        out.append({**served(model.run, t, args.repeats, cpu, compiled, streams, args.new_tokens, texts),
                    "clients": streams})
        with multiprocessing.get_context("spawn").Pool(1) as pool:  # no other library's threads
            forward[str(t)] = pool.apply(prompt_forward_seconds, (model.run, t, cpu, compiled, 20, texts[0]))
    return out, forward, [len(ids) for ids in tok.encode_src(texts)]


def served_figures(run: dict, entry: dict) -> dict:
    """One served entry's figures: the median first token of one client and its ratio to the forward pass of the
    prompt at those threads; the median tokens/s of the concurrent clients and its ratio to the median of the
    offline batch of as many rows by the same engine in float32, at the same threads (None where that did not run).
    """
    ttft = median([x["ttft_s"] for x in entry["single"]])
    forward = run["prompt_forward_s"][str(entry["threads"])]
    rate = median([x["tok_s"] for x in entry["streams"]])
    passes = [r["tok_s"] for r in run["offline"] if r["contender"] == f"attnkit {entry['steps']} float32"
              and r["batch"] == entry["clients"] and r["threads"] == entry["threads"]]
    offline = median(passes) if passes else None
    return {"ttft_s": ttft, "forward_s": forward, "first_token_ratio": ttft / forward, "tok_s": rate,
            "offline_tok_s": offline, "streams_ratio": rate / offline if offline else None}


def judge_served(run: dict) -> list[dict]:
    """The served bars on each thread count's server: first token <= :data:`FIRST_TOKEN_BAR` forward passes
    (``at_most``), streams >= :data:`STREAMS_BAR` of the offline batch (``met`` None where it did not run)."""
    out = []
    for entry in run["served"]:
        f, who = served_figures(run, entry), f"attnkit serve --engine {entry['steps']}, {entry['threads']} thread(s)"
        out.append({"target": "served first token <= 1.5x a forward pass of the prompt", "batch": 1, "attnkit": who,
                    "peer": "forward pass", "bar": FIRST_TOKEN_BAR, "at_most": True, "ratio": f["first_token_ratio"],
                    "met": f["first_token_ratio"] <= FIRST_TOKEN_BAR})
        target = {"target": f"{entry['clients']} served streams >= 0.8x the offline batch", "batch": entry["clients"],
                  "attnkit": who, "peer": f"attnkit {entry['steps']} float32", "bar": STREAMS_BAR}
        if f["streams_ratio"] is None:
            out.append({**target, "ratio": None, "met": None,
                        "why": f"attnkit {entry['steps']} float32 did not run at batch {entry['clients']} "
                               f"and {entry['threads']} thread(s)"})
        else:
            out.append({**target, "ratio": f["streams_ratio"], "met": f["streams_ratio"] >= STREAMS_BAR})
    return out


def first_token_ratio(run: dict) -> float | None:
    """The headline of a served run: its best first token over a forward pass of the prompt."""
    found = [served_figures(run, e)["first_token_ratio"] for e in run.get("served", [])]
    return min(found) if found else None


def measure_model(model: RaceModel, work: Path, cache: Path, args: argparse.Namespace,
                  measured_bandwidth: list[dict]) -> dict:
    """The race on ``model``: its exports made, every contender ``--contenders`` names raced, the limits, the
    targets judged; the run's record."""
    bf16 = args.bf16 or fast_bf16()
    wanted = {s.name for s in contenders(model, True) if any(fnmatch.fnmatch(s.name, p) for p in args.contenders)}
    export_peers(model, work, cache, wanted)
    specs = [s for s in contenders(model, bf16) if s.name in wanted]
    if not bf16:
        model.not_run.update({name: "this CPU has no bf16 units (AVX512-BF16 or AMX); --bf16 races it"
                              for name in wanted if name.startswith("attnkit ") and name.endswith(" bf16")})
    loaded = load_run(model.run)  # the tokenizer, and what the limits need; not kept while the contenders run
    tok, cfg = loaded.tok, loaded.cfg.model.transformer
    shapes, vectors = weight_shapes(loaded.model)
    parameters = sum(p.numel() for p in loaded.model.parameters())
    del loaded
    rows, warmups, yardstick = race(model, specs, tok, args)
    serving, forward, lengths = serve_race(model, tok, args) if args.serve else ([], {}, [])
    import transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "llama_cpp_python": llama_cpp_peer.installed_version()}
    try:
        import ctranslate2
        versions["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        pass
    limit = limits(shapes, vectors, measured_bandwidth)
    record = {**stamp(), "cpu": cpu_info(), "bf16": bf16, **versions,
            "command": " ".join(["python benchmarks/generation_race.py", *sys.argv[1:]]),
            "model": {"name": model.name, "source": model.source, "layers": cfg.decoder_layers, "d_model": cfg.d_model,
                      "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads or cfg.n_heads, "parameters": parameters},
            "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens,
            "gguf_converter": (f"llama-cpp-python {llama_cpp_peer.installed_version()} source package: "
                               "vendor/llama.cpp/convert_hf_to_gguf.py") if model.ggufs else None,
            "bandwidth": measured_bandwidth, "limits": limit, "offline": rows, "warmups": warmups,
            "yardstick": yardstick, "not_run": model.not_run, "targets": judge(rows, limit, wanted),
            **({"served": serving, "prompt_forward_s": forward, "served_prompt_tokens": lengths} if serving else {})}
    record["targets"] += judge_served(record) if serving else []
    return record


# -- the docs' table --------------------------------------------------------------------------------------------


def model_name(run: dict) -> list[tuple[str, dict]]:
    """The race of each model (``smollm2``, ``race``)."""
    return [(f"**{run['model']['name']}**", run)]


def fastest_attnkit(run: dict) -> float | None:
    """The fastest attnkit mode's median tokens/s at batch 1 (best thread count), the headline."""
    names = {r["contender"] for r in run["offline"] if r["contender"].startswith("attnkit ")}
    found = [b[0] for n in names if (b := best(run["offline"], n, 1))]
    return max(found) if found else None


def markdown_table(runs: list[dict]) -> str:
    """Each run: tokens/s of every contender (best thread count, every pass), its share of the bandwidth limit at
    batch 1, its agreement; the targets."""
    out = []
    for run in runs:
        rows, limit = run["offline"], run["limits"]
        table = []
        for b in sorted({r["batch"] for r in rows}):
            for name in dict.fromkeys(r["contender"] for r in rows):
                found = best(rows, name, b)
                if found is None:
                    continue
                rate, passes, t = found
                mine = [r for r in rows if r["contender"] == name and r["batch"] == b]
                weights = mine[0]["weights"]
                share = f"{rate / limit[weights]['tok_s']:.2f}" if b == 1 else ""
                same = (f"{min(r['same_rows'] for r in mine):.0%} / {min(r['same_prefix'] for r in mine):.0%}"
                        if "same_rows" in mine[0] else "")
                table.append([b, name, t, num(rate, 1), " / ".join(num(p, 1) for p in passes), share, same])
        m = run["model"]
        out.append(f"**{m['name']}**: {m['source']}; {m['layers']} layers x {m['d_model']}, {m['heads']} heads "
                   f"({m['kv_heads']} key/value), {m['parameters']:,} parameters; greedy, {run['new_tokens']} new "
                   f"tokens after {run['prompt_tokens']}. {host_kind(run)}.")
        out.append(markdown(["batch", "contender", "threads", "tok/s (median)", "every pass", "of the limit",
                             f"same rows / tokens as {run['yardstick']}"], table, "rlrrrrr"))
        bw = ", ".join(f"{b['read_gb_s']:.1f} GB/s at {b['threads']} thread{'s' if b['threads'] > 1 else ''}"
                       for b in run["bandwidth"])
        formats = ", ".join(f"{fmt} {v['bytes_per_token'] / 1e6:,.1f} MB, {v['tok_s']:,.1f} tok/s"
                            for fmt, v in limit.items())
        out.append(f"The limit at batch 1: memory read {bw}; weights read per token and the limit: {formats}.")
        if run.get("served"):
            out.append(markdown_served(run))
        if run["targets"]:
            out.append(markdown(["target", "attnkit", "ratio", "bar", "met"],
                                [[t["target"], t["attnkit"] or "", "" if t["ratio"] is None else f"{t['ratio']:.2f}",
                                  f"{'<= ' if t.get('at_most') else ''}{t['bar']:g}",
                                  f"not judged: {t['why']}" if t["met"] is None else
                                  "yes" if t["met"] else "**no**"] for t in run["targets"]], "llrrl"))
        not_run = "".join(f" {name}: {why}." for name, why in run["not_run"].items())
        out.append((f"Not run:{not_run} " if not_run else "") + f"Measured {measured(run)} by `{run['command']}`.")
    return "\n\n".join(out)


def markdown_served(run: dict) -> str:
    """The served rows of ``run``: each server's first token beside a forward pass of its prompt, and its concurrent
    streams beside the offline batch of as many rows."""
    rows = []
    for e in run["served"]:
        f = served_figures(run, e)
        offline = "" if f["offline_tok_s"] is None else num(f["offline_tok_s"], 1)
        ratio = "" if f["streams_ratio"] is None else f"{f['streams_ratio']:.2f}x"
        rows.append([e["threads"], e["steps"], f"{f['ttft_s'] * 1000:.1f} ms", f"{f['forward_s'] * 1000:.1f} ms",
                     f"{f['first_token_ratio']:.2f}x", e["clients"], num(f["tok_s"], 1), offline, ratio])
    clients = run["served"][0]["client"]
    return (markdown(["threads", "`attnkit serve --engine`", "first token, 1 client (median)",
                      "forward pass of the prompt (same engine)", "ratio", "streams", "tok/s (median)",
                      "offline batch, same engine and threads (float32)", "ratio"], rows, "rlrrrrrrr")
            + f"\n\nServed: the offline race's prompts as text ({prompt_tokens(run)} tokens as the server reads them), "
            f"greedy, at most {run['new_tokens']} new tokens; each client streams on a connection of its own "
            f"({clients}).")


def prompt_tokens(run: dict) -> str:
    """The served prompts' lengths in tokens: ``64``, or ``63 to 65``."""
    low, high = min(run["served_prompt_tokens"]), max(run["served_prompt_tokens"])
    return f"{low}" if low == high else f"{low} to {high}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=["smollm2", "race"], default=["smollm2", "race"])
    p.add_argument("--llama", type=Path, help="race this Hugging Face Llama-family directory instead of the "
                                              "random-weight SmolLM2 shape")
    p.add_argument("--shape", nargs="+", default=[], metavar="KEY=VALUE",
                   help="change the SmolLM2 shape (config.json keys, e.g. num_hidden_layers=2 for a smoke run)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--run", type=Path, help="the race model: this task: lm run instead of a brief training")
    p.add_argument("--updates", type=int, default=300, help="updates of the race model trained without --run")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides of the race model")
    p.add_argument("--contenders", nargs="+", default=["*"], metavar="PATTERN",
                   help="the contenders to race, as shell patterns of their names (default: all)")
    p.add_argument("--bf16", action="store_true", help="race the bf16 contenders on a CPU without bf16 units too")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="the most seconds of one pass (warm-up included)")
    p.add_argument("--bandwidth-mb", type=int, default=bandwidth.ARRAY_MB, help="MB per array of the probe")
    p.add_argument("--work", type=Path, default=WORK, help=f"the models' cache and the exports (default {WORK})")
    p.add_argument("--keep", action="store_true", help="keep this run's imports, exports and GGUFs")
    p.add_argument("--serve", action="store_true",
                   help="also serve the model (attnkit serve): one streaming client, then as many as the largest "
                        "batch, beside a forward pass of the prompt and the offline batch (the served bars)")
    p.add_argument("--serve-engine", choices=["eager", "compiled"], default="compiled",
                   help="the engine of the served model (--engine of attnkit serve; default compiled)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    args = p.parse_args(argv)
    measured_bandwidth = bandwidth.measure(args.threads, args.bandwidth_mb)
    print("memory read: " + ", ".join(f"{b['read_gb_s']:.1f} GB/s ({b['threads']} threads)"
                                      for b in measured_bandwidth), flush=True)
    for name in args.models:
        work = args.work / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        work.mkdir(parents=True)
        try:
            model = (prepare_smollm2 if name == "smollm2" else prepare_race)(work, args.work / "cache", args)
            result = measure_model(model, work, args.work / "cache", args, measured_bandwidth)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        append_run(args.out, result, args.note)
        print(markdown_table([result]), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
