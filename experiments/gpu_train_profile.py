"""Where a language-model training update's time goes on a GPU: the host (Python, launches) or the device (kernels).

    python experiments/gpu_train_profile.py [--updates 30] [--warmup-updates 20]

Builds the Trainer of ``benchmarks/lm.py``'s throughput row (``configs/shakespeare-char.yaml`` at nanoGPT's
``train_shakespeare_char`` shape: 6 layers x 384, block 256, 64 blocks an update, dropout 0, bf16), runs
``--warmup-updates`` updates, then times ``--updates`` more twice: once plainly (wall time per update, the GPU
synchronised at both ends), once under ``torch.profiler`` with CPU and CUDA activities. It prints the wall time per
update, the summed device time per update (ops and their kernels both count it, so it overstates what the device
did; read the ranking, not the sum), and the top ops by device time and by host time. Needs a CUDA GPU; prints
JSON (nothing is written to ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPE = ["model.transformer.decoder_layers=6", "model.transformer.n_heads=6", "model.transformer.d_model=384",
         "model.transformer.d_ff=1536", "data.block_size=256", "model.transformer.max_len=256",
         "train.max_tokens=16384", "train.valid_every=1000000", "model.transformer.dropout=0.0",
         "train.progress=false"]


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity

    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig
    from attnkit.training.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--warmup-updates", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cfg = load_config(RunConfig, ROOT / "configs" / "shakespeare-char.yaml", [*SHAPE, *args.set])
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="gpu-profile-")))
    trainer.model.train()
    batches = [b for _ in range(4) for b in trainer.task.batches(0)]  # enough for every update below
    it = iter(batches)
    for _ in range(args.warmup_updates):
        trainer.train_step([next(it)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.updates):
        trainer.train_step([next(it)])
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1000 / args.updates
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.updates):
            trainer.train_step([next(it)])
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_ms = sum(e.self_device_time_total for e in events) / 1000 / args.updates
    by_device = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:args.top]
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    tokens = 16384
    print(json.dumps({
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "updates": args.updates, "set": args.set,
        "wall_ms_per_update": round(wall_ms, 2), "tok_s": round(tokens / wall_ms * 1000),
        "device_ms_per_update": round(device_ms, 2),
        "top_device_ms": [[e.key, round(e.self_device_time_total / 1000 / args.updates, 3), e.count // args.updates]
                          for e in by_device],
        "top_host_ms": [[e.key, round(e.self_cpu_time_total / 1000 / args.updates, 3), e.count // args.updates]
                        for e in by_host]}, indent=1))


if __name__ == "__main__":
    main()
