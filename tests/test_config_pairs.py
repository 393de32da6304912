"""Every pretrain -> fine-tune pair of committed configs (configs/ and experiments/configs/) runs, as documented.

A fine-tuning config names its pretraining run with ``model.init_from: runs/NAME``; when
``NAME.yaml`` is beside it, the two are a pair. Each pair is trained here from the committed files
themselves, with overrides that shrink only the data (the first rows of each file) and the time (a
few updates), so a check or a setting that stops the documented commands fails CI instead of a user
(issue 38: ``imdb-finetune.yaml`` once stopped at its ``max_len`` after 40 minutes of pretraining).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import yaml

from attnkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIRS = (ROOT / "configs", ROOT / "experiments" / "configs")  # recipes, and experiments kept runnable
SHARED = ROOT.parent / "shared"
ROWS = 300  # lines kept of each data file (a header included)
#: the data keys that name files, and how many files each holds
FILE_KEYS = ("train", "train_tgt", "valid", "valid_tgt", "extra_text")
#: the time a pair may take here: a few updates, and a validation at the last one
FEW_UPDATES = ["train.max_updates=3", "train.valid_every=3", "train.warmup=2", "train.max_tokens=2048",
               "train.progress=false", "train.threads=1"]


def pairs() -> list[tuple[str, str]]:
    """``(pretraining config, fine-tuning config)`` paths from the repository root: every ``model.init_from:
    runs/NAME`` with a ``NAME.yaml`` beside it."""
    found = []
    for folder in CONFIG_DIRS:
        for path in sorted(folder.glob("*.yaml")):
            init_from = (yaml.safe_load(path.read_text()).get("model") or {}).get("init_from")
            if init_from and (folder / f"{Path(init_from).name}.yaml").exists():
                found.append(((folder / f"{Path(init_from).name}.yaml").relative_to(ROOT).as_posix(),
                              path.relative_to(ROOT).as_posix()))
    return found


def test_the_committed_pairs_are_found() -> None:
    """The discovery itself can fail: the pairs committed when this test was written are among them."""
    assert {("configs/imdb-pretrain.yaml", "configs/imdb-finetune.yaml"),
            ("configs/sst2-pretrain.yaml", "configs/sst2-finetune.yaml"),
            ("configs/imdb-lm.yaml", "configs/imdb-lm-finetune.yaml"),
            ("configs/imdb-lm.yaml", "configs/sst2-lm-finetune.yaml"),
            ("configs/imdb-lm.yaml", "configs/sst2-lm.yaml"), ("configs/sst2-lm.yaml", "configs/sst2-ulmfit.yaml"),
            ("experiments/configs/imdb-electra-pretrain.yaml", "experiments/configs/imdb-electra-finetune.yaml"),
            } <= set(pairs())


def head(source: Path, out_dir: Path, rows: int = ROWS) -> Path:
    """The first ``rows`` lines of ``source``, written into ``out_dir`` under its folder and name (two data sets
    may name their files alike)."""
    out = out_dir / source.parent.name / source.name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        opener = gzip.open if source.suffix == ".gz" else open
        with opener(source, "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(rows), f, strict=False)]
        with opener(out, "wt", encoding="utf-8") as f:
            f.writelines(lines)
    return out


def shrunk_data(config: str, out_dir: Path) -> list[str]:
    """Overrides that point every data file of ``config`` (a path from the repository root) at its first rows."""
    data = yaml.safe_load((ROOT / config).read_text())["data"]
    overrides = []
    for key in FILE_KEYS:
        value = data.get(key)
        if isinstance(value, str):
            overrides.append(f"data.{key}={head(ROOT / value, out_dir)}")
        elif isinstance(value, list):
            overrides.append(f"data.{key}=[{', '.join(str(head(ROOT / v, out_dir)) for v in value)}]")
    return overrides


@pytest.mark.parametrize(("pretrain", "finetune"), pairs())
def test_a_config_pair_trains_as_documented(pretrain: str, finetune: str, tmp_path: Path, monkeypatch) -> None:
    if not (SHARED / "data").is_dir():
        pytest.skip("../shared/data is not beside this checkout: the configs read their data there")
    monkeypatch.chdir(ROOT)  # the configs' paths are relative to the repository root, as the README runs them
    data = tmp_path / "data"
    data.mkdir()
    first, second = tmp_path / Path(pretrain).stem, tmp_path / Path(finetune).stem
    parent = next((p for p, f in pairs() if f == pretrain), None)  # a chain: the pretraining starts from a run too
    start = []
    if parent is not None:
        assert main(["train", parent, "--run-dir", str(tmp_path / "parent"), *shrunk_data(parent, data),
                     *FEW_UPDATES]) == 0
        start = [f"model.init_from={tmp_path / 'parent'}"]
    assert main(["train", pretrain, "--run-dir", str(first), *start,
                 *shrunk_data(pretrain, data), *FEW_UPDATES]) == 0
    assert main(["train", finetune, "--run-dir", str(second), f"model.init_from={first}",
                 *shrunk_data(finetune, data), *FEW_UPDATES]) == 0
    train = yaml.safe_load((ROOT / finetune).read_text())["data"]["train"]
    (tmp_path / "few").mkdir()
    assert main(["evaluate", str(second), "--data", str(head(ROOT / train, tmp_path / "few", 40))]) == 0
