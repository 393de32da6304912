"""Where and how a run computes: threads, device and precision (the one autocast context).

Precision is float32, or bfloat16 autocast where it pays: on CUDA when the GPU supports it, on
the CPU when it has AMX or AVX512-BF16 (bf16 matmuls there are several times faster than
float32). Softmax and the loss stay float32 inside the autocast region (done explicitly by them).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ..common.errors import UserError
from . import distributed


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AMX or AVX512-BF16 (bf16 matmul much faster than fp32)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_bf16(precision: str, device: torch.device) -> bool:
    """Whether to train under bfloat16 autocast: ``precision`` is ``auto``, ``bf16`` or ``fp32``."""
    if precision in ("fp32", "float32"):
        return False
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
    else:
        supported = cpu_has_fast_bf16()
    if precision == "bf16" and device.type == "cuda" and not supported:
        raise UserError("train.precision: bf16 is not supported by this GPU; use fp32")
    return supported or precision == "bf16"


def autocast(device: torch.device, bf16: bool) -> AbstractContextManager:
    """The one autocast context of attnkit: bfloat16 matmuls, float32 softmax/loss (done explicitly)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def set_threads(threads: int, workers: distributed.Workers) -> None:
    """``threads`` intra-op threads, or (0) torch's default — shared out when several CPU processes train."""
    if threads > 0:
        torch.set_num_threads(threads)
    elif workers.enabled and workers.device.type == "cpu":  # the cores are shared out
        torch.set_num_threads(distributed.threads_per_process(workers.local_world_size))
