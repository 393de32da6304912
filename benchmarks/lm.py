"""attnkit's language model against nanoGPT on tiny Shakespeare, characters, on this CPU: loss, speed, sampling.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT        # once: the peer, any recent commit
    python benchmarks/lm.py --nanogpt /tmp/nanoGPT                    # every row (about 50 minutes)
    python benchmarks/lm.py --nanogpt /tmp/nanoGPT --rows throughput sampling
    python benchmarks/lm.py --nanogpt /tmp/nanoGPT --smoke --out /tmp/lm-smoke.json   # every row, tiny: minutes

nanoGPT is not part of this repository and nothing of it is kept here: any checkout or copy of its files will do
(``model.py``, ``train.py``, ``configurator.py``, ``config/train_shakespeare_char.py``); the script writes its data
into the copy's ``data/`` and names the copy's commit when it is a git checkout.

Both learn the same task: the 65 characters of ``../shared/data/shakespeare/input.txt``, trained on its first
90% and validated on the last 10% (nanoGPT's ``data/shakespeare_char/prepare.py`` split, written here into
``data/attnkit_shakespeare_char/`` of the nanoGPT checkout: its ``train.bin``, ``val.bin`` and ``meta.pkl``).
nanoGPT runs its own ``train.py`` on the CPU in float32 with ``--compile=False``, with this project's Python
and torch; attnkit runs ``attnkit train``. One contender at a time, on the same threads.

Both are **scored the same way**: the mean cross-entropy of every character of the whole validation split, in
non-overlapping windows of the model's block size (:func:`attnkit.inference.language_model.score_stream`;
nanoGPT's checkpoint loaded with its own ``model.py``). nanoGPT's own estimate (``eval_iters`` random
batches) is noisier and is not used.

Rows (``--rows``):

* ``documented``: nanoGPT's documented CPU command (4 layers, 4 heads, 128 wide, block 64, batch 12, 2,000
  iterations), timed; then ``attnkit train configs/shakespeare-char.yaml`` for the same training time, once with
  the config's model (sized for 15 minutes) and once with the documented command's model, batch and rates.
* ``budget``: both for ``--minutes`` (15) of training, each with its best known settings: attnkit with
  ``configs/shakespeare-char.yaml``; nanoGPT with :data:`NANOGPT_BEST_15` (the better of the two settings in
  ``shared/docs/PERF-NOTES.md``), its ``max_iters`` set from its measured time per iteration so that it trains
  for about as long (nanoGPT has no time budget).
* ``hour``: attnkit alone with ``configs/shakespeare-char-hour.yaml`` for 60 minutes (not in the default rows;
  ``--set KEY=VALUE`` overrides its settings).
* ``throughput``: training tokens/s at equal shape (:data:`SHAPES`): nanoGPT's ``train_shakespeare_char`` (6 layers,
  6 heads, 384 wide, block 256, batch 64) and its best 15-minute settings (4 layers, 4 heads, 192 wide, block 128,
  batch 16), after warm-up iterations; attnkit with ``precision: auto`` as its config has it.
* ``sampling``: tokens/s generating 256 new tokens after a one-token prompt at batch 1 and 32, the same shape
  (block 512 so the 257 positions fit both models' tables), random weights: attnkit with its key/value cache,
  nanoGPT's ``GPT.generate``, which runs the whole context again for every token.

Each attnkit row records the precision attnkit chose under ``precision: auto`` (its training log's first line).
The run records issue 55's targets (:func:`targets`): attnkit ahead of nanoGPT at equal wall time (the budget row's
validation loss), and at least 1.5x nanoGPT's tokens/s at each equal shape. ``--smoke`` runs every row at tiny
sizes, for a test that the script works, not for a result (write it elsewhere with ``--out``).

Writes ``benchmarks/results/lm.json`` with the CPU model, threads and precision.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from attnkit.common.measure import stamp  # noqa: E402
from attnkit.runs.layout import PRECISION_FILE  # noqa: E402
from nbsvm import cpu_model  # noqa: E402  (benchmarks/ is on sys.path when this script runs)
from tables import markdown, measured, num  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
CONFIG = ROOT / "configs" / "shakespeare-char.yaml"
HOUR_CONFIG = ROOT / "configs" / "shakespeare-char-hour.yaml"
OUT = ROOT / "benchmarks" / "results" / "lm.json"
OUT_GPU = ROOT / "benchmarks" / "results" / "lm-gpu.json"  # --device cuda
DATASET = "attnkit_shakespeare_char"
#: nanoGPT's README, "I only have a macbook": the documented CPU command.
DOCUMENTED = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
              "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
              "--lr_decay_iters=2000", "--dropout=0.0"]
#: The throughput row's shapes: nanoGPT's train_shakespeare_char config, and its best 15-minute settings
#: (:data:`NANOGPT_BEST_15`).
SHAPES = {"train_shakespeare_char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64),
          "15-minute": dict(n_layer=4, n_head=4, n_embd=192, block_size=128, batch_size=16)}
THROUGHPUT_SHAPE = SHAPES["train_shakespeare_char"]
#: ``--smoke``: every shape and count shrunk so that all rows run in minutes (most of it starting processes).
SMOKE_SHAPE = dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4)


def prepare_nanogpt_data(nanogpt: Path) -> Path:
    """nanoGPT's ``shakespeare_char/prepare.py``, on the shared file: returns the validation text's path."""
    text = DATA.read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = len(text)
    out = nanogpt / "data" / DATASET
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", text[: int(n * 0.9)]), ("val", text[int(n * 0.9):])):
        np.array([stoi[c] for c in part], dtype=np.uint16).tofile(out / f"{name}.bin")
    with open(out / "meta.pkl", "wb") as f:  # what nanoGPT's train.py reads for its vocabulary size
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    (out / "val.txt").write_text(text[int(n * 0.9):], encoding="utf-8")
    return out / "val.txt"


def run_timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, str]:
    """Run ``cmd``; returns (wall seconds, its output), which is also written to ``log``."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - start
    log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return seconds, proc.stdout + proc.stderr


def nanogpt_train(nanogpt: Path, out_dir: Path, args: list[str], logs: Path, name: str, score: bool = True) -> dict:
    """nanoGPT's ``train.py`` with ``args``; its last checkpoint (saved at its last evaluation, which ``args`` must
    put at the last iteration) scored on the whole validation split."""
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--dataset={DATASET}",
           f"--out_dir={out_dir}", "--always_save_checkpoint=True", *args]
    seconds, output = run_timed(cmd, nanogpt, logs / f"{name}.log")
    iter_ms = [float(m) for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", output, re.M)]
    return {"command": " ".join(cmd[1:]), "wall_seconds": round(seconds, 1),
            "train_seconds": round(sum(iter_ms) / 1000, 1), "iterations": len(iter_ms),
            "median_iteration_ms": round(float(np.median(iter_ms[len(iter_ms) // 2:])), 1),
            "valid_loss": score_nanogpt(nanogpt, out_dir / "ckpt.pt") if score else None}


@torch.inference_mode()
def score_nanogpt(nanogpt: Path, ckpt_path: Path) -> float:
    """The mean cross-entropy of every validation character after the first, windows of its block size."""
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model.py
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.eval()
    ids = torch.from_numpy(np.fromfile(nanogpt / "data" / DATASET / "val.bin", dtype=np.uint16).astype(np.int64))
    block = ckpt["model_args"]["block_size"]
    total, n = 0.0, 0
    for s in range(0, len(ids) - 1, block):
        x, y = ids[s: s + block], ids[s + 1: s + block + 1]
        x = x[: len(y)]
        logits, _ = model(x[None], y[None])  # with targets nanoGPT returns every position's logits
        total += torch.nn.functional.cross_entropy(logits[0].float(), y, reduction="sum").item()
        n += len(y)
    return total / n


def attnkit_train(run_dir: Path, overrides: list[str], val: Path, logs: Path, name: str, config: Path = CONFIG
                  ) -> dict:
    """``attnkit train`` of ``config`` with ``overrides``, then ``attnkit evaluate`` on the split."""
    cmd = [sys.executable, "-m", "attnkit", "train", str(config), "--run-dir", str(run_dir), *overrides]
    seconds, output = run_timed(cmd, ROOT, logs / f"{name}.log")
    updates = re.findall(r"trained (\d+) updates in ([\d.]+) min", output)
    _, scored = run_timed([sys.executable, "-m", "attnkit", "evaluate", str(run_dir), "--data", str(val)], ROOT,
                          logs / f"{name}-evaluate.log")
    loss = float(re.search(r"loss ([\d.]+) nats/token", scored).group(1))
    return {"command": "attnkit " + " ".join(cmd[3:]).replace(str(ROOT) + "/", ""), "wall_seconds": round(seconds, 1),
            "updates": int(updates[-1][0]) if updates else None,
            "train_seconds": round(float(updates[-1][1]) * 60, 1) if updates else None, "valid_loss": loss,
            "validations": validations(run_dir), "precision": recorded_precision(run_dir)}


def recorded_precision(run_dir: Path) -> dict | None:
    """What the run trained in and why (its ``precision.json``: ``precision: auto`` measures per host)."""
    path = run_dir / PRECISION_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def attnkit_precisions(rows: list[dict]) -> str:
    """The precisions attnkit's rows trained in, as their runs recorded them: ``float32``, ``bf16``, or both
    (``float32`` where no row trained: the sampling row's models are float32)."""
    chosen = sorted({r["precision"]["precision"] for r in rows if r.get("precision")})
    return " and ".join(chosen) or "float32"


def validations(run_dir: Path) -> list[list[float]]:
    """The run's validations during training, ``[update, minutes, valid loss]`` each (its ``metrics.jsonl``)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [[m["step"], m["minutes"], m["valid_loss"]] for m in rows if "valid_loss" in m]


#: attnkit with the documented command's model and batch: 4 layers, 4 heads, 128 wide, block 64, 12 blocks a batch,
#: nanoGPT's learning rates and schedule.
DOCUMENTED_SHAPE = ["model.transformer.decoder_layers=4", "model.transformer.n_heads=4",
                    "model.transformer.d_model=128", "model.transformer.d_ff=512", "data.block_size=64",
                    "model.transformer.max_len=64", "train.max_tokens=768", "model.transformer.dropout=0.0",
                    "train.lr=1e-3", "train.warmup=100"]
#: nanoGPT's better of two settings tried for 15 minutes on these machines (shared/docs/PERF-NOTES.md): the config's
#: width and block, 16 blocks a batch, no dropout, its own learning rates (1e-3 to 1e-4) and AdamW.
NANOGPT_BEST_15 = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--n_layer=4",
                   "--n_head=4", "--n_embd=192", "--block_size=128", "--batch_size=16", "--warmup_iters=100",
                   "--dropout=0.0"]


@dataclass(frozen=True)
class Sizes:
    """How much each row runs: the race's own (:data:`FULL`) or ``--smoke``'s (:data:`SMOKE`).

    :param documented: nanoGPT's documented command.
    :param nanogpt: settings after every other nanoGPT training's own (a smaller model).
    :param attnkit: config overrides after every other attnkit training's own.
    :param shapes: the throughput row's shapes, by name.
    :param iterations: the throughput row's timed and warm-up iterations on a CPU.
    :param probe: the iterations that time nanoGPT before the budget row.
    :param new_tokens: the sampling row's tokens.
    """

    documented: list[str]
    nanogpt: list[str]
    attnkit: list[str]
    shapes: dict[str, dict]
    iterations: tuple[int, int]
    probe: int
    new_tokens: int


FULL = Sizes(DOCUMENTED, [], [], SHAPES, (8, 3), 30, 256)
SMOKE = Sizes([*DOCUMENTED, "--max_iters=10", "--lr_decay_iters=10", "--eval_interval=10", "--eval_iters=2"],
              [f"--{k}={v}" for k, v in SMOKE_SHAPE.items()] + ["--eval_iters=2"],
              ["model.transformer.decoder_layers=1", "model.transformer.n_heads=2", "model.transformer.d_model=32",
               "model.transformer.d_ff=128", "data.block_size=32", "model.transformer.max_len=32",
               "train.max_tokens=128", "train.valid_every=1000000"],
              {"smoke": SMOKE_SHAPE}, (2, 1), 4, 8)


def row_documented(nanogpt: Path, val: Path, work: Path, sizes: Sizes = FULL) -> list[dict]:
    """nanoGPT's documented CPU command; attnkit for as long, with the config's model and with nanoGPT's."""
    ng = nanogpt_train(nanogpt, work / "ng-documented", [*sizes.documented, *sizes.nanogpt], work,
                       "nanogpt-documented")
    budget = f"train.max_minutes={ng['train_seconds'] / 60:.3f}"
    ak = attnkit_train(work / "ak-documented", [budget, *sizes.attnkit], val, work, "attnkit-documented")
    same = attnkit_train(work / "ak-documented-shape", [budget, *DOCUMENTED_SHAPE, *sizes.attnkit], val, work,
                         "attnkit-documented-shape")
    return [{"row": "documented", "contender": "nanoGPT", **ng}, {"row": "documented", "contender": "attnkit", **ak},
            {"row": "documented", "contender": "attnkit, nanoGPT's model and batch", **same}]


def row_budget(nanogpt: Path, val: Path, work: Path, minutes: float, sizes: Sizes = FULL) -> list[dict]:
    """Both for about ``minutes`` of training, each with its best known settings for 15 minutes: nanoGPT's
    :data:`NANOGPT_BEST_15` for as many iterations as a probe of its iteration time says fit, then attnkit's config
    for as long as nanoGPT trained (equal wall time)."""
    probe = nanogpt_train(nanogpt, work / "ng-probe", [*NANOGPT_BEST_15, *sizes.nanogpt, f"--max_iters={sizes.probe}",
                                                       f"--eval_interval={sizes.probe}"],
                          work, "nanogpt-probe", score=False)
    per_iter = probe["median_iteration_ms"] / 1000  # the second half's median: past the slow first iterations
    iters = max(int(minutes * 60 / per_iter), 1)
    schedule = [f"--max_iters={iters}", f"--lr_decay_iters={iters}", f"--eval_interval={iters}"]
    ng = nanogpt_train(nanogpt, work / "ng-budget", [*NANOGPT_BEST_15, *sizes.nanogpt, *schedule], work,
                       "nanogpt-budget")
    ak = attnkit_train(work / "ak-budget", [f"train.max_minutes={ng['train_seconds'] / 60:.3f}", *sizes.attnkit], val,
                       work, "attnkit-budget")
    return [{"row": "budget", "contender": "nanoGPT", **ng}, {"row": "budget", "contender": "attnkit", **ak}]


def row_hour(val: Path, work: Path, threads: int, settings: list[str]) -> list[dict]:
    """attnkit alone for an hour (``configs/shakespeare-char-hour.yaml`` with ``settings``), against the bar of
    nanoGPT's README result for its ``train_shakespeare_char`` model on an A100 GPU."""
    extra = [*([f"train.threads={threads}"] if threads else []), *settings]
    ak = attnkit_train(work / "ak-hour", extra, val, work, "attnkit-hour", config=HOUR_CONFIG)
    return [{"row": "hour", "contender": "attnkit", "threads": threads or torch.get_num_threads(), **ak}]


def row_throughput(nanogpt: Path, work: Path, device: str = "cpu", sizes: Sizes = FULL) -> list[dict]:
    """Training tokens/s at each of ``sizes.shapes``: nanoGPT's median iteration after warm-up, attnkit's updates
    between two runs. On a GPU (``device`` cuda) both in bf16 (nanoGPT's ``--dtype``, attnkit's ``precision:
    auto``), and nanoGPT twice: eager, as attnkit trains, and compiled, its default there."""
    iters, warmup = sizes.iterations if device == "cpu" else (100, 20)  # a GPU update is milliseconds
    rows = []
    for shape_name, s in sizes.shapes.items():
        rows += throughput_at(nanogpt, work, device, shape_name, s, iters, warmup)
    return rows


def throughput_at(nanogpt: Path, work: Path, device: str, shape_name: str, s: dict, iters: int, warmup: int
                  ) -> list[dict]:
    """:func:`row_throughput` at one shape ``s``."""
    tokens = s["batch_size"] * s["block_size"]
    rows = []
    for compiled in ([False] if device == "cpu" else [False, True]):
        args = [f"--device={device}", f"--compile={compiled}", "--eval_iters=1", "--eval_interval=1000000",
                "--log_interval=1", *[f"--{k}={v}" for k, v in s.items()], f"--max_iters={iters + warmup}",
                "--dropout=0.0", *(["--dtype=bfloat16"] if device == "cuda" else [])]
        name = f"nanogpt-throughput-{shape_name}" + ("-compiled" if compiled else "")
        try:
            _, output = run_timed([sys.executable, "train.py", "config/train_shakespeare_char.py",
                                   f"--dataset={DATASET}", f"--out_dir={work / name}", *args], nanogpt,
                                  work / f"{name}.log")
        except SystemExit as e:  # torch.compile needs a working triton; eager nanoGPT is the row that must run
            if not compiled:
                raise
            rows.append({"row": "throughput", "contender": "nanoGPT, compiled", "not_run": str(e), "device": device,
                         "shape_name": shape_name})
            continue
        ms = [float(m) for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", output, re.M)][warmup:]
        rows.append({"row": "throughput", "contender": "nanoGPT, compiled" if compiled else "nanoGPT",
                     "tok_s": round(tokens / (float(np.median(ms)) / 1000)), "shape": s, "shape_name": shape_name,
                     "device": device})
    overrides = [f"model.transformer.decoder_layers={s['n_layer']}", f"model.transformer.n_heads={s['n_head']}",
                 f"model.transformer.d_model={s['n_embd']}", f"model.transformer.d_ff={4 * s['n_embd']}",
                 f"data.block_size={s['block_size']}", f"model.transformer.max_len={s['block_size']}",
                 f"train.max_tokens={tokens}", "train.max_minutes=0", "train.valid_every=1000000",
                 "model.transformer.dropout=0.0"]
    times, precision = [], None
    attnkit_iters = iters if device == "cpu" else 25 * iters  # on a GPU: enough updates to outweigh startup noise
    for n in (warmup, warmup + attnkit_iters):  # the difference of two runs: startup and validation cancel out
        run_dir = work / f"ak-throughput-{shape_name}-{n}"
        cmd = [sys.executable, "-m", "attnkit", "train", str(CONFIG), "--run-dir", str(run_dir), *overrides,
               f"train.max_updates={n}"]
        seconds, output = run_timed(cmd, ROOT, work / f"attnkit-throughput-{shape_name}-{n}.log")
        times.append(seconds)
        precision = recorded_precision(run_dir)
    ak = tokens * attnkit_iters / (times[1] - times[0])
    return [*rows, {"row": "throughput", "contender": "attnkit", "tok_s": round(ak), "shape": s,
                    "shape_name": shape_name, "device": device, "precision": precision}]


def targets(rows: list[dict]) -> list[dict]:
    """Issue 55's targets against nanoGPT, on the rows measured: attnkit's validation loss below nanoGPT's at equal
    wall time (the budget row), and attnkit at >= 1.5x nanoGPT's (eager) tokens/s at each equal shape."""
    out = []
    budget = {r["contender"]: r for r in rows if r["row"] == "budget"}
    if {"attnkit", "nanoGPT"} <= budget.keys():
        ours, theirs = budget["attnkit"]["valid_loss"], budget["nanoGPT"]["valid_loss"]
        out.append({"target": "ahead at equal wall time (validation loss, budget row)", "attnkit": ours,
                    "nanogpt": theirs, "met": ours < theirs})
    speed = {(r["shape_name"], r["contender"]): r["tok_s"] for r in rows
             if r["row"] == "throughput" and "tok_s" in r and "shape_name" in r}
    for shape_name in dict.fromkeys(k[0] for k in speed):
        if (shape_name, "attnkit") in speed and (shape_name, "nanoGPT") in speed:
            ratio = speed[shape_name, "attnkit"] / speed[shape_name, "nanoGPT"]
            out.append({"target": f">= 1.5x nanoGPT's tokens/s at its {shape_name} shape", "ratio": ratio,
                        "bar": 1.5, "met": ratio >= 1.5})
    return out


@torch.inference_mode()
def row_sampling(nanogpt: Path, batches: tuple[int, ...] = (1, 32), new_tokens: int = 256,
                 s: dict = THROUGHPUT_SHAPE) -> list[dict]:
    """Tokens/s generating ``new_tokens`` after a one-token prompt, batch 1 and 32, random weights of shape ``s``."""
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig

    from attnkit.lm import LanguageModel
    from attnkit.sampling import generate
    from attnkit.transformer import TransformerConfig
    torch.manual_seed(0)
    ng = GPT(GPTConfig(block_size=512, vocab_size=65, n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"],
                       dropout=0.0, bias=False)).eval()
    ours = LanguageModel(TransformerConfig(d_model=s["n_embd"], n_heads=s["n_head"], d_ff=4 * s["n_embd"],
                                           decoder_layers=s["n_layer"], dropout=0.0, max_len=512, bias=False,
                                           activation="gelu", scale_embeddings=False), 69)
    from attnkit.engine import to_eager
    to_eager(ours).eval()
    rows = []
    for batch in batches:
        prompt = torch.full((batch, 1), 10, dtype=torch.long)
        start = time.perf_counter()
        ng.generate(prompt, new_tokens, temperature=1.0)
        ng_s = time.perf_counter() - start
        start = time.perf_counter()
        steps = sum(1 for _ in generate(ours, prompt, new_tokens, temperature=1.0, ignore_eos=True))
        ak_s = time.perf_counter() - start
        if steps != new_tokens:
            raise SystemExit(f"attnkit generated {steps} tokens, not {new_tokens}")
        rows += [{"row": "sampling", "contender": "nanoGPT", "batch": batch, "tok_s": round(batch * new_tokens / ng_s)},
                 {"row": "sampling", "contender": "attnkit", "batch": batch, "tok_s": round(batch * new_tokens / ak_s)}]
    return rows


def shape_words(s: dict) -> str:
    """``6 layers x 384, block 256, batch 64``."""
    return f"{s['n_layer']} layers x {s['n_embd']}, block {s['block_size']}, batch {s['batch_size']}"


def _what(run: dict, r: dict) -> str:
    """A row's measurement in words."""
    return {"documented": "nanoGPT's documented CPU command; attnkit for the same time",
            "budget": f"{run['minutes']:g} minutes of training each",
            "hour": f"60 minutes of training, {r.get('threads')} thread(s)",
            "throughput": f"training tokens/s, {shape_words(r.get('shape', THROUGHPUT_SHAPE))}"
                          + (" (GPU)" if r.get("device") == "cuda" else ""),
            "sampling": f"sampling tokens/s, batch {r.get('batch')} (float32)"}[r["row"]]


def row(run: dict) -> list[tuple[str, dict]]:
    """The races in one run, one per measurement (:func:`_what`): each with the run's rows of it alone."""
    parts: dict[str, list[dict]] = {}
    for r in run["rows"]:
        parts.setdefault(_what(run, r), []).append(r)
    return [(what, {**run, "rows": rows, "targets": [t for t in run.get("targets") or [] if {
        "budget": "ahead", "throughput": ">="}.get(rows[0]["row"]) == t["target"].split()[0]]})
        for what, rows in parts.items()]


def attnkit_figure(run: dict) -> tuple[str, float | None]:
    """The headline: attnkit's validation loss (training rows) or its tokens/s over nanoGPT's (speed rows)."""
    ours = next((r for r in run["rows"] if r["contender"] == "attnkit"), None)
    theirs = next((r for r in run["rows"] if r["contender"] == "nanoGPT"), None)
    if ours is not None and "valid_loss" in ours:
        return "attnkit's validation loss", ours["valid_loss"]
    fast = ours is not None and theirs is not None and "tok_s" in ours and "tok_s" in theirs
    return "attnkit's tokens/s over nanoGPT's", ours["tok_s"] / theirs["tok_s"] if fast else None


def markdown_table(runs: list[dict]) -> str:
    """Every row of ``runs`` (each run's rows of one measurement, :func:`row`), with where and when it ran; then
    issue 55's targets as judged in those runs."""
    rows: list[list[str]] = []
    judged: list[tuple[dict, str]] = []
    for run in runs:
        threads = f"{run['threads']} thread" + ("s" if run["threads"] != 1 else "")
        where = f"{run['gpu']}, torch {run['torch']}" if run.get("gpu") else f"{run['cpu']}, {threads}"
        for r in run["rows"]:
            if r["row"] in ("documented", "budget", "hour"):
                steps = r.get("iterations") or r.get("updates")
                value = f"valid loss **{r['valid_loss']:.4f}** ({steps:,} updates, {r['train_seconds'] / 60:.1f} min)"
                if r.get("validations"):  # where the best checkpoint came from, and how the last validation ended
                    best = min(r["validations"], key=lambda v: v[2])
                    value += f", lowest validation at update {best[0]:,} ({best[1]:.0f} min)"
            elif "not_run" in r:
                value = f"not measured: {r['not_run']}"
            else:
                value = f"{num(r['tok_s'])} tok/s"
            chose = ""  # what precision: auto chose
            if r.get("precision"):
                onednn = " through oneDNN" if r["precision"].get("onednn") else ""
                chose = f" ({r['precision']['precision']}{onednn})"
            rows.append([_what(run, r), r["contender"] + chose, value, where, measured(run)])
        for t in run.get("targets") or []:  # a run's targets, once, however many of its measurements are shown
            if (t, where) not in judged:
                judged.append((t, where))
    out = markdown(["measurement", "contender", "result", "host", "measured"], rows)
    if judged:
        out += "\n\nTargets: " + "; ".join(
            f"{t['target']} ({where}): " + (f"{t['ratio']:.2f}x" if "ratio" in t else
                                            f"{t['attnkit']:.4f} against {t['nanogpt']:.4f}")
            + (" (met)" if t["met"] else " (**not met**)") for t, where in judged) + "."
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (see the module docstring)")
    p.add_argument("--rows", nargs="+", default=["documented", "budget", "throughput", "sampling"],
                   choices=["documented", "budget", "hour", "throughput", "sampling"],
                   help="which rows (default: all but hour, which takes an hour by itself)")
    p.add_argument("--threads", type=int, default=0,
                   help="the hour row's train.threads (default 0: torch's default)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for the hour row (e.g. model.transformer.dropout=0.2)")
    p.add_argument("--minutes", type=float, default=15.0, help="the budget row's training minutes")
    p.add_argument("--sampling-batches", type=int, nargs="+", default=[1, 32],
                   help="the sampling row's batch sizes (default 1 32)")
    p.add_argument("--note", default="", help="a line kept with the run (e.g. what else ran on the machine)")
    p.add_argument("--work", type=Path, default=None, help="where runs and logs go (default: a temporary folder)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the throughput row on the GPU, both in bf16, into results/lm-gpu.json")
    p.add_argument("--smoke", action="store_true", help="every row at tiny sizes, to see that the script works")
    p.add_argument("--out", type=Path, help="the results file (default results/lm.json, or lm-gpu.json on a GPU)")
    args = p.parse_args(argv)
    if args.device == "cuda" and (args.rows != ["throughput"] or not torch.cuda.is_available()):
        raise SystemExit("--device cuda runs --rows throughput alone, where torch sees a GPU")
    out = args.out or (OUT_GPU if args.device == "cuda" else OUT)
    sizes = SMOKE if args.smoke else FULL
    if not (args.nanogpt / "model.py").exists() or not (args.nanogpt / "train.py").exists():
        raise SystemExit(f"{args.nanogpt}: not a nanoGPT checkout (no model.py / train.py)")
    work = args.work or Path(tempfile.mkdtemp(prefix="attnkit-lm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    val = prepare_nanogpt_data(args.nanogpt)
    started = time.time()
    rows: list[dict] = []
    top = subprocess.run(["git", "-C", str(args.nanogpt), "rev-parse", "--show-toplevel"], capture_output=True,
                         text=True).stdout.strip()
    nanogpt_commit = None  # a copy without its own .git (inside another repository, say) has no commit to name
    if top and Path(top).resolve() == args.nanogpt.resolve():
        nanogpt_commit = subprocess.run(["git", "-C", str(args.nanogpt), "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip() or None
    for name in args.rows:
        print(f"row {name} ...", flush=True)
        rows += {"documented": lambda: row_documented(args.nanogpt, val, work, sizes),
                 "budget": lambda: row_budget(args.nanogpt, val, work, args.minutes, sizes),
                 "hour": lambda: row_hour(val, work, args.threads, args.set),
                 "throughput": lambda: row_throughput(args.nanogpt, work, args.device, sizes),
                 "sampling": lambda: row_sampling(args.nanogpt, tuple(args.sampling_batches), sizes.new_tokens,
                                                  next(iter(sizes.shapes.values())))}[name]()
        print(json.dumps([r for r in rows if r["row"] == name], indent=1), flush=True)
        result = {**stamp(), "cpu": cpu_model(), "threads": torch.get_num_threads(),
                  "precision": "nanoGPT float32 (its CPU path); attnkit "
                               + attnkit_precisions(rows) + " (precision: auto, measured per run)",
                  **({"device": "cuda", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "precision": "nanoGPT bf16 (--dtype=bfloat16); attnkit bf16 (precision: auto)"}
                     if args.device == "cuda" else {}),
                  "command": "python benchmarks/lm.py --nanogpt NANOGPT " + " ".join(
                      (["--rows", *args.rows] if args.rows != p.get_default("rows") else [])
                      + ([f"--minutes {args.minutes:g}"] if args.minutes != 15 else [])
                      + ([f"--threads {args.threads}"] if args.threads else [])
                      + (["--set", *args.set] if args.set else [])
                      + (["--sampling-batches", *map(str, args.sampling_batches)]
                         if args.sampling_batches != [1, 32] else [])
                      + (["--device", args.device] if args.device != "cpu" else [])
                      + (["--smoke"] if args.smoke else [])),
                  "nanogpt_commit": nanogpt_commit, "minutes": args.minutes,
                  "started": round(started), "run_seconds": round(time.time() - started), "rows": rows,
                  "targets": targets(rows),
                  **({"note": args.note} if args.note else {})}
        # read again before each write: another run (on another core) may have written its rows meanwhile
        runs = json.loads(out.read_text(encoding="utf-8"))["runs"] if out.exists() else []
        runs = [r for r in runs if r.get("started") != result["started"]]
        out.write_text(json.dumps({**{k: result[k] for k in ("date", "commit")}, "runs": [*runs, result]}, indent=2)
                       + "\n", encoding="utf-8")  # after every row: a failure later loses nothing measured
    print(markdown_table([result]))
    return 0 if all(math.isfinite(r.get("valid_loss", 0.0)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
