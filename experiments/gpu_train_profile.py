"""Where a language-model training update's time goes on a GPU: the host (Python, launches) or the device (kernels).

    python experiments/gpu_train_profile.py [--updates 30] [--warmup-updates 20] [--nanogpt DIR]

Builds the Trainer of ``benchmarks/lm.py``'s throughput row (``configs/shakespeare-char.yaml`` at nanoGPT's
``train_shakespeare_char`` shape: 6 layers x 384, block 256, 64 blocks an update, dropout 0, bf16), runs
``--warmup-updates`` updates, then times ``--updates`` more twice: once plainly (wall time per update, the GPU
synchronised at both ends), once under ``torch.profiler`` with CPU and CUDA activities. It prints the wall time per
update, the summed device time per update (ops and their kernels both count it, so it overstates what the device
did; read the ranking, not the sum), the kernels' own time and count per update (what the device really ran), and
the top ops by device time and by host time. With ``--nanogpt DIR`` (a nanoGPT checkout) it profiles nanoGPT's
training step the same way beside it: its ``model.py`` at the same shape, bf16 autocast, fused AdamW, pinned
asynchronous batches, as its ``train.py`` runs eagerly. Needs a CUDA GPU; prints JSON (nothing is written to
``benchmarks/results``).
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


def profile(step, args: argparse.Namespace, tokens: int) -> dict:
    """Warm ``step`` up, time ``args.updates`` calls plainly, then again under the profiler."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    for _ in range(args.warmup_updates):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.updates):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1000 / args.updates
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.updates):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    per = 1000 * args.updates
    by_device = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:args.top]
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    return {"wall_ms_per_update": round(wall_ms, 2), "tok_s": round(tokens / wall_ms * 1000),
            "device_ms_per_update": round(sum(e.self_device_time_total for e in events) / per, 2),
            "kernel_ms_per_update": round(sum(e.self_device_time_total for e in kernels) / per, 2),
            "kernels_per_update": sum(e.count for e in kernels) // args.updates,
            "top_device_ms": [[e.key[:120], round(e.self_device_time_total / per, 3), e.count // args.updates]
                              for e in by_device],
            "top_host_ms": [[e.key[:120], round(e.self_cpu_time_total / per, 3), e.count // args.updates]
                            for e in by_host]}


def nanogpt_step(nanogpt: Path):
    """nanoGPT's eager training step at the same shape: its model.py, as its train.py runs it on a GPU in bf16."""
    import torch

    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384, dropout=0.0,
                          bias=False)).cuda()
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cuda")  # fused AdamW where torch has it
    data = torch.randint(0, 65, (200_000,))

    def step() -> None:
        ix = torch.randint(len(data) - 257, (64,))
        x = torch.stack([data[i: i + 256] for i in ix]).pin_memory().to("cuda", non_blocking=True)
        y = torch.stack([data[i + 1: i + 257] for i in ix]).pin_memory().to("cuda", non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main() -> None:
    import torch

    from attnkit.config.loader import load_config
    from attnkit.config.schema import RunConfig
    from attnkit.training.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--warmup-updates", type=int, default=20)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: profile its training step beside attnkit's")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cfg = load_config(RunConfig, ROOT / "configs" / "shakespeare-char.yaml", [*SHAPE, *args.set])
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="gpu-profile-")))
    trainer.model.train()
    batches = iter([b for _ in range(8) for b in trainer.task.batches(0)])  # enough for every update below
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "updates": args.updates,
              "set": args.set, "attnkit": profile(lambda: trainer.train_step([next(batches)]), args, 16384)}
    if args.nanogpt:
        result["nanogpt"] = profile(nanogpt_step(args.nanogpt), args, 16384)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
