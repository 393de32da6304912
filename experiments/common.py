"""What every experiment script shares: paths, data, training on a time budget, scoring, result files.

The scripts in this folder reproduce the seeds' claims for ``docs/experiments.md``. Each writes its
numbers to ``docs/figures/<name>.json`` (with the command line and the measured run time) and its
figures to ``docs/figures/<name>*.png`` (``--figures DIR`` elsewhere: the smoke tests' tiny runs). They read
Multi30k from ``../shared/data/multi30k`` relative to the repository root, like the configs, and are run from
the repository root::

    python experiments/<script>.py [options]

``tests/test_experiments.py`` runs each on tiny inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # tables: the markdown helpers report.py's tables share

from attnkit.common.files import atomic_write_text  # noqa: E402
from attnkit.common.measure import stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.data.batching import pad_batch  # noqa: E402
from attnkit.data.readers import read_parallel  # noqa: E402
from attnkit.data.tokenizer import EOS_ID, PAD_ID  # noqa: E402
from attnkit.inference.scores import translation_scores  # noqa: E402
from attnkit.inference.translate import translate_texts  # noqa: E402
from attnkit.runs.load import LoadedRun  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from attnkit.training.trainer import Trainer  # noqa: E402
from attnkit.transformer import Transformer  # noqa: E402
from attnkit.viz.plot import save_figure  # noqa: E402
from tables import caption, markdown, num  # noqa: E402, F401  (re-exported for the experiments' tables)

DATA = ROOT.parent / "shared" / "data" / "multi30k"
FIGURES = ROOT / "docs" / "figures"
CONFIGS = ROOT / "configs"
TRANSFORMER_CONFIG = CONFIGS / "multi30k-de-en.yaml"
RNN_ATTENTION_CONFIG = CONFIGS / "multi30k-de-en-rnn-bahdanau.yaml"
RNN_NO_ATTENTION_CONFIG = CONFIGS / "multi30k-de-en-rnn-noattn.yaml"
#: The Transformer of the first 60-minute translation benchmark run (``benchmarks/multi30k.py``; its test BLEU is in
#: ``docs/figures/bottleneck.json``); local, not in git.
BENCHMARK_TRANSFORMER = ROOT / "runs" / "multi30k-de-en"
BENCHMARK_RNN_ATTENTION = ROOT / "runs" / "multi30k-de-en-rnn-bahdanau"
#: Written into a run directory by :func:`train_for` when its training has ended.
FINISHED = "experiment-finished.json"


def require_data() -> None:
    """Stop with a sentence, not a traceback, when the shared Multi30k files are not beside the repository."""
    if not (DATA / "test_2016_flickr.de.gz").exists():
        sys.exit(f"{DATA} is missing: these experiments need ../shared/data/multi30k beside the repository")


def require_run(path: Path) -> Path:
    """``path`` when it holds a finished run (``averaged`` or ``best`` weights), else stop with a sentence."""
    if not ((path / "averaged.safetensors").exists() or (path / "best.safetensors").exists()):
        sys.exit(f"{path}: no trained run there (averaged.safetensors / best.safetensors); train it first, "
                 f"e.g. python benchmarks/multi30k.py, or pass another run directory")
    return path


def parser(doc: str | None, threads: int = 0) -> argparse.ArgumentParser:
    """An experiment's argument parser: its docstring as help, ``--threads`` and ``--figures``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=threads, help="torch threads (0 = torch's default)")
    p.add_argument("--figures", type=Path, default=FIGURES,
                   help="where the JSON and the figures go (default docs/figures; elsewhere for a smoke run)")
    return p


def start(name: str, args: argparse.Namespace, needs_data: bool = True) -> Recorder:
    """Check the data, set the threads (so an experiment can share the machine) and start recording ``name``."""
    if needs_data:
        require_data()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return Recorder(name, args.figures)


def load_transformer(path: str | Path) -> LoadedRun:
    """A finished Transformer run, or stop with a sentence saying what ``path`` is instead."""
    run = load_run(require_run(Path(path)))
    if not isinstance(run.model, Transformer):
        sys.exit(f"{path}: this experiment needs a Transformer run, not {type(run.model).__name__}")
    return run


@dataclass
class DevSources:
    """The first dev sentences as a Transformer reads them: ``ids`` with ``</s>``, padded ``batches`` ``(B, S)``."""

    run: LoadedRun
    sources: list[str]
    ids: list[list[int]]
    batches: list[torch.Tensor]


def transformer_on_dev(path: str | Path, n: int, batch_size: int = 64) -> DevSources:
    """A finished Transformer run (:func:`load_transformer`) and the first ``n`` dev sources (0 = all) in batches."""
    run = load_transformer(path)
    sources = [s for s, _ in dev_pairs(n)]
    ids = [s + [EOS_ID] for s in run.tok.encode_src(sources)]
    return DevSources(run, sources, ids, [pad_batch(ids[i: i + batch_size], PAD_ID)
                                          for i in range(0, len(ids), batch_size)])


def test_pairs(n: int = 0) -> list[tuple[str, str]]:
    """The first ``n`` (0 = all 1,000) German-English pairs of Multi30k test_2016_flickr."""
    pairs = read_parallel(DATA / "test_2016_flickr.de.gz", DATA / "test_2016_flickr.en.gz")
    return pairs[:n] if n > 0 else pairs


def dev_pairs(n: int = 0) -> list[tuple[str, str]]:
    """The first ``n`` (0 = all 1,014) pairs of the Multi30k validation set."""
    pairs = read_parallel(DATA / "val.de.gz", DATA / "val.en.gz")
    return pairs[:n] if n > 0 else pairs


def translate(run: LoadedRun, sources: list[str], beam: int) -> list[str]:
    """The run's 1-best translations (``beam`` 1 = greedy) with the run's own length penalty."""
    return [h[0] for h in translate_texts(run.model, run.tok, sources, beam=beam, lenpen=run.cfg.decode_lenpen)]


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacreBLEU, cased, 13a), as ``attnkit evaluate`` reports it."""
    return round(translation_scores(hypotheses, references).bleu, 2)


def score_run(run_dir: Path, pairs: list[tuple[str, str]], beam: int) -> tuple[list[str], float]:
    """The run's translations of ``pairs``' sources and their corpus BLEU against the references."""
    hyps = translate(load_run(run_dir), [s for s, _ in pairs], beam)
    return hyps, bleu(hyps, [t for _, t in pairs])


# --------------------------------------------------------------------------------------
# Training on a budget
# --------------------------------------------------------------------------------------


@dataclass
class TrainedRun:
    """A run directory trained (or found already trained) by :func:`train_for`."""

    name: str
    run_dir: Path
    minutes: float  # wall-clock training minutes (from the last validation record)
    updates: int
    parameters: int
    curve: list[dict]  # metrics.jsonl: one record per validation


def read_curve(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def describe_run(name: str, run_dir: Path) -> TrainedRun:
    """Minutes, updates, parameter count and validation curve of a finished run directory."""
    curve = read_curve(run_dir)
    run = load_run(run_dir)
    n_params = sum(p.numel() for p in run.model.parameters())
    return TrainedRun(name, run_dir, curve[-1]["minutes"], curve[-1]["step"], n_params, curve)


def train_for(name: str, config: Path, run_dir: Path, minutes: float, overrides: Sequence[str] = (),
              valid_every: int = 0) -> TrainedRun:
    """Train ``config`` (+ ``overrides``) into ``run_dir`` for ``minutes`` of wall clock; reuse it when finished.

    Every model of a comparison gets the same budget (``train.max_minutes``); ``valid_every``
    (updates) overrides the config's for denser curves. A run this function finished is marked
    with :data:`FINISHED` and reused as it is (delete the directory to retrain); one that was
    interrupted resumes from its last checkpoint, its budget counting the time already spent.
    """
    if not (run_dir / FINISHED).exists():
        changes = [f"train.max_minutes={minutes}", *overrides]
        if valid_every:
            changes.append(f"train.valid_every={valid_every}")
        cfg = load_config(RunConfig, config, changes)
        metrics = Trainer(cfg, run_dir, resume=(run_dir / "checkpoints").exists()).run()
        finished = {"config": str(config), "overrides": changes, **metrics}
        atomic_write_text(run_dir / FINISHED, json.dumps(finished) + "\n")
    return describe_run(name, run_dir)


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


class Recorder:
    """Collects one script's numbers and writes them, with how they were produced, to ``folder``
    (``docs/figures``)."""

    def __init__(self, name: str, folder: Path = FIGURES) -> None:
        self.name = name
        self.folder = folder
        self.start = time.perf_counter()
        self.results: dict = {}

    def figure(self, fig: Figure, suffix: str = "") -> Path:
        path = save_figure(fig, self.folder / f"{self.name}{suffix}.png")
        print(f"wrote {os.path.relpath(path, ROOT)}")
        return path

    def write(self) -> Path:
        """``<folder>/<name>.json``: the results, the command, run time, threads and machine."""
        seconds = time.perf_counter() - self.start
        record = {
            **stamp(),
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
            "run_seconds": round(seconds, 1),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            **self.results,
        }
        path = self.folder / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(record, indent=2, ensure_ascii=False).replace(str(ROOT) + os.sep, "")  # repo-relative
        atomic_write_text(path, text + "\n")
        print(f"wrote {os.path.relpath(path, ROOT)} ({seconds / 60:.1f} min)")
        return path
