"""Tests for attnkit.training.distributed and the trainer under torchrun: sharding, equivalence with one process,
resume.

The end-to-end tests launch ``python -m torch.distributed.run --standalone --nproc_per_node=2 -m attnkit train``
(the real command line) with two CPU processes talking over gloo, on a tiny model for a few updates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.runs.checkpoint import load_training_state, load_weights
from attnkit.training.distributed import Workers, from_env, shard, threads_per_process
from attnkit.training.trainer import Trainer, accumulation
from test_train import epoch_length, quiet, raw_config, write_yaml

ROOT = Path(__file__).resolve().parents[1]


# -- sharding, environment, threads, effective batch ------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7])
def test_shard_gives_each_batch_once_and_every_rank_as_many_passes(world, n):
    group = [[10 * i, 10 * i + 1] for i in range(n)]
    shares = [shard(group, rank, world) for rank in range(world)]
    assert {len(s) for s in shares} == {-(-n // world)}  # equal forward/backward passes: DDP never waits
    real = [batch for s in shares for batch, weight in s if weight == 1.0]
    assert sorted(real) == group  # every batch exactly once
    assert all(weight in (0.0, 1.0) for s in shares for _, weight in s)
    if world == 1:
        assert shares[0] == [(b, 1.0) for b in group]  # single process: the group itself, in order


def test_workers_come_from_torchruns_environment():
    assert from_env({}) == Workers()
    assert from_env({"WORLD_SIZE": "1"}).enabled is False
    w = from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.enabled, w.is_main) == (3, 4, 1, 2, True, False)
    with pytest.raises(UserError, match="RANK.*torchrun"):
        from_env({"WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="WORLD_SIZE='two'"):
        from_env({"WORLD_SIZE": "two"})
    with pytest.raises(UserError, match="inconsistent"):
        from_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})


def test_threads_share_the_cores_among_local_processes():
    assert threads_per_process(1, cpus=8) == 8
    assert threads_per_process(2, cpus=2) == 1
    assert threads_per_process(4, cpus=8) == 2
    assert threads_per_process(4, cpus=2) == 1  # at least one


def test_tokens_per_update_derives_accumulate_for_any_worker_count():
    cfg = load_config(RunConfig, raw_config(max_tokens=300, tokens_per_update=1200)).train
    assert [accumulation(cfg, w) for w in (1, 2, 4)] == [4, 2, 1]
    assert all(300 * accumulation(cfg, w) * w == 1200 for w in (1, 2, 4))
    with pytest.raises(UserError, match=r"tokens_per_update=1200 is not a multiple of max_tokens 300 x 3"):
        accumulation(cfg, 3)
    with pytest.raises(UserError, match="not both"):
        load_config(RunConfig, raw_config(tokens_per_update=1200, accumulate=2))
    assert accumulation(load_config(RunConfig, raw_config(accumulate=3)).train, 2) == 3


# -- two processes under torchrun ---------------------------------------------------------


def torchrun(*runs: list[str]) -> str:
    """``attnkit train`` command lines, one after the other, in 2 CPU processes under torchrun -> their stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}  # gloo on the CPU even where there is a GPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "ddp_runs.py"), json.dumps([["train", *argv] for argv in runs])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def validated_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint(run: Path, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    path = run / "checkpoints" / f"step-{step:08d}"
    return load_weights(path / "model.safetensors")[0], load_training_state(path / "trainer.safetensors")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[Path, dict, int, str]:
    """One launch (starting processes is what costs time), four runs of 2 workers each:

    ``ddp``: no dropout, across epoch 1's odd tail into epoch 2 (checkpoints right after the tail and at the end);
    ``straight``: dropout, 8 updates; ``resumed``: the same stopped after 4 updates, then resumed to 8.
    """
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this PyTorch build has no torch.distributed with the gloo backend")
    tmp = tmp_path_factory.mktemp("ddp")
    raw = raw_config(dropout=0.0, max_tokens=320)  # 7 batches per epoch: an odd tail
    n = epoch_length(tmp, raw)
    raw["train"].update(max_updates=n // 2 + 3, valid_every=n // 2 + 1)
    equal = str(write_yaml(tmp / "equal.yaml", raw))
    dropout = str(write_yaml(tmp / "dropout.yaml", raw_config(dropout=0.1, valid_every=3)))
    out = torchrun([equal, "--run-dir", str(tmp / "ddp")],
                   [dropout, "--run-dir", str(tmp / "straight"), "train.max_updates=8"],
                   [dropout, "--run-dir", str(tmp / "resumed"), "train.max_updates=4"])
    torchrun([dropout, "--run-dir", str(tmp / "resumed"), "--resume", "train.max_updates=8"])  # new processes
    return tmp, raw, n, out


def test_two_workers_train_like_one_process_with_twice_the_batch(ddp_runs):
    """2 workers x batch B == 1 process accumulating the same 2 batches, across an epoch's odd tail."""
    tmp, raw, n_batches, out = ddp_runs
    assert n_batches % 2 == 1  # the last update of epoch 1 has one batch: rank 1 runs a zero-weighted one
    single = load_config(RunConfig, {**raw, "train": {**raw["train"], "accumulate": 2}})
    Trainer(single, tmp / "single", log=quiet).run()
    tail, end = n_batches // 2 + 1, n_batches // 2 + 3
    for step in (tail, end):
        (w2, s2), (w1, s1) = checkpoint(tmp / "ddp", step), checkpoint(tmp / "single", step)
        assert w2.keys() == w1.keys()  # the unwrapped model's names: no DDP "module." prefix
        for key in w1:
            torch.testing.assert_close(w2[key], w1[key], rtol=1e-5, atol=1e-6, msg=key)
        assert (s2["step"], s2["epoch"], s2["batch_pos"]) == (s1["step"], s1["epoch"], s1["batch_pos"])
        assert len(s2["rng_ranks"]) == 2 and not torch.equal(s2["rng_ranks"][0]["torch"], s2["rng_ranks"][1]["torch"])
    assert (s2["epoch"], s2["batch_pos"]) == (1, 4)  # epoch 2: two updates of two batches
    assert validated_steps(tmp / "ddp") == [tail, end]  # rank 0 alone writes metrics ...
    assert out.count("valid_loss") == 3  # ... and prints each run's result


def test_resumed_distributed_run_continues_exactly(ddp_runs):
    """Stopped after 4 updates and resumed to 8 in new processes == straight to 8, bit for bit (dropout on)."""
    tmp = ddp_runs[0]
    (wa, sa), (wb, sb) = checkpoint(tmp / "straight", 8), checkpoint(tmp / "resumed", 8)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert (sa["step"], sa["epoch"], sa["batch_pos"]) == (sb["step"], sb["epoch"], sb["batch_pos"])
    for ra, rb in zip(sa["rng_ranks"], sb["rng_ranks"], strict=True):  # each rank's dropout stream
        assert torch.equal(ra["torch"], rb["torch"])
    for key, state in sa["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], sb["optimizer"]["state"][key]["exp_avg_sq"])
    assert validated_steps(tmp / "straight") == [3, 6, 8]
    assert validated_steps(tmp / "resumed") == [3, 4, 6, 8]  # 4: where it stopped; nothing logged twice
