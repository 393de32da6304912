"""Training throughput, peak memory and share of the CPU's matmul peak: attnkit vs real peers.

    python benchmarks/throughput.py --setup-peers    # once: the peers' own virtual environment
    python benchmarks/throughput.py --time 60        # every contender, fp32 and bf16, `small`
    python benchmarks/throughput.py --time 60 --model base --contenders attnkit

**Contenders**, each in its own subprocess, one after the other (never concurrently), so the peak
RSS (from ``wait4``) is its own: Hugging Face ``MarianMTModel`` trained by
``../shared/bench/marian_reference.py`` (fp32 and bf16 autocast), the plain ``torch.nn.Transformer``
loop ``../shared/bench/torch_reference.py`` (fp32 and bf16 autocast), fairseq's ``transformer``
(fp32, when it installs beside the pinned torch; otherwise a ``skipped`` row saying why) and
attnkit's real training step (``Trainer.train_step``). All train the `small` Transformer (d_model
256, 4 heads, ff 1024, 3+3 layers, joint 8k SentencePiece unigram vocabulary, tied embeddings) on
Multi30k de->en with length-bucketed batches of about 4,000 real target tokens, label smoothing
0.1 and Adam. The budgets count differently: the shared scripts' ``--max-tokens`` (4096) counts
padded *target* positions; attnkit's ``train.max_tokens`` counts padded positions of the *longer*
side (rounded to ``train.pad_multiple``), as fairseq does, so ``--attnkit-max-tokens 4800`` gives
it about as many target tokens per update (the JSON gives every contender's ``tok_per_update``).
Target tokens/s are counted after ``--warmup-updates`` untimed updates. The peers run with the
python of the separate environment ``--setup-peers`` made (``--peers-venv``, default
``~/.cache/attnkit-peers``), never with the project's dependencies; the torch loop needs only
torch and sentencepiece and runs with this python. ``--model base`` (d_model 512, 8 heads, ff
2048, 6+6) is attnkit only: the shared scripts have the `small` dimensions built in.

**Matmul peak**: a child times ``torch.mm`` of 2048^3 and 4096^3 float32 and bfloat16 matrices
(best of several), at the contenders' thread count, before and after the contenders; the best
figure per dtype is the peak.

**FLOPs** (:func:`forward_matmul_flops`): matmuls only, 2 FLOPs per multiply-add, embeddings,
norms, softmax and the loss excluded; per layer the Q/K/V/output projections (the cross
attention's K/V over the source tokens, in every decoder layer), QK^T and AV, the FFN, then the
output projection over the vocabulary; backward = 2x forward, so an update is 3x the forward.
They are counted over the *real* tokens of each sentence (attention over S_i x S_i, T_i x T_i --
the full square, not the causal half -- and T_i x S_i), i.e. the useful work, the same yardstick
for every contender however much padding it computes. attnkit's child sums the real lengths of the
batches it timed; the shared scripts print only their target tokens per update, so a peer's
update is taken as its target tokens times the training set's per-target-token averages (source
tokens, S^2, T^2 and S*T per target token, from attnkit's tokenization of the same text; the
peers train their own 8k unigram model on it and sample their batches from the whole epoch,
so this is their mean update up to tokenizer differences). attnkit's ``gflops_executed`` also
counts its padded positions (its output layer scores real positions only).

Appends the run to ``benchmarks/results/throughput.json`` (``throughput-base.json`` for ``--model base``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tables import append_run, cpu_info, markdown, measured, num

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REFERENCE = SHARED / "bench" / "torch_reference.py"
MARIAN = SHARED / "bench" / "marian_reference.py"
PEERS_VENV = Path.home() / ".cache" / "attnkit-peers"
PEERS_STATUS = "attnkit-peers.json"  # in the peers' venv: what --setup-peers installed, and fairseq's fate
TORCH = "torch==2.13.0"  # always pinned: an unpinned torch pulls a multi-GB CUDA build
PEER_PACKAGES = (TORCH, "sentencepiece", "transformers==5.23.0")  # 5.23 supports torch 2.13
FAIRSEQ = "fairseq==0.12.2"  # the last release; no wheel for Python 3.11, so pip builds the sdist
FAIRSEQ_BUILD = ("setuptools", "wheel", "cython", "numpy")  # its build needs, without build isolation
FAIRSEQ_MINUTES = 15

# --contenders key -> the name in the table. Every contender but attnkit is a peer.
CONTENDERS = {"marian": "HF MarianMTModel", "torch": "torch.nn.Transformer reference",
              "fairseq": "fairseq transformer", "attnkit": "attnkit"}
TARGETS = {"small": {"tok_per_s_ratio_to_best_peer": 3.0, "peak_rss_gb_bf16": 2.0, "fraction_of_bf16_peak": 0.35},
           "base": {"fraction_of_bf16_peak": 0.40}}


@dataclass(frozen=True)
class ModelDims:
    d_model: int
    n_heads: int
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    vocab: int = 8000

    def overrides(self) -> list[str]:
        """attnkit config overrides that give ``configs/multi30k-de-en.yaml`` these dimensions."""
        t = "model.transformer"
        return [f"{t}.d_model={self.d_model}", f"{t}.n_heads={self.n_heads}", f"{t}.d_ff={self.d_ff}",
                f"{t}.encoder_layers={self.encoder_layers}", f"{t}.decoder_layers={self.decoder_layers}",
                f"data.tokenizer.vocab_size={self.vocab}"]


MODELS = {"small": ModelDims(256, 4, 1024, 3, 3), "base": ModelDims(512, 8, 2048, 6, 6)}


@dataclass(frozen=True)
class Lengths:
    """The sums over one update's sentences that its matmul FLOPs depend on.

    ``S_i`` / ``T_i``: source / target positions of sentence ``i`` (``x </s>``, ``<s> y``);
    ``scored``: rows of the output projection (default: ``tgt``).
    """

    src: float  # sum S_i
    tgt: float  # sum T_i
    src_sq: float  # sum S_i^2
    tgt_sq: float  # sum T_i^2
    src_tgt: float  # sum S_i T_i
    scored: float | None = None

    def per_target(self) -> Lengths:
        """The same sums per target token (``tgt`` = 1)."""
        return Lengths(*(v / self.tgt for v in (self.src, self.tgt, self.src_sq, self.tgt_sq, self.src_tgt)))

    def times(self, factor: float) -> Lengths:
        return Lengths(*(v * factor for v in (self.src, self.tgt, self.src_sq, self.tgt_sq, self.src_tgt)),
                       None if self.scored is None else self.scored * factor)


def forward_matmul_flops(dims: ModelDims, n: Lengths) -> float:
    """Matmul FLOPs of one forward pass of the encoder-decoder over ``n`` (2 per multiply-add).

    Encoder layer: Q, K, V, output projections ``4 * 2 S d^2``; ``QK^T`` and ``AV`` ``2 * 2 d sum S_i^2``;
    FFN ``2 * 2 S d ff``. Decoder layer: the same for self attention over T; cross attention's Q and
    output projections over T and K, V over S ``2 * 2 (T + S) d^2``, ``QK^T``/``AV`` ``2 * 2 d sum S_i T_i``;
    FFN. Then the output projection ``2 N d V`` over the ``N`` scored rows. Embeddings, norms, softmax
    and the loss are not counted; heads do not change the count.
    """
    d, ff = dims.d_model, dims.d_ff
    encoder = 8 * n.src * d * d + 4 * d * n.src_sq + 4 * n.src * d * ff
    decoder = (8 * n.tgt * d * d + 4 * d * n.tgt_sq + 4 * (n.tgt + n.src) * d * d + 4 * d * n.src_tgt
               + 4 * n.tgt * d * ff)
    scored = n.tgt if n.scored is None else n.scored
    return dims.encoder_layers * encoder + dims.decoder_layers * decoder + 2 * scored * d * dims.vocab


def training_flops(dims: ModelDims, n: Lengths) -> float:
    """One update's matmul FLOPs: forward + backward, the backward counted as twice the forward."""
    return 3 * forward_matmul_flops(dims, n)


# --------------------------------------------------------------------------------------
# The children
# --------------------------------------------------------------------------------------


def attnkit_trainer(precision: str, max_tokens: int, overrides: list[str], model: str = "small"):
    """attnkit's Trainer for ``configs/multi30k-de-en.yaml`` on the shared data at ``model``'s dimensions."""
    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig
    from attnkit.training.trainer import Trainer

    data = SHARED / "data" / "multi30k"
    cfg = load_config(RunConfig, ROOT / "configs" / "multi30k-de-en.yaml",
                      [f"train.precision={precision}", f"train.max_tokens={max_tokens}", "train.progress=false",
                       f"data.train={data}/train.de.gz", f"data.train_tgt={data}/train.en.gz",
                       f"data.valid={data}/val.de.gz", f"data.valid_tgt={data}/val.en.gz",
                       *MODELS[model].overrides(), *overrides])
    return Trainer(cfg, tempfile.mkdtemp(prefix="attnkit_tp_"), log=lambda m: print(m, flush=True))


def training_lengths(trainer):
    """(source, target) lengths of every training pair of attnkit's task, as the model reads them."""
    import numpy as np

    task = trainer.task
    return tuple(a.astype(np.float64) for a in type(task).lengths(task.src, task.tgt))


def batch_lengths(lengths, batch, pad_multiple: int = 0) -> Lengths:
    """:class:`Lengths` of the pairs ``batch`` of :func:`training_lengths`; with ``pad_multiple``, of the
    padded batch the model computes (its output layer scores the real targets only)."""
    import numpy as np

    index = np.asarray(batch)
    s, t = lengths[0][index], lengths[1][index]
    real = Lengths(s.sum(), t.sum(), (s * s).sum(), (t * t).sum(), (s * t).sum())
    if not pad_multiple:
        return real
    rows = len(index)
    sp, tp = (-(-float(x.max()) // pad_multiple) * pad_multiple for x in (s, t))  # as attnkit.common.numeric.round_up
    return Lengths(rows * sp, rows * tp, rows * sp * sp, rows * tp * tp, rows * sp * tp, scored=real.tgt)


def add(a: Lengths, b: Lengths) -> Lengths:
    return Lengths(a.src + b.src, a.tgt + b.tgt, a.src_sq + b.src_sq, a.tgt_sq + b.tgt_sq, a.src_tgt + b.src_tgt,
                   None if a.scored is None else a.scored + (b.scored or 0.0))


def corpus_per_target(trainer) -> Lengths:
    """The training set's :class:`Lengths` per target token (for the peers' mean update)."""
    lengths = training_lengths(trainer)
    return batch_lengths(lengths, range(len(lengths[0]))).per_target()


def attnkit_worker(precision: str, seconds: float, warmup: int, max_tokens: int, overrides: list[str],
                   model: str) -> None:
    """Runs in the child: the real attnkit training step (Trainer.train_step) on Multi30k."""
    trainer = attnkit_trainer(precision, max_tokens, overrides, model)
    step, tokens, updates, t_start, epoch = 0, 0, 0, None, 0
    real, padded = Lengths(0, 0, 0, 0, 0), Lengths(0, 0, 0, 0, 0, scored=0)
    lengths, pad_multiple = training_lengths(trainer), trainer.cfg.train.pad_multiple
    while True:
        for batch in trainer.task.batches(epoch):
            _, n_targets = trainer.train_step([batch])
            step += 1
            now = time.perf_counter()
            if step == warmup:
                t_start = now
            elif t_start is not None:
                tokens += n_targets
                updates += 1
                real = add(real, batch_lengths(lengths, batch))
                padded = add(padded, batch_lengths(lengths, batch, pad_multiple))
                if now - t_start >= seconds:
                    secs = now - t_start
                    print("RESULT " + json.dumps({
                        "tgt_tok_per_s": round(tokens / secs, 1), "updates": updates, "secs": round(secs, 1),
                        "tok_per_update": round(tokens / updates, 1), "bf16": trainer.bf16,
                        "lengths_per_update": asdict(real.times(1 / updates)),
                        "padded_per_update": asdict(padded.times(1 / updates)),
                        "corpus_per_target": asdict(corpus_per_target(trainer))}), flush=True)
                    return
        epoch += 1


def stats_worker(max_tokens: int, overrides: list[str]) -> None:
    """Runs in a child when attnkit is not among the contenders: the corpus averages alone."""
    trainer = attnkit_trainer("fp32", max_tokens, overrides)
    print("RESULT " + json.dumps({"corpus_per_target": asdict(corpus_per_target(trainer))}), flush=True)


def peak_worker(sizes: list[int], repeats: int) -> None:
    """Runs in a child: best ``torch.mm`` GFLOP/s per dtype over ``sizes`` (n x n @ n x n), ``repeats`` each."""
    import torch

    best = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for n in sizes:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            torch.mm(a, b)  # oneDNN builds its kernel on the first call
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.mm(a, b)
                secs = time.perf_counter() - t0
                best[name] = max(best.get(name, 0.0), 2 * n**3 / secs / 1e9)
    print("RESULT " + json.dumps({"gflops": {k: round(v, 1) for k, v in best.items()},
                                  "threads": torch.get_num_threads(), "sizes": sizes}), flush=True)


def run_child(cmd: list[str]) -> tuple[dict, float, str]:
    """Run ``cmd``; return its RESULT json, its peak RSS in GB, and its output tail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return json.loads(lines[-1][7:]), usage.ru_maxrss / 1024 / 1024, out


# --------------------------------------------------------------------------------------
# The peers' environment
# --------------------------------------------------------------------------------------


def failure_line(output: str) -> str:
    """The one line of a failed pip or python run that says why: the compiler's (or ninja's) error if there
    is one, else the last exception or ``ERROR:`` line; pip's temporary build directories cut from paths."""
    lines = [re.sub(r"/tmp/pip-[^/\s]+/[^/\s]+/", "", ln.strip()) for ln in output.splitlines() if ln.strip()]
    patterns = (r"(ninja|fatal|\.\w+:\d+:\d+): error", r"^\w+(Error|Exception): ", r"\w+Error: ", r"^(ERROR|error):")
    for pattern in patterns:
        hits = [ln for ln in lines if re.search(pattern, ln) and "This error originates" not in ln]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


def setup_peers(venv: Path) -> dict:
    """Create ``venv`` with the peers (pinned torch, sentencepiece, transformers) and try fairseq there.

    Writes and returns the venv's status file: the installed versions and, for fairseq, either
    ``{"ok": true}`` or the one line saying why it did not install or import.
    """
    print(f"creating {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pins = venv / "constraints.txt"
    pins.write_text(TORCH + "\n")  # no step, nor a package's build, may replace the pinned torch
    env = {**os.environ, "PIP_CONSTRAINT": str(pins)}
    subprocess.run([python, "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True, env=env)
    versions = subprocess.run([python, "-c", "import json, torch, transformers, sentencepiece as s; print(json.dumps("
                               "{'torch': torch.__version__, 'transformers': transformers.__version__, "
                               "'sentencepiece': s.__version__}))"], check=True, capture_output=True, text=True)
    status = {**json.loads(versions.stdout), "fairseq": {"ok": False, "package": FAIRSEQ}}
    print(f"installed {status}; trying {FAIRSEQ} (at most {FAIRSEQ_MINUTES} min) ...", flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *FAIRSEQ_BUILD], check=True, env=env)
    try:  # built against the installed torch: an isolated build would fetch another one
        pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-build-isolation", FAIRSEQ], env=env,
                             capture_output=True, text=True, timeout=FAIRSEQ_MINUTES * 60)
        if pip.returncode != 0:
            status["fairseq"]["reason"] = "pip install failed: " + failure_line(pip.stdout + pip.stderr)
        else:
            probe = subprocess.run([python, "-c", "import fairseq.models.transformer"], capture_output=True, text=True)
            if probe.returncode != 0:
                status["fairseq"]["reason"] = "installed but import fails: " + failure_line(probe.stderr)
            else:
                status["fairseq"] = {"ok": True, "package": FAIRSEQ}
    except subprocess.TimeoutExpired:
        status["fairseq"]["reason"] = f"pip install did not finish in {FAIRSEQ_MINUTES} min"
    (venv / PEERS_STATUS).write_text(json.dumps(status, indent=2) + "\n")
    print(f"wrote {venv / PEERS_STATUS}: fairseq {status['fairseq']}", flush=True)
    return status


def peers_status(venv: Path) -> dict | None:
    path = venv / PEERS_STATUS
    return json.loads(path.read_text()) if path.exists() else None


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def best_peer(rows: list[dict]) -> dict | None:
    """The fastest measured row that is not attnkit (any precision), or None."""
    peers = [r for r in rows if r["contender"] != "attnkit" and r.get("tgt_tok_per_s")]
    return max(peers, key=lambda r: r["tgt_tok_per_s"], default=None)


def score(rows: list[dict], dims: ModelDims, corpus: Lengths | None, peak: dict[str, float]) -> None:
    """Add FLOPs per update, achieved GFLOP/s, fraction of peak and ratio to the best peer to every measured row."""
    best = best_peer(rows)
    for r in rows:
        if "tgt_tok_per_s" not in r:
            continue
        n = Lengths(**r["lengths_per_update"]) if "lengths_per_update" in r else corpus.times(r["tok_per_update"])
        r["flops_counted_from"] = ("the timed batches' real lengths" if "lengths_per_update" in r
                                   else "target tokens x training-set averages")
        r["gflop_per_update"] = round(training_flops(dims, n) / 1e9, 2)
        updates_per_s = r["tgt_tok_per_s"] / r["tok_per_update"]
        r["gflops"] = round(r["gflop_per_update"] * updates_per_s, 1)
        r["fraction_of_peak"] = round(r["gflops"] / peak[r["precision"]], 4)
        if "padded_per_update" in r:
            executed = training_flops(dims, Lengths(**r["padded_per_update"]))
            r["gflops_executed"] = round(executed / 1e9 * updates_per_s, 1)
        r["ratio_to_best_peer"] = round(r["tgt_tok_per_s"] / best["tgt_tok_per_s"], 2) if best else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time", type=float, default=120.0, help="measured seconds per contender")
    p.add_argument("--warmup-updates", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=4096, help="the shared scripts' budget (padded target tokens)")
    p.add_argument("--attnkit-max-tokens", type=int, default=4800,
                   help="attnkit's train.max_tokens (padded tokens of the longer side); see above")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for attnkit, e.g. train.pad_multiple=4")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=None,
                   help="default: all for small, attnkit for base")
    p.add_argument("--peers-venv", type=Path, default=PEERS_VENV, help="the peers' virtual environment")
    p.add_argument("--setup-peers", action="store_true", help="create --peers-venv, then exit")
    p.add_argument("--peak-sizes", nargs="+", type=int, default=[2048, 4096])
    p.add_argument("--out", default=None, help="default: benchmarks/results/throughput[-base].json")
    p.add_argument("--worker", choices=["fp32", "bf16", "peak", "stats"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "peak":
        return peak_worker(args.peak_sizes, 5)
    if args.worker == "stats":
        return stats_worker(args.attnkit_max_tokens, args.set)
    if args.worker:
        return attnkit_worker(args.worker, args.time, args.warmup_updates, args.max_tokens, args.set, args.model)
    if args.setup_peers:
        setup_peers(args.peers_venv.expanduser())
        return
    contenders = args.contenders or (list(CONTENDERS) if args.model == "small" else ["attnkit"])
    if args.model != "small" and set(contenders) - {"attnkit"}:
        sys.exit("--model base: attnkit only (the shared scripts have the small dimensions built in)")
    if "torch" in contenders and not REFERENCE.exists():
        sys.exit(f"{REFERENCE} is missing: this benchmark needs ../shared beside the repository")
    peers = peers_status(args.peers_venv.expanduser())
    if {"marian", "fairseq"} & set(contenders) and peers is None:
        sys.exit(f"no peers environment at {args.peers_venv}: run `python benchmarks/throughput.py --setup-peers`")
    peer_python = str(args.peers_venv.expanduser() / "bin" / "python")
    shared = ["--time", str(args.time), "--warmup-updates", str(args.warmup_updates), "--max-tokens",
              str(args.max_tokens)]
    peak_cmd = [sys.executable, __file__, "--worker", "peak", "--peak-sizes", *map(str, args.peak_sizes)]

    sys.path.insert(0, str(ROOT / "src"))
    from attnkit.common.measure import stamp

    stamped = stamp()  # the checkout measured is the one the children start from
    print("measuring the matmul peak ...", flush=True)
    peaks = [run_child(peak_cmd)[0]]
    rows, corpus = [], None
    for precision in args.precisions:
        for key in contenders:
            row = {"contender": CONTENDERS[key], "precision": precision}
            bf16 = ["--bf16"] if precision == "bf16" else []
            if key == "fairseq":
                if precision != "fp32":
                    continue  # its --bf16 means a TPU
                reason = peers["fairseq"].get("reason", "it installs, but this benchmark has no fairseq runner yet")
                rows.append({**row, "skipped": reason})
                continue
            cmd = {"marian": [peer_python, str(MARIAN), *shared, *bf16],
                   "torch": [sys.executable, str(REFERENCE), *shared, *bf16],
                   "attnkit": [sys.executable, __file__, "--worker", precision, "--model", args.model, "--time",
                               str(args.time), "--warmup-updates", str(args.warmup_updates), "--max-tokens",
                               str(args.attnkit_max_tokens), "--set", *args.set]}[key]
            print(f"running {row['contender']} ({precision}) ...", flush=True)
            result, rss_gb, _ = run_child(cmd)
            row.update({k: result[k] for k in ("tgt_tok_per_s", "tok_per_update", "updates")},
                       peak_rss_gb=round(rss_gb, 2))
            if key == "attnkit":
                row.update(lengths_per_update=result["lengths_per_update"],
                           padded_per_update=result["padded_per_update"])
                corpus = Lengths(**result["corpus_per_target"])
            rows.append(row)
    if corpus is None and any("tgt_tok_per_s" in r for r in rows):
        print("tokenizing the training set for the FLOP counts ...", flush=True)
        corpus = Lengths(**run_child([sys.executable, __file__, "--worker", "stats", "--attnkit-max-tokens",
                                      str(args.attnkit_max_tokens), "--set", *args.set])[0]["corpus_per_target"])
    print("measuring the matmul peak again ...", flush=True)
    peaks.append(run_child(peak_cmd)[0])
    peak = {k: max(run["gflops"][k] for run in peaks) for k in ("fp32", "bf16")}
    dims = MODELS[args.model]
    score(rows, dims, corpus, peak)

    print(f"\nmatmul peak GFLOP/s: fp32 {peak['fp32']:,.0f}, bf16 {peak['bf16']:,.0f}")
    print(f"{'contender':<32} {'prec':<5} {'tgt tok/s':>10} {'tok/upd':>8} {'x best peer':>11} {'RSS GB':>7} "
          f"{'GFLOP/s':>8} {'of peak':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['contender']:<32} {r['precision']:<5} skipped: {r['skipped']}")
            continue
        print(f"{r['contender']:<32} {r['precision']:<5} {r['tgt_tok_per_s']:>10.0f} {r['tok_per_update']:>8.0f} "
              f"{r['ratio_to_best_peer'] or float('nan'):>11.2f} {r['peak_rss_gb']:>7.2f} {r['gflops']:>8.0f} "
              f"{r['fraction_of_peak']:>8.1%}")
    import torch

    best = best_peer(rows)
    name = "throughput.json" if args.model == "small" else f"throughput-{args.model}.json"
    out = Path(args.out or ROOT / "benchmarks" / "results" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    append_run(out, {
        **stamped, "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_info(),
        "model": args.model,
        "dims": asdict(dims), "measured_seconds": args.time, "max_tokens": args.max_tokens,
        "attnkit_max_tokens": args.attnkit_max_tokens, "peers": peers,
        "matmul_peak_gflops": peak, "matmul_peak_runs": peaks,
        "corpus_per_target": asdict(corpus) if corpus else None,
        "best_peer": f"{best['contender']} {best['precision']}" if best else None, "rows": rows,
        "command": " ".join(["python", "benchmarks/throughput.py", *sys.argv[1:]]),
        "targets": TARGETS[args.model]})
    print(f"wrote {out}")


# --------------------------------------------------------------------------------------
# The README table
# --------------------------------------------------------------------------------------


def target_text(run: dict, row: dict) -> str:
    """The targets of attnkit's bf16 row (older runs: the ratio to the reference's fp32)."""
    if row["contender"] != "attnkit" or row["precision"] != "bf16":
        return ""
    t = run["targets"]
    parts = []
    if "tok_per_s_ratio_to_best_peer" in t:
        parts.append(f">= {t['tok_per_s_ratio_to_best_peer']:g}x")
    if "tok_per_s_ratio_to_reference_fp32" in t:
        parts.append(f">= {t['tok_per_s_ratio_to_reference_fp32']:g}x the reference's fp32")
    if "peak_rss_gb_bf16" in t:
        parts.append(f"<= {t['peak_rss_gb_bf16']:g} GB")
    if "fraction_of_bf16_peak" in t:
        parts.append(f">= {t['fraction_of_bf16_peak']:.0%} of peak")
    return ", ".join(parts)


def cpu_text(cpu: dict | None) -> str:
    if not cpu:
        return "CPU not recorded"
    bf16 = "AMX-BF16" if cpu.get("amx_bf16") else "AVX512-BF16, no AMX" if cpu.get("avx512_bf16") else "no bf16 units"
    return f"{cpu.get('model')}, {bf16}"


def model(run: dict) -> list[tuple[str, dict]]:
    """The race of each model size (``small``, ``base``)."""
    return [(f"`{run.get('model', 'small')}`", run)]


def attnkit_bf16(run: dict) -> float | None:
    """attnkit's bf16 target tokens/s, the headline."""
    return next((r["tgt_tok_per_s"] for r in run["rows"] if r["contender"] == "attnkit" and r["precision"] == "bf16"
                 and "tgt_tok_per_s" in r), None)


def markdown_table(runs: list[dict]) -> str:
    """Each run newest first, one row per contender, then a line per run that measured the matmul peak: the peak,
    the CPU and why a contender was skipped.

    Older runs lack the matmul peak (blank GFLOP/s) and the model (`small`), and give the ratio to the
    reference loop's fp32 speed that their targets were set in.
    """
    rows, notes = [], []
    for run in sorted(runs, key=lambda r: r["date"], reverse=True):
        best = best_peer(run["rows"])  # as score() found it
        peak = run.get("matmul_peak_gflops")
        if peak:
            skipped = "".join(f"; {r['contender']} skipped: {r['skipped']}" for r in run["rows"] if "skipped" in r)
            notes.append(f"- {measured(run)}, {run.get('model', 'small')}: matmul peak fp32 {num(peak['fp32'])} / "
                         f"bf16 {num(peak['bf16'])} GFLOP/s at {run['threads']} threads ({cpu_text(run.get('cpu'))})"
                         f"{skipped}.")
        for r in run["rows"]:
            ours_bf16 = r["contender"] == "attnkit" and r["precision"] == "bf16"
            bold = (lambda text: f"**{text}**") if ours_bf16 else (lambda text: text)
            head = [measured(run), run.get("model", "small"), r["contender"], r["precision"]]
            if "skipped" in r:
                rows.append([*head, "", "", "", "", "", "skipped (below)", ""])
                continue
            if "ratio_to_reference_fp32" in r:  # older runs: the ratio they were made for
                ratio = f"{r['ratio_to_reference_fp32']:.2f}x ref. fp32"
            else:
                ratio = f"{r['tgt_tok_per_s'] / best['tgt_tok_per_s']:.2f}x" if best else ""
            of_peak = (f"{r['fraction_of_peak']:.1%} of {num(peak[r['precision']])}"
                       if peak and "fraction_of_peak" in r else "")
            rows.append([*head, num(r["tgt_tok_per_s"]), bold(ratio) if ratio else "",
                         bold(f"{r['peak_rss_gb']:.2f}"), num(r["gflops"]) if "gflops" in r else "",
                         bold(of_peak) if of_peak else "",
                         f"{run['measured_seconds']:g} s, {run['threads']} threads, ~{num(r['tok_per_update'])}",
                         target_text(run, r)])
    table = markdown(["measured", "model", "contender", "precision", "target tok/s", "x best peer", "peak RSS GB",
                      "GFLOP/s", "of the matmul peak (GFLOP/s)", "timed, threads, target tokens per update",
                      "target"], rows, "llllrrrrrll")
    return table + ("\n\n" + "\n".join(notes) if notes else "")


if __name__ == "__main__":
    main()
