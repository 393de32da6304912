"""Where and how a run computes: threads, device and precision (the one autocast context).

Precision is float32 or bfloat16 autocast, as ``train.precision`` says; ``auto`` takes whichever computes the
model's products faster on this host, measured (:func:`attnkit.engine.precision.training_precision`).
Softmax and the loss stay float32 inside the autocast region (done explicitly by them).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from . import distributed


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AMX or AVX512-BF16: bf16 products can be faster than float32 ones there (whether they
    are for a given model, :mod:`attnkit.engine.precision` measures)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def autocast(device: torch.device, bf16: bool) -> AbstractContextManager:
    """The one autocast context of attnkit: bfloat16 matmuls, float32 softmax/loss (done explicitly)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def set_threads(threads: int, workers: distributed.Workers) -> None:
    """``threads`` intra-op threads, or (0) torch's default — shared out when several CPU processes train."""
    if threads > 0:
        torch.set_num_threads(threads)
    elif workers.enabled and workers.device.type == "cpu":  # the cores are shared out
        torch.set_num_threads(distributed.threads_per_process(workers.local_world_size))
