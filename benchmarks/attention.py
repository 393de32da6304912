"""Multi-head self-attention, forward + backward: attnkit vs torch.nn.MultiheadAttention vs bare SDPA.

Run from the repository root (2 cores are shared: run nothing else timed at the same time)::

    python benchmarks/attention.py            # full run, appended to benchmarks/results/attention.json
    python benchmarks/attention.py --quick    # smoke test: T in {64, 256}, few repetitions

Contenders, all with B=16, d_model=512, h=8 (d_k=64), dropout 0, modules in training mode:

- ``attnkit``         ``MultiHeadAttention(...)(x)``: fused ``F.scaled_dot_product_attention`` path.
- ``torch.nn.MHA``    ``nn.MultiheadAttention(batch_first=True)(x, x, x, need_weights=False)`` with the
                      same weights (``need_weights=False`` so torch also takes its SDPA path; torch's
                      default ``need_weights=True`` would compute explicit weights).
- ``bare SDPA``       ``F.scaled_dot_product_attention`` on pre-shaped ``(B, H, T, d_k)`` q/k/v leaves in
                      the compute dtype: no projections, no reshapes, a lower bound for the attention part.
- ``attnkit weights`` ``MultiHeadAttention(...)(x, need_weights=True)``: the explicit ``(B, H, T, T)``
                      weights path, shown to contrast the fused path's memory.

"fwd+bwd" is one forward of ``x (B, T, d_model)`` (requires grad, like an inner layer) and
``out.sum().backward()``, gradients cleared before each step. ``bf16`` runs the forward under
``torch.autocast("cpu", dtype=torch.bfloat16)`` (backward outside it, as in a training loop). The
``padding`` rows use a key padding mask with per-row lengths drawn from [T/2, T]: attnkit and bare SDPA
get a boolean ``(B, 1, 1, T)`` mask (True = may attend), torch gets ``key_padding_mask = ~keep``.

Timing: for each (T, precision, mask) all contenders are built, warmed up, then timed in interleaved
rounds (the starting contender rotates each round) so machine noise hits them alike; each sample
repeats the step enough times to last >= 50 ms; the table shows the median per-step time.

Peak memory: one fresh subprocess per (contender, T, precision), unmasked. It builds the module and
inputs, records ``VmRSS`` as baseline, resets the kernel's RSS high-water mark (``echo 5 >
/proc/self/clear_refs``), runs two fwd+bwd steps and reports ``VmHWM - baseline``: the resident memory a
training step needs on top of parameters and inputs (activations saved for backward, gradients,
workspaces, autocast weight copies), as the OS sees it, i.e. including what the allocator keeps. tracemalloc
cannot see torch's allocations; where clear_refs is not writable the fallback is the
``getrusage(RUSAGE_SELF).ru_maxrss`` delta over the same baseline (a peak reached during imports can hide
a smaller one). For scale: one float32 ``(B, H, T, T)`` tensor is 2 MB at T=64, 32 MB at 256, 512 MB at 1024.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tables import append_run, markdown, measured

try:
    from attnkit import MultiHeadAttention
    from attnkit.common.measure import stamp
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from attnkit import MultiHeadAttention
    from attnkit.common.measure import stamp

BATCH = 16
D_MODEL = 512
N_HEADS = 8
TARGET_RATIO = 1.10  # attnkit fwd+bwd time / torch.nn.MultiheadAttention's, per (T, precision)
MIN_SAMPLE_S = 0.05  # each timing sample repeats the step until it lasts at least this long
WARMUP_STEPS = 2
PRECISIONS = ("fp32", "bf16")
CONTENDERS = ("attnkit", "torch.nn.MHA", "bare SDPA", "attnkit weights")
REFERENCE = "torch.nn.MHA"
FULL_REPS = {64: 15, 256: 11, 1024: 5}  # timed rounds per (T, precision, mask); fewer where a step is long
QUICK_REPS = {64: 5, 256: 3}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "attnkit-attention-quick.json"

Step = Callable[[], None]


# --------------------------------------------------------------------------------------
# Contenders: each builder returns a closure doing one fwd+bwd step
# --------------------------------------------------------------------------------------


def _autocast(precision: str) -> AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def _key_padding(T: int, generator: torch.Generator) -> Tensor:
    """``keep (B, T)``: True at real tokens; row lengths uniform in [T/2, T]."""
    lengths = torch.randint(T // 2, T + 1, (BATCH,), generator=generator)
    return torch.arange(T)[None, :] < lengths[:, None]  # (B, T)


def build_step(contender: str, T: int, precision: str, masked: bool, seed: int = 0) -> Step:
    """Module, inputs and a closure running one forward + backward of ``contender``."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    keep = _key_padding(T, g) if masked else None
    mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, T), True = may attend
    x = torch.randn(BATCH, T, D_MODEL, generator=g).requires_grad_()  # (B, T, d_model)

    if contender in ("attnkit", "attnkit weights", "torch.nn.MHA"):
        ours = MultiHeadAttention(D_MODEL, N_HEADS).train()
        if contender == "torch.nn.MHA":
            ref = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True).train()
            with torch.no_grad():  # same weights: in_proj holds [W_q; W_k; W_v] like in_proj_weight
                ref.in_proj_weight.copy_(ours.in_proj.weight)
                ref.in_proj_bias.copy_(ours.in_proj.bias)
                ref.out_proj.weight.copy_(ours.out_proj.weight)
                ref.out_proj.bias.copy_(ours.out_proj.bias)
            module: nn.Module = ref
            pad = None if keep is None else ~keep  # torch: True = padding

            def forward() -> Tensor:
                return ref(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        else:
            module = ours
            need_weights = contender == "attnkit weights"

            def forward() -> Tensor:
                return ours(x, mask=mask, need_weights=need_weights)[0]

        leaves = [x, *module.parameters()]
    elif contender == "bare SDPA":
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        d_k = D_MODEL // N_HEADS
        q, k, v = (torch.randn(BATCH, N_HEADS, T, d_k, generator=g, dtype=dtype).requires_grad_()
                   for _ in range(3))  # (B, H, T, d_k)
        leaves = [q, k, v]

        def forward() -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        raise ValueError(f"unknown contender {contender!r}; choose one of {', '.join(CONTENDERS)}")

    def step() -> None:
        for t in leaves:
            t.grad = None
        with _autocast(precision):
            out = forward()
        out.sum().backward()

    return step


# --------------------------------------------------------------------------------------
# Timing: interleaved rounds, median per contender
# --------------------------------------------------------------------------------------


def time_group(steps: dict[str, Step], reps: int) -> dict[str, dict]:
    """Median ms per step of each contender, sampled in interleaved, rotating rounds."""
    inner = {}
    for name, step in steps.items():
        for _ in range(WARMUP_STEPS):
            step()
        t0 = time.perf_counter()
        step()
        inner[name] = max(1, math.ceil(MIN_SAMPLE_S / (time.perf_counter() - t0)))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            step, n = steps[name], inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            samples[name].append((time.perf_counter() - t0) * 1e3 / n)
    return {name: {"ms_median": statistics.median(s), "ms_min": min(s), "ms_max": max(s),
                   "steps_per_sample": inner[name], "samples_ms": [round(v, 4) for v in s]}
            for name, s in samples.items()}


# --------------------------------------------------------------------------------------
# Peak memory: a fresh subprocess per (contender, T, precision)
# --------------------------------------------------------------------------------------


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def memory_child(contender: str, T: int, precision: str) -> dict:
    """Runs in the subprocess: RSS high-water mark of two fwd+bwd steps over the post-setup baseline."""
    step = build_step(contender, T, precision, masked=False)
    baseline_kb = _proc_status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        method = "VmHWM after clear_refs reset"
    except OSError:
        method = "ru_maxrss (no clear_refs reset)"
    for _ in range(2):
        step()
    if method.startswith("VmHWM"):
        peak_kb = _proc_status_kb("VmHWM")
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"peak_mb": max(0, peak_kb - baseline_kb) / 1024, "baseline_mb": baseline_kb / 1024, "method": method}


def measure_memory(contender: str, T: int, precision: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", contender, str(T), precision]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"peak_mb": None, "error": proc.stderr.strip().splitlines()[-1:] or ["exit " + str(proc.returncode)]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu == "unknown":
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "platform": platform.platform(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def format_table(rows: list[dict]) -> str:
    header = f"{'T':>5}  {'precision':<9}  {'mask':<7}  {'contender':<15}  {'ms fwd+bwd':>10}  " \
             f"{'x torch':>7}  {'peak MB':>8}"
    lines = [header, "-" * len(header)]
    previous = None
    for r in rows:
        group = (r["T"], r["precision"], r["mask"])
        if previous is not None and group != previous:
            lines.append("")
        previous = group
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        lines.append(f"{r['T']:>5}  {r['precision']:<9}  {r['mask']:<7}  {r['contender']:<15}  "
                     f"{r['ms_median']:>10.2f}  {r['ratio_to_torch']:>7.2f}  {peak:>8}")
    return "\n".join(lines)


def longest_fp32(run: dict) -> float:
    """attnkit's time over torch's at the longest T in float32, unmasked: the headline."""
    return max((t for t in run["targets"] if t["precision"] == "fp32"), key=lambda t: t["T"])["attnkit_ratio_no_mask"]


def markdown_table(runs: list[dict]) -> str:
    """attnkit's time over torch.nn.MultiheadAttention's per (T, precision), unmasked and padded, per run."""
    rows = [[str(t["T"]), t["precision"], f"{t['attnkit_ratio_no_mask']:.2f}x", f"{t['attnkit_ratio_padding']:.2f}x",
             f"<= {t['target_ratio']:.2f}x", measured(results)] for results in runs for t in results["targets"]]
    return markdown(["T", "precision", "time / torch's, no mask", "with padding", "target", "measured"], rows,
                    "rlrrll")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: T in {64, 256}, few repetitions")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON output (default {DEFAULT_OUT}; with --quick {QUICK_OUT})")
    parser.add_argument("--memory-child", nargs=3, metavar=("CONTENDER", "T", "PRECISION"),
                        help=argparse.SUPPRESS)  # internal: one memory measurement in this process
    args = parser.parse_args(argv)

    if args.memory_child:
        contender, T, precision = args.memory_child
        print(json.dumps(memory_child(contender, int(T), precision)))
        return

    reps_by_T = QUICK_REPS if args.quick else FULL_REPS
    out_path = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    info = machine_info()
    started = time.perf_counter()
    print(f"attnkit attention benchmark: B={BATCH} d_model={D_MODEL} h={N_HEADS}, torch {info['torch']}, "
          f"{info['threads']} threads, {info['cpu_model']}", flush=True)
    if info["loadavg_at_start"][0] > 0.5 * (info["cpu_count"] or 1):
        print(f"warning: load average {info['loadavg_at_start'][0]:.1f} on {info['cpu_count']} cores: other jobs "
              "are running; absolute times will be inflated (ratios within a round are less affected)", flush=True)

    # Memory first, while nothing else of ours is running: one fresh process per measurement.
    memory: dict[tuple[str, int, str], dict] = {}
    for T in reps_by_T:
        for precision in PRECISIONS:
            for contender in CONTENDERS:
                memory[contender, T, precision] = measure_memory(contender, T, precision)
    print(f"memory measured in {time.perf_counter() - started:.0f} s", flush=True)

    rows = []
    for T, reps in reps_by_T.items():
        for precision in PRECISIONS:
            for masked in (False, True):
                steps = {c: build_step(c, T, precision, masked) for c in CONTENDERS}
                timed = time_group(steps, reps)
                del steps
                ref_ms = timed[REFERENCE]["ms_median"]
                for contender in CONTENDERS:
                    mem = memory[contender, T, precision] if not masked else {"peak_mb": None}
                    rows.append({"T": T, "precision": precision, "mask": "padding" if masked else "none",
                                 "contender": contender, **timed[contender],
                                 "ratio_to_torch": timed[contender]["ms_median"] / ref_ms,
                                 "peak_mb": mem["peak_mb"], "memory": mem if not masked else None})
                print(f"T={T} {precision} mask={'padding' if masked else 'none'} timed "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)

    targets = []
    for T in reps_by_T:
        for precision in PRECISIONS:
            ratios = {r["mask"]: r["ratio_to_torch"] for r in rows
                      if r["T"] == T and r["precision"] == precision and r["contender"] == "attnkit"}
            targets.append({"T": T, "precision": precision, "target_ratio": TARGET_RATIO,
                            "attnkit_ratio_no_mask": ratios["none"], "attnkit_ratio_padding": ratios["padding"],
                            "within_target": all(v <= TARGET_RATIO for v in ratios.values())})

    table = format_table(rows)
    print()
    print("Peak MB: RSS high-water mark of 2 fwd+bwd steps over the post-setup baseline, one fresh process per")
    print("(contender, T, precision), unmasked ('-' = not measured). x torch: median time / torch.nn.MHA's.")
    print(table)
    print()
    for t in targets:
        verdict = "within" if t["within_target"] else "OUTSIDE"
        print(f"T={t['T']:<5} {t['precision']}: attnkit/torch {t['attnkit_ratio_no_mask']:.2f} (no mask), "
              f"{t['attnkit_ratio_padding']:.2f} (padding) -> {verdict} the {TARGET_RATIO:.2f}x target")
    elapsed = time.perf_counter() - started
    info["loadavg_at_end"] = list(os.getloadavg())
    print(f"total {elapsed:.0f} s; 1-min load average {info['loadavg_at_start'][0]:.1f} at start, "
          f"{info['loadavg_at_end'][0]:.1f} at end (above ~0.5 before we start means others share the cores)")

    report = {
        "benchmark": "attention fwd+bwd",
        "command": "python benchmarks/attention.py" + (" --quick" if args.quick else ""),
        **stamp(),
        "machine": info,
        "config": {"batch": BATCH, "d_model": D_MODEL, "n_heads": N_HEADS, "reps_by_T": reps_by_T,
                   "warmup_steps": WARMUP_STEPS, "min_sample_s": MIN_SAMPLE_S, "reference": REFERENCE,
                   "statistic": "median ms per fwd+bwd step over interleaved rounds"},
        "memory_method": "one fresh subprocess per (contender, T, precision), unmasked: VmHWM (reset via "
                         "/proc/self/clear_refs after setup) minus VmRSS after building module and inputs, "
                         "over two fwd+bwd steps; MB = 2^20 bytes",
        "rows": rows,
        "targets": targets,
        "elapsed_s": round(elapsed, 1),
        "table": table,
    }
    append_run(out_path, report)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
