"""Tests for attnkit.training.trainer: data order, overfitting, exact resume, atomic checkpoints, run-dir safety."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig, TrainConfig
from attnkit.data import dates
from attnkit.inference.translate import translate_texts
from attnkit.runs.checkpoint import load_training_state, load_weights
from attnkit.training.trainer import Trainer, learning_rate, make_optimizer


def raw_config(dropout: float = 0.0, **train) -> dict:
    return {
        "task": "translate",
        "data": {"generate": "dates", "generate_train": 120, "generate_valid": 10, "max_len": 64,
                 "tokenizer": {"vocab_size": 70}},
        "model": {"transformer": {"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 1,
                                  "decoder_layers": 1, "dropout": dropout, "max_len": 128}},
        "train": {"max_tokens": 300, "max_updates": 20, "valid_every": 1000, "progress": False,
                  "precision": "fp32", "threads": 1, "warmup": 5, "lr": 3e-3, "valid_bleu_sentences": 5,
                  "average_last": 0, **train},
    }


def quiet(msg: str) -> None:
    pass


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def epoch_length(tmp_path: Path, raw: dict) -> int:
    """Updates per epoch of ``raw`` (accumulate 1), found by building its task in a scratch directory."""
    from attnkit.tasks import make_task

    return len(make_task(load_config(RunConfig, raw), tmp_path / "scratch", quiet).batches(0))


# -- the data order --------------------------------------------------------------------


def test_trainer_walks_each_epoch_in_the_tasks_order(tmp_path):
    """Every example exactly once per epoch, in task.batches(epoch) order, also when a validation ends an epoch."""
    raw = raw_config()
    n = epoch_length(tmp_path, raw)
    raw["train"].update(max_updates=3 * n, valid_every=n)  # validations (and checkpoints) at epoch ends
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    seen: list[list[int]] = []
    collate = trainer.task.collate
    trainer.task.collate = lambda idx, device: (seen.append(list(idx)), collate(idx, device))[1]
    trainer.run()
    expected = [b for epoch in range(3) for b in trainer.task.batches(epoch)]
    assert seen == expected
    for epoch in range(3):
        flat = sorted(i for b in seen[epoch * n:(epoch + 1) * n] for i in b)
        assert flat == list(range(len(trainer.task.src)))
    assert (trainer.step, trainer.epoch, trainer.batch_pos) == (3 * n, 3, 0)


def test_accumulate_groups_batches_into_one_update(tmp_path):
    raw = raw_config(max_updates=3, accumulate=2)
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    seen: list[list[int]] = []
    collate = trainer.task.collate
    trainer.task.collate = lambda idx, device: (seen.append(list(idx)), collate(idx, device))[1]
    trainer.run()
    assert trainer.step == 3 and seen == trainer.task.batches(0)[:6]


def test_a_validation_that_spends_the_budget_ends_the_run(tmp_path):
    """max_minutes counts validations: one that uses up the budget is the last, not one more update and another."""
    raw = raw_config(max_updates=50, valid_every=4, max_minutes=1.0)
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    validate = trainer.validate

    def slow_validation() -> dict:
        trainer.seconds_before += 40.0  # each validation "takes" 40 s: the second spends the minute
        return validate()
    trainer.validate = slow_validation
    trainer.run()
    assert trainer.step == 8
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8]


# -- learning ---------------------------------------------------------------------------


def test_tiny_model_overfits_tiny_corpus(tmp_path):
    pairs = dates.generate_pairs(12, seed=3, split="train", formats=["de_long", "en_long", "us_numeric"])
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    src.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    tgt.write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    raw = raw_config(max_updates=250, max_tokens=1000, valid_every=250, label_smoothing=0.0, warmup=30,
                     lr=5e-3, valid_bleu_sentences=12)
    raw["data"] = {"train": str(src), "train_tgt": str(tgt), "valid": str(src), "valid_tgt": str(tgt),
                   "tokenizer": {"vocab_size": 60}}
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    assert len(trainer.task.batches(0)) == 1  # one batch per update: the whole corpus
    metrics = trainer.run()
    assert metrics["valid_loss"] < 0.05  # the training data itself, without label smoothing
    assert metrics["valid_exact"] == 100.0
    hyps = translate_texts(trainer.model, trainer.task.tok, [s for s, _ in pairs], beam=1)
    assert [h[0] for h in hyps] == [t for _, t in pairs]


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_decays_the_matrices_apart_from_the_gradient(fused):
    """With zero gradients Adam's moments stay 0, so AdamW's step is its decay alone: ``w (1 - lr lambda)`` for
    matrices, nothing for biases and norm gains; Adam's L2 decay, by contrast, enters the normalised step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(optimizer="adamw", lr=0.1, weight_decay=0.5, betas=(0.9, 0.99), eps=1e-8)
    opt = make_optimizer([{"params": list(model.parameters()), "lr_scale": 2.0}], cfg, fused=fused)
    assert [g["lr_scale"] for g in opt.param_groups] == [2.0, 2.0]  # a task's scale survives the split
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        expected = before[n] * (1 - 0.1 * 0.5) if p.dim() >= 2 else before[n]
        torch.testing.assert_close(p.detach(), expected, msg=n)
    adam = make_optimizer([{"params": list(model.parameters()), "lr_scale": 1.0}],
                          TrainConfig(optimizer="adam", lr=0.1, weight_decay=0.5), fused=fused)
    old = model[1].weight.detach().clone()
    adam.step()  # L2: the decay is the gradient, normalised, so every parameter moves by about lr
    assert (model[1].weight.detach() - old).abs().min() > 0.05  # a norm gain too


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "noam", "constant", "linear"])
def test_learning_rate_warms_up_to_peak(schedule):
    cfg = TrainConfig(lr=1e-3 if schedule != "noam" else 1.0, warmup=100, schedule=schedule, max_updates=1000)
    lrs = [learning_rate(s, cfg, 64) for s in range(1, 400)]
    peak = max(lrs)
    assert lrs.index(peak) == 99  # step 100
    assert all(a < b for a, b in zip(lrs[:99], lrs[1:100], strict=True))
    expected = {"inverse_sqrt": 1e-3, "constant": 1e-3, "linear": 0.9e-3, "noam": 64 ** -0.5 * 100 ** -0.5}[schedule]
    assert math.isclose(peak, expected, rel_tol=1e-9)


def test_linear_schedule_ends_at_zero_with_the_budget():
    """Linear decay reaches 0 at max_updates, or at max_minutes of training when that is spent first."""
    cfg = TrainConfig(lr=1e-3, warmup=10, schedule="linear", max_updates=1000)
    assert learning_rate(1000, cfg, 64) == 0.0
    assert math.isclose(learning_rate(500, cfg, 64), 0.5e-3, rel_tol=1e-9)
    assert math.isclose(learning_rate(500, cfg, 64, minutes=99.0), 0.5e-3, rel_tol=1e-9)  # no time budget
    timed = TrainConfig(lr=1e-3, warmup=10, schedule="linear", max_updates=1000, max_minutes=2.0)
    assert math.isclose(learning_rate(100, timed, 64, minutes=1.5), 0.25e-3, rel_tol=1e-9)  # time is the tighter
    assert math.isclose(learning_rate(800, timed, 64, minutes=0.5), 0.2e-3, rel_tol=1e-9)  # updates are
    assert learning_rate(100, timed, 64, minutes=2.5) == 0.0


# -- resume ----------------------------------------------------------------------------


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_weights(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")[0]


def assert_same_checkpoint(straight: Path, resumed: Path, step: int) -> tuple[dict, dict]:
    """Two runs' checkpoints at ``step`` hold the same weights, position and Adam state, bit for bit; returns
    their training states for further checks."""
    a, b = weights(straight, step), weights(resumed, step)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sa = load_training_state(straight / "checkpoints" / f"step-{step:08d}" / "trainer.safetensors")
    sb = load_training_state(resumed / "checkpoints" / f"step-{step:08d}" / "trainer.safetensors")
    assert (sa["step"], sa["epoch"], sa["batch_pos"]) == (sb["step"], sb["epoch"], sb["batch_pos"])
    for key, state in sa["optimizer"]["state"].items():
        assert torch.equal(state["exp_avg_sq"], sb["optimizer"]["state"][key]["exp_avg_sq"])
    return sa, sb


@pytest.mark.parametrize(("engine", "dropout", "optimizer"),
                         [("fast", 0.0, "adam"), ("fast", 0.1, "adam"), ("reference", 0.1, "adam"),
                          ("fast", 0.1, "adamw")])
def test_resume_is_bitwise_identical(tmp_path, capsys, engine, dropout, optimizer):
    raw = raw_config(dropout=dropout, engine=engine, optimizer=optimizer,
                     weight_decay=0.1 if optimizer == "adamw" else 0.0)
    n_epoch = epoch_length(tmp_path, raw)
    n = n_epoch + n_epoch // 2 + 1  # resume mid-epoch, after a validation that ended an epoch
    assert n % n_epoch
    raw["train"]["valid_every"] = n_epoch
    config = write_yaml(tmp_path / "tiny.yaml", raw)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    total = 2 * n

    assert main(["train", str(config), "--run-dir", str(straight), f"train.max_updates={total}"]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), f"train.max_updates={n}"]) == 0
    if dropout:  # a crash while writing a later checkpoint leaves a temporary directory behind
        junk = resumed / "checkpoints" / f".tmp-step-{n + 1:08d}-99999"
        junk.mkdir()
        (junk / "model.safetensors").write_bytes(b"\x00garbage")
        with open(resumed / "metrics.jsonl", "a") as log:  # ... after logging a validation past the checkpoint
            log.write(json.dumps({"step": n + 1, "epoch": 9, "minutes": 0.0, "valid_loss": 99.0}) + "\n")
    assert main(["train", str(config), "--run-dir", str(resumed), "--resume",
                 f"train.max_updates={total}"]) == 0
    capsys.readouterr()

    sa, sb = assert_same_checkpoint(straight, resumed, total)
    assert torch.equal(sa["rng"]["torch"], sb["rng"]["torch"])
    # the resumed log holds the straight run's validations plus the one that ended the first session, each once
    # and with the same values (only the clock differs)
    def logged(run: Path) -> dict[int, dict]:
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        by_step = {m["step"]: {k: v for k, v in m.items() if k != "minutes"} for m in lines}
        assert len(by_step) == len(lines) and sorted(by_step) == list(by_step), f"{run}: steps logged {lines}"
        return by_step

    straight_log, resumed_log = logged(straight), logged(resumed)
    assert sorted(straight_log) == [*range(n_epoch, total + 1, n_epoch), *[total] * bool(total % n_epoch)]
    assert sorted(resumed_log) == sorted({*straight_log, n})
    assert all(resumed_log[step] == straight_log[step] for step in straight_log)


def test_resume_with_another_optimizer_is_a_one_line_error(tmp_path, capsys):
    config = write_yaml(tmp_path / "tiny.yaml", raw_config(valid_every=3))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "run"), "train.max_updates=3"]) == 0
    capsys.readouterr()
    code = main(["train", str(config), "--run-dir", str(tmp_path / "run"), "--resume", "train.max_updates=6",
                 "train.optimizer=adamw"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("attnkit: error:") and "train.optimizer" in err


def test_resume_without_progress_left_does_nothing(tmp_path, capsys):
    config = write_yaml(tmp_path / "tiny.yaml", raw_config(max_updates=3))
    run = tmp_path / "run"
    assert main(["train", str(config), "--run-dir", str(run)]) == 0
    before = weights(run, 3)
    assert main(["train", str(config), "--run-dir", str(run), "--resume"]) == 0
    after = weights(run, 3)
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- run directory safety ---------------------------------------------------------------


def test_refuses_to_overwrite_an_existing_run(tmp_path, capsys):
    config = write_yaml(tmp_path / "tiny.yaml", raw_config(max_updates=2))
    run = tmp_path / "run"
    assert main(["train", str(config), "--run-dir", str(run)]) == 0
    before = weights(run, 2)
    capsys.readouterr()
    assert main(["train", str(config), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit: error: ") and "--resume" in err and str(run) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    after = weights(run, 2)
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(UserError, match="--resume"):
        Trainer(load_config(RunConfig, raw_config()), run, log=quiet)


def test_restart_before_first_checkpoint_reuses_nothing_stale(tmp_path, capsys):
    config = write_yaml(tmp_path / "tiny.yaml", raw_config(max_updates=2))
    run = tmp_path / "run"
    assert main(["train", str(config), "--run-dir", str(run)]) == 0
    for ckpt in (run / "checkpoints").iterdir():  # as if killed before the first checkpoint was renamed
        ckpt.rename(ckpt.with_name(".tmp-" + ckpt.name))
    capsys.readouterr()
    code = main(["train", str(config), "--run-dir", str(run), "data.tokenizer.vocab_size=50"])
    err = capsys.readouterr().err
    assert code == 2 and "tokenizer" in err and "Traceback" not in err  # not silently the old tokenizer
    assert main(["train", str(config), "--run-dir", str(run)]) == 0  # the same settings start over
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_checkpoints_are_pruned_and_averaged(tmp_path):
    raw = raw_config(max_updates=8, valid_every=2, keep_checkpoints=3, average_last=2)
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    trainer.run()
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-00000004", "step-00000006", "step-00000008"]
    avg = load_weights(tmp_path / "run" / "averaged.safetensors")[0]
    w6, w8 = weights(tmp_path / "run", 6), weights(tmp_path / "run", 8)
    for key in avg:
        torch.testing.assert_close(avg[key], (w6[key].double() + w8[key].double()).div(2).float())
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_noam_needs_a_model_width():
    from attnkit.common.errors import UserError
    from attnkit.training.trainer import model_width

    assert model_width(torch.nn.Linear(2, 2)) is None  # no silent default width
    with pytest.raises(UserError, match="noam"):
        learning_rate(10, TrainConfig(schedule="noam"), None)
    assert learning_rate(10, TrainConfig(schedule="inverse_sqrt"), None) > 0


def test_progress_without_a_terminal_prints_plain_lines(monkeypatch, capsys):
    """A log file gets one line per interval and one at the end, never tqdm's carriage returns."""
    import attnkit.training.progress as progress_module

    monkeypatch.setattr(progress_module.sys.stderr, "isatty", lambda: False, raising=False)
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    bar = progress_module.progress(100, unit="update", every_seconds=10)
    assert isinstance(bar, progress_module.LineProgress)
    for _ in range(30):  # one clock tick per update: a line every 10 updates
        bar.set_postfix(loss="1.500")
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 4 and lines[0].startswith("update 10/100 (10%) loss 1.500")
    assert lines[-1].startswith("update 30/100 (30%)")
    assert isinstance(progress_module.progress(5, enabled=False), progress_module.tqdm)  # disabled: silent tqdm
