"""The trainer: optimisation, schedule, precision, validation, checkpoints and exact resume.

One trainer serves every task (:mod:`attnkit.tasks`). Per update::

    for each of `accumulate` batches:  loss = sum CE(model(inputs), targets) / n_targets;  backward
    clip the gradient norm;  Adam(beta1 0.9, beta2 0.98, eps 1e-9) step;  learning rate from the schedule

Schedules (Vaswani et al. eq. 3 is ``noam``):
``inverse_sqrt``: ``lr * min(step / warmup, sqrt(warmup / step))`` — linear warm-up to ``lr``, then ``1/sqrt(step)``;
``noam``: ``lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` (``lr`` is the paper's factor, 1.0 there);
``constant``: ``lr`` after linear warm-up;
``linear``: linear warm-up, then linear decay to 0 at the end of the budget — ``max_updates``, or
``max_minutes`` of training when that comes first (so a run on a wall-clock budget ends annealed;
its learning rates then depend on the clock, so such a run, like its stopping point, is not repeatable
update for update);
``cosine``: linear warm-up, then a half cosine from ``lr`` down to ``lr / 10`` at the end of the same budget
(Loshchilov & Hutter 2017, without restarts; nanoGPT's and GPT-3's schedule).

Checkpoints are taken every ``valid_every`` updates and at the end, atomically, into the run
directory (:mod:`attnkit.runs.directory`). Each holds the weights and the trainer state (optimizer, step,
data position, RNG, early-stopping counters); ``--resume`` restarts from the newest one and
reproduces the uninterrupted run exactly. Threads, device and the autocast context are set up by
:mod:`attnkit.training.runtime`; ``train.precision`` is resolved by :func:`attnkit.engine.precision.training_precision`
(``auto``: measured on this host), recorded in the run directory (``precision.json``) and logged in one line, and a
resumed ``auto`` run keeps the precision it started with; ``train.engine`` chooses the reference path or the
engine's (:mod:`attnkit.engine`), which compute the same function.

Several processes (``torchrun --nproc_per_node=N -m attnkit train ...``): each update takes
``world_size x accumulate`` batches, shared out by :func:`attnkit.training.distributed.shard`; the loss is
divided by the targets of the whole update (summed over ranks) and multiplied by the world size,
which undoes DDP's gradient *average*, so N workers x batch B train exactly like one process
accumulating N batches. Rank 0 alone validates, writes checkpoints, metrics and logs and decides
when to stop; the others follow its broadcasts. A checkpoint also holds every rank's RNG state.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..common.errors import UserError
from ..common.log import silent, to_stderr
from ..config.schema import RunConfig, TrainConfig
from ..engine import Engine, prepare
from ..engine.memory import hold_freed_memory
from ..engine.onednn import use_onednn
from ..engine.precision import Choice, training_precision
from ..lora import is_adapted, lora_state_dict
from ..runs.checkpoint import capture_rng_state, check_compatible, restore_rng_state
from ..runs.directory import RunDirectory
from ..runs.layout import MODEL_FILE
from ..tasks import make_task
from ..tasks.base import Task
from . import distributed
from .progress import progress
from .runtime import autocast, set_threads


def learning_rate(step: int, cfg: TrainConfig, d_model: int | None, minutes: float = 0.0) -> float:
    """The learning rate for update ``step`` (1-based) after ``minutes`` of training; see the module docstring."""
    step = max(step, 1)
    warmup = max(cfg.warmup, 1)
    if cfg.schedule in ("linear", "cosine"):
        done = step / cfg.max_updates  # fraction of the budget spent
        if cfg.max_minutes > 0:
            done = max(done, minutes / cfg.max_minutes)
        done = min(done, 1.0)
        decay = 1.0 - done if cfg.schedule == "linear" else 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))
        return cfg.lr * min(step / warmup, 1.0) * decay
    if cfg.schedule == "noam":
        if d_model is None:
            raise UserError("train.schedule: noam scales by the model width d_model, and this model has none; "
                            "choose inverse_sqrt, constant or linear")
        return cfg.lr * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * min(step / warmup, math.sqrt(warmup / step))
    return cfg.lr * min(step / warmup, 1.0)


def accumulation(cfg: TrainConfig, world_size: int) -> int:
    """Batches per update and worker: ``accumulate``, or derived from ``tokens_per_update``."""
    if not cfg.tokens_per_update:
        return cfg.accumulate
    per_pass = cfg.max_tokens * world_size
    if cfg.tokens_per_update % per_pass:
        raise UserError(f"train.tokens_per_update={cfg.tokens_per_update} is not a multiple of max_tokens "
                        f"{cfg.max_tokens} x {world_size} worker(s) = {per_pass}; change one of them")
    return cfg.tokens_per_update // per_pass


def make_optimizer(groups: list[dict], cfg: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    """Adam (Kingma & Ba 2015) over the task's parameter groups, or AdamW with ``train.optimizer: adamw``.

    Adam's ``weight_decay`` adds ``lambda theta`` to the gradient (an L2 term, scaled by Adam's step size per
    parameter); AdamW (Loshchilov & Hutter 2019) decays apart from the gradient, ``theta <- theta - lr lambda theta``,
    and here only the matrices (2+ dims: embeddings, projections), as nanoGPT and GPT-2 do: biases and norm gains
    keep their scale. Each task group splits in two, keeping its ``lr_scale``.
    """
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                fused=fused)
    split = []
    for group in groups:
        for decay in (True, False):
            params = [p for p in group["params"] if (p.dim() >= 2) == decay]
            if params:
                split.append({**group, "params": params, "weight_decay": cfg.weight_decay if decay else 0.0})
    return torch.optim.AdamW(split, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)


def model_width(model: nn.Module) -> int | None:
    """The model's width for the ``noam`` schedule: a Transformer's ``d_model``, an RNN's ``hidden_size``."""
    cfg = getattr(model, "cfg", None)
    width = getattr(cfg, "d_model", getattr(cfg, "hidden_size", None))
    return None if width is None else int(width)


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of ``model``: every weight, or of a model with LoRA adapters (:mod:`attnkit.lora`)
    the adapters alone; its frozen base is the run ``model.init_from`` names, recorded once
    (:mod:`attnkit.runs.adapters`), not copied into every checkpoint."""
    return lora_state_dict(model) if is_adapted(model) else model.state_dict()


class Trainer:
    """Train ``cfg`` into ``run_dir``; ``run()`` returns the last validation metrics."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.tc = cfg.train
        self.workers = distributed.start(distributed.from_env())  # one process unless launched by torchrun
        self.accumulate = accumulation(self.tc, self.workers.world_size)
        if self.workers.is_main:
            self.log = log or to_stderr
        else:  # only rank 0 logs
            self.log = silent
        self.run_dir = RunDirectory(run_dir, is_main=self.workers.is_main, log=self.log)
        set_threads(self.tc.threads, self.workers)
        self.device = self.workers.device
        self._own_gpu = self.device if self.workers.enabled and self.device.type == "cuda" else None  # RNG state
        # Rank 0 checks the run directory and trains the tokenizer; then the others load it.
        self.task, resume_from = self.workers.main_first(lambda: self._prepare(resume))
        resume_from = self.workers.broadcast(resume_from)  # rank 0's choice, should the ranks' listings differ
        torch.manual_seed(self.tc.seed)  # model init independent of what data preparation drew
        self.model = self.task.build_model().to(self.device)
        model_name = type(self.model).__name__  # the textbook's class, before the engine's takes its place
        prepare(self.model, Engine(self.tc.engine))  # in place: the same function, maybe computed faster
        if self.tc.engine != "reference" and self.device.type == "cpu":
            hold_freed_memory()  # every update's tensors in pages already mapped (engine/memory.py)
        if self.tc.engine == "compiled":
            self.log("train.engine: compiled: training has no compiled path (only a language model's generation "
                     "has); it runs eager")
        # rank 0 chooses (measuring, on a CPU, while the others wait) and every rank computes so
        choice = self.workers.agree(lambda: self._choose_precision(resume_from) if self.workers.is_main else None)
        self.precision: Choice = self.workers.broadcast(choice)
        self.bf16 = self.precision.bf16
        if self.precision.onednn and self.tc.engine != "reference":  # measured faster here (engine/onednn.py)
            use_onednn(self.model)
        self.objective = self.task.objective(self.model)  # the model and its loss: what DDP wraps
        if self.workers.enabled:  # one dropout stream per rank
            torch.manual_seed(distributed.rank_seed(self.tc.seed, self.workers.rank, 0))
        # fused: one kernel over all parameters (CPU and CUDA)
        self.optimizer = make_optimizer(self.task.parameter_groups(self.model), self.tc,
                                        fused=self.device.type in ("cpu", "cuda"))
        self.step, self.epoch, self.batch_pos = 0, 0, 0
        self.best_score, self.bad_validations = -math.inf, 0
        self.seconds_before = 0.0  # wall-clock training time of earlier sessions (resume)
        self._session_start = time.perf_counter()
        self.clock = 0.0  # training minutes as of the last update, by rank 0's clock (with max_minutes only)
        if resume_from is not None:
            self.workers.agree(lambda: self._load_checkpoint(resume_from))
        else:
            self.run_dir.truncate_metrics(self.step)  # validations of a run that never reached a checkpoint
        self.train_objective = self.workers.wrap(self.objective, self._probe_loss)  # DDP, or the objective itself
        n_params = sum(p.numel() for p in self.model.parameters())
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        frozen = f" ({trained / 1e6:.3f}M of them trained)" if trained < n_params else ""
        workers = f", {self.workers.world_size} processes" if self.workers.enabled else ""
        self.log(f"{self.task.name}: {model_name} with {n_params / 1e6:.2f}M parameters{frozen} on "
                 f"{self.device} ({'bf16 autocast' if self.bf16 else 'float32'}, {torch.get_num_threads()} threads"
                 f"{workers}, {self.tc.engine} engine)")
        self.log(f"precision: {self.precision.describe()}")
        self.log(f"effective batch: max_tokens {self.tc.max_tokens} x accumulate {self.accumulate} x "
                 f"{self.workers.world_size} worker(s) = {self.tokens_per_update} tokens per update (padded, at most)")

    @property
    def tokens_per_update(self) -> int:
        """The effective batch: padded tokens per update over all workers (an upper bound)."""
        return self.tc.max_tokens * self.accumulate * self.workers.world_size

    def _prepare(self, resume: bool) -> tuple[Task, Path | None]:
        """Claim the run directory (rank 0 writes its config) and build the task -> (task, checkpoint to resume)."""
        run_dir = self.run_dir
        if self.workers.is_main:
            run_dir.claim(self.cfg, resume)
        elif not run_dir.config_file.exists():
            raise UserError(f"rank {self.workers.rank} cannot see {run_dir.config_file} written by rank 0: "
                            f"on several machines --run-dir must be on a filesystem all of them share")
        torch.manual_seed(self.tc.seed)
        task = make_task(self.cfg, run_dir.path, self.log, resume=resume)
        existing = run_dir.checkpoints()
        return task, (existing[-1] if resume and existing else None)

    def _choose_precision(self, resume_from: Path | None) -> Choice:
        """``train.precision`` for this model (:func:`~attnkit.engine.precision.training_precision`), recorded in the
        run directory; a resumed ``auto`` run takes the recorded choice, so that it computes as it started."""
        if resume_from is not None and self.tc.precision == "auto":
            recorded = self.run_dir.read_precision()
            try:
                return replace(Choice.from_json(recorded or {}), source="resumed")
            except (ValueError, KeyError, TypeError, AttributeError):
                pass  # none recorded (a run from before precisions were recorded): chosen again
        # the rows of each product: a pass's padded tokens (accumulation repeats passes)
        choice = training_precision(self.tc.precision, self.model, self.device, self.tc.max_tokens)
        if self.tc.engine == "reference":  # the textbook's plain ops: the BLAS, whatever measures faster
            choice = replace(choice, onednn=False)
        self.run_dir.write_precision(choice.to_json())
        return choice

    def _probe_loss(self) -> torch.Tensor:
        """The loss of one training example: DDP's check for parameters a forward pass leaves unused."""
        batch = self.task.collate(self.task.batches(0)[0][:1], self.device)
        with autocast(self.device, self.bf16):
            return self.task.loss(self.objective, batch, 0.0)

    # -- checkpoints ---------------------------------------------------------------------

    def _trainer_state(self, rng_ranks: list[dict]) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "epoch": self.epoch,
                 "batch_pos": self.batch_pos, "best_score": self.best_score,
                 "bad_validations": self.bad_validations, "rng": rng_ranks[0],
                 "train_seconds": self.seconds_before + time.perf_counter() - self._session_start}
        if self.workers.enabled:  # resuming with as many workers restores each rank's stream
            state["rng_ranks"] = rng_ranks
        return state

    def save_checkpoint(self) -> Path:
        """Checkpoint this update (called on every rank: it gathers their RNG states; rank 0 writes)."""
        rng_ranks = self.workers.gather(capture_rng_state(self._own_gpu))
        state = self._trainer_state(rng_ranks) if self.workers.is_main else {}
        # the plain model's weights, not DDP's: no "module." prefix
        return self.run_dir.save_checkpoint(self.step, checkpoint_state(self.model), state, self.tc.keep_checkpoints)

    def _load_checkpoint(self, path: Path) -> None:
        weights, ts = self.run_dir.load_checkpoint(path)
        check_compatible(checkpoint_state(self.model), weights, path / MODEL_FILE)  # e.g. resumed with other model.*
        self.model.load_state_dict(weights, strict=not is_adapted(self.model))  # adapters: the base is loaded
        try:
            self.optimizer.load_state_dict(ts["optimizer"])
        except ValueError as e:  # AdamW splits each parameter group in two: its state does not fit Adam's
            raise UserError(f"{path}: its optimiser state does not fit this run's ({e}); resume with the "
                            f"train.optimizer it was trained with (here: {self.tc.optimizer})") from None
        self.step, self.epoch, self.batch_pos = ts["step"], ts["epoch"], ts["batch_pos"]
        self.best_score, self.bad_validations = ts["best_score"], ts["bad_validations"]
        self.seconds_before = float(ts.get("train_seconds", 0.0))
        self.clock = self.seconds_before / 60
        self._restore_rng(ts)
        self.run_dir.truncate_metrics(self.step)
        self.log(f"resumed from {path} (update {self.step}, epoch {self.epoch + 1}, batch {self.batch_pos})")

    def _restore_rng(self, ts: dict) -> None:
        """This rank's saved RNG state; other streams (and a warning) when the number of workers changed."""
        w = self.workers
        ranks = ts.get("rng_ranks")
        written_by = len(ranks) if ranks is not None else 1
        if ranks is not None and written_by == w.world_size:
            restore_rng_state(ranks[w.rank], self._own_gpu)
            return
        if not w.enabled:
            restore_rng_state(ts["rng"])  # rank 0's stream (the only one of a single-process checkpoint)
        else:
            torch.manual_seed(distributed.rank_seed(self.tc.seed, w.rank, self.step))
        if written_by != w.world_size:
            self.log(f"the checkpoint was written by {written_by} process(es), this run has {w.world_size}: the "
                     f"random streams (dropout) and, unless train.tokens_per_update is set, the tokens per update "
                     f"differ, so the run is not bit-for-bit an uninterrupted one")

    # -- the loop ------------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Rank 0 validates, logs and keeps the best weights; every rank gets the metrics and early-stopping state."""
        metrics = self._validate_here() if self.workers.is_main else {}
        metrics, self.best_score, self.bad_validations = self.workers.broadcast(
            (metrics, self.best_score, self.bad_validations))
        return metrics

    def _validate_here(self) -> dict[str, float]:
        with autocast(self.device, self.bf16):
            metrics = self.task.validate(self.model, self.device)
        metrics = {"step": self.step, "epoch": self.epoch + 1, "minutes": round(self.minutes(), 2),
                   **{k: round(v, 4) for k, v in metrics.items()}}
        self.run_dir.log_metrics(metrics)
        if metrics["score"] > self.best_score:
            self.best_score, self.bad_validations = metrics["score"], 0
            self.run_dir.save_best(checkpoint_state(self.model), self.step)
        else:
            self.bad_validations += 1
        self.log("validation " + " ".join(f"{k} {v}" for k, v in metrics.items()))
        return metrics

    def _out_of_time(self) -> bool:
        """With ``max_minutes``: read the clock (rank 0's, so every rank takes the same lr and stops together) into
        ``self.clock``; whether the budget is spent."""
        if self.tc.max_minutes <= 0:
            return False
        self.clock = self.workers.broadcast(self.minutes())
        return self.clock >= self.tc.max_minutes

    def minutes(self) -> float:
        """Wall-clock minutes spent training this run, over all sessions (resume included)."""
        return (self.seconds_before + time.perf_counter() - self._session_start) / 60

    def run(self) -> dict[str, float]:
        tc, model = self.tc, self.model
        model.train()
        self._session_start = time.perf_counter()
        metrics: dict[str, float] = {}
        targets_seen, last_report = 0, time.perf_counter()
        bar = progress(tc.max_updates, self.step, unit="update", enabled=tc.progress and self.workers.is_main)
        stop = self.step >= tc.max_updates
        while not stop and self.epoch < tc.max_epochs:
            batches = self.task.batches(self.epoch)
            while self.batch_pos < len(batches):
                group = batches[self.batch_pos: self.batch_pos + self.accumulate * self.workers.world_size]
                loss_value, n_targets = self.train_step(group)
                targets_seen += n_targets
                self.batch_pos += len(group)
                self.step += 1
                now = time.perf_counter()
                if now - last_report > 1.0:
                    lr = self.optimizer.param_groups[0]["lr"]
                    rate = {f"{self.task.rate_unit}_s": f"{targets_seen / (now - last_report):.0f}"}
                    bar.set_postfix(loss=f"{loss_value.item():.3f}", lr=f"{lr:.2e}", **rate, refresh=False)
                    targets_seen, last_report = 0, now
                bar.update(1)
                out_of_time = self._out_of_time()  # at every update: the next update's lr reads the clock
                stop = self.step >= tc.max_updates or out_of_time
                epoch_done = False
                if self.step % tc.valid_every == 0 or stop:
                    metrics = self.validate()
                    if self.batch_pos >= len(batches):  # the checkpoint must point at the next epoch
                        self.epoch, self.batch_pos, epoch_done = self.epoch + 1, 0, True
                    self.save_checkpoint()
                    if tc.patience and self.bad_validations >= tc.patience:
                        self.log(f"early stopping: no improvement in {tc.patience} validations")
                        stop = True
                    if not stop:  # a validation that spent the rest ends the run, not one more update and validation
                        stop = self._out_of_time()
                if stop or epoch_done:  # epoch_done: fetch the new epoch's batches, not replay these
                    break
            else:
                self.epoch, self.batch_pos = self.epoch + 1, 0
        bar.close()
        if not metrics or metrics.get("step") != self.step:
            metrics = self.validate()
            self.save_checkpoint()
        if self.workers.is_main:
            self.run_dir.average_last(self.tc.average_last)
        self.workers.barrier()  # the run directory is complete when run() returns, on every rank
        self.log(f"trained {self.step} updates in {self.minutes():.1f} min; run: {self.run_dir.path}")
        return metrics

    def train_step(self, group: list[list[int]]) -> tuple[torch.Tensor, int]:
        """One optimizer update over ``group`` -> (mean loss per target, a 0-dim tensor on the device that is read
        only when the progress line shows it, so a GPU is not waited for every update; targets), over all ranks.

        ``group`` is the update's batches on every rank (``accumulate x world_size`` of them, fewer
        at the end of an epoch); this rank runs its share (:func:`attnkit.training.distributed.shard`).
        The gradient is that of ``sum of losses / targets of the whole update``.
        """
        tc, w = self.tc, self.workers
        lr = learning_rate(self.step + 1, tc, model_width(self.model), self.clock)
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)  # a task may train some parameters faster (mlm.generator_lr)
        share = distributed.shard(group, w.rank, w.world_size)
        batches = [(self.task.collate(b, self.device), weight) for b, weight in share]
        n_total = sum(b.n_targets for b, weight in batches if weight)
        if w.enabled:
            n_total = round(w.sum([n_total])[0])
        total = torch.zeros((), device=self.device)  # summed on the device: no wait for the GPU every update
        for i, (batch, weight) in enumerate(batches):
            with w.no_sync(self.train_objective, sync=i == len(batches) - 1):  # all-reduce once, after the last
                with autocast(self.device, self.bf16):
                    loss = self.task.loss(self.train_objective, batch, tc.label_smoothing)
                scaled = loss / n_total
                if w.enabled:  # DDP averages the ranks' gradients; x world_size makes that the sum we want
                    scaled = scaled * (weight * w.world_size)
                scaled.backward()
            total += loss.detach().float() * weight
        if w.enabled:
            total = torch.tensor(w.sum([total.item()])[0])
        if tc.clip_norm > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / max(n_total, 1), n_total
