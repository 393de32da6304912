"""Several processes, one model: torchrun's environment, the process group and batch sharding.

attnkit scales out with PyTorch's own engine: ``torchrun`` starts one process per worker and
:class:`torch.nn.parallel.DistributedDataParallel` (DDP) averages the gradients. This module
only reads torchrun's environment, opens the process group (gloo on the CPU, nccl on CUDA) and
offers the few collectives the trainer needs; in a single process every one of them is a
no-op, so :mod:`attnkit.training.trainer` has one code path.

Sharding an update. The epoch's batch list is the same on every rank. One update takes the
next ``world_size x accumulate`` batches; rank ``r`` takes every ``world_size``-th of them
starting at ``r``. At the end of an epoch fewer batches may be left; a rank that is short
runs a zero-weighted copy of a real batch instead, so every rank runs the same number of
forward/backward passes (DDP's all-reduce would otherwise wait forever)::

    batches 0..4 left, world 2, accumulate 3:  rank 0 -> 0, 2, 4    rank 1 -> 1, 3, (0 x 0)
"""

from __future__ import annotations

import atexit
import inspect
import os
import zlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..common.errors import UserError

T = TypeVar("T")

TIMEOUT = timedelta(minutes=60)
"""How long a rank waits at a collective, e.g. for rank 0 to train the tokenizer or validate."""

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Workers:
    """This process's place among the training processes (one of them when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # processes on this machine
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        """True when several processes train together (DDP)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes files and logs and makes the decisions that end training."""
        return self.rank == 0

    # -- collectives: no-ops in a single process -----------------------------------------------

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (any picklable object)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` in rank order, on rank 0 (an empty list on the others)."""
        if not self.enabled:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, out, dst=0)
        return out or []

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (float64, so target counts stay exact)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def agree(self, fn: Callable[[], T]) -> T:
        """``fn()`` on this rank; a :class:`UserError` on any rank is raised on every rank.

        Without this, a rank that fails while the others wait at the next collective would leave
        them hanging until :data:`TIMEOUT`.
        """
        error, result = None, None
        try:
            result = fn()
        except UserError as e:
            error = str(e)
        if self.enabled:
            errors: list[str | None] = [None] * self.world_size
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error:
            raise UserError(error)
        return result  # type: ignore[return-value]

    def main_first(self, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0, then on the other ranks: rank 0 writes shared files (the tokenizer), they read them."""
        first = self.agree(fn if self.is_main else lambda: None)
        later = self.agree(lambda: None if self.is_main else fn())
        return first if self.is_main else later  # type: ignore[return-value]

    def wrap(self, model: nn.Module, probe: Callable[[], torch.Tensor]) -> nn.Module:
        """``model`` in DDP (or itself in a single process); ``probe()`` is a tiny loss, to find unused parameters.

        Parameters a forward pass never uses (e.g. an RNN without attention) must be declared to
        DDP, which otherwise waits for their gradients forever; the probe's RNG draws are undone.
        """
        if not self.enabled:
            return model
        unused = unused_parameters(model, probe, self.device)
        ids = [self.local_rank] if self.device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel
        # no buffer syncing (the models keep no running statistics); torch >= 2.13 renamed the option
        keyword = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
                   else "broadcast_buffers")
        return ddp(model, device_ids=ids, find_unused_parameters=bool(unused), **{keyword: False})

    def no_sync(self, model: nn.Module, sync: bool) -> AbstractContextManager:
        """Skip DDP's gradient all-reduce for a backward pass unless ``sync`` (the last of an update)."""
        return model.no_sync() if self.enabled and not sync else nullcontext()  # type: ignore[operator]


def from_env(env: Mapping[str, str] | None = None) -> Workers:
    """Rank and world size from torchrun's variables (``RANK``, ``WORLD_SIZE``, ...); one process without them."""
    env = os.environ if env is None else env
    if (_env_int(env, "WORLD_SIZE", 1) or 1) <= 1:
        return Workers()
    values = {key: _env_int(env, key, None) for key in ENV_KEYS}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise UserError(f"WORLD_SIZE is set but {', '.join(missing)} is not; launch distributed training with "
                        f"`torchrun --nproc_per_node=N -m attnkit train ...`")
    w = Workers(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
    if not (0 <= w.rank < w.world_size and 0 <= w.local_rank < w.local_world_size <= w.world_size):
        raise UserError(f"inconsistent torchrun environment RANK={w.rank} WORLD_SIZE={w.world_size} "
                        f"LOCAL_RANK={w.local_rank} LOCAL_WORLD_SIZE={w.local_world_size}")
    return w


def _env_int(env: Mapping[str, str], key: str, default: int | None) -> int | None:
    text = env.get(key)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise UserError(f"environment variable {key}={text!r} is not an integer") from None


def start(workers: Workers) -> Workers:
    """Open the process group (gloo on the CPU, nccl on CUDA) and pick this rank's device.

    A single process gets ``cuda`` when present, else the CPU; rank ``r`` of a distributed run
    gets ``cuda:LOCAL_RANK`` (one GPU per process) or the CPU.
    """
    cuda = torch.cuda.is_available()
    if not workers.enabled:
        return replace(workers, device=torch.device("cuda" if cuda else "cpu"))
    if not dist.is_available():
        raise UserError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed; install one that has")
    if cuda:
        if workers.local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {workers.local_rank} but only {torch.cuda.device_count()} GPU(s): "
                            f"use --nproc_per_node at most the number of GPUs")
        device = torch.device(f"cuda:{workers.local_rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():  # once per process: later trainers in the same process reuse it
        dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
        atexit.register(stop)
    return replace(workers, device=device)


def stop() -> None:
    """Close the process group opened by :func:`start` (if any); runs at exit."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def threads_per_process(local_world_size: int, cpus: int | None = None) -> int:
    """The CPU cores of this machine shared among its training processes (at least 1 each)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(local_world_size, 1))


def shard(group: list[list[int]], rank: int, world_size: int) -> list[tuple[list[int], float]]:
    """Rank ``rank``'s batches of one update's ``group``, as ``(batch, weight)`` pairs.

    Every rank gets ``ceil(len(group) / world_size)`` pairs: its real batches
    ``group[rank::world_size]`` with weight 1, then zero-weighted copies of ``group[0]`` where
    it is short (see the module docstring). With ``world_size`` 1 this is ``group`` itself.
    """
    passes = -(-len(group) // world_size)
    mine = [(batch, 1.0) for batch in group[rank::world_size]]
    return mine + [(group[0], 0.0)] * (passes - len(mine))


def rank_seed(seed: int, rank: int, step: int) -> int:
    """A seed for rank ``rank``'s random stream (dropout) from update ``step`` on: distinct per rank."""
    return zlib.crc32(f"attnkit:{seed}:{rank}:{step}".encode())


def unused_parameters(model: nn.Module, probe: Callable[[], torch.Tensor], device: torch.device) -> list[str]:
    """Names of the parameters that ``probe()``'s backward pass leaves without a gradient."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        probe().backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    return unused
