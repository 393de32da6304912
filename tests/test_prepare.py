"""Tests for attnkit.data.prepare: exact round trip, reuse and invalidation by the manifest, kills, the CLI."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import dump_config, load_config
from attnkit.config.schema import RunConfig
from attnkit.data import arrays, dates
from attnkit.data import prepare as prep
from attnkit.data.batching import filter_examples, pad_batch
from attnkit.data.documents import classifier_inputs, is_held_out, text_windows
from attnkit.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from attnkit.runs.layout import DATA_DIR, MANIFEST_FILE
from attnkit.tasks import make_task, prepare
from attnkit.tasks.classification import read_validation
from attnkit.tasks.translation import TranslationTask
from test_data import reference_make_batches

ROOT = Path(__file__).resolve().parents[1]


def quiet(msg: str) -> None:
    pass


def write_corpus(tmp: Path, n: int = 400, seed: int = 3) -> tuple[Path, Path, list[tuple[str, str]]]:
    """A parallel corpus in two files; a few pairs have an empty side (filtered) or are long (filtered)."""
    pairs = dates.generate_pairs(n, seed=seed)
    pairs[5] = ("", pairs[5][1])
    pairs[17] = (" ".join(p[0] for p in pairs[:30]), pairs[17][1])  # over max_len subwords
    src, tgt = tmp / "train.src", tmp / "train.tgt.gz"
    src.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    tgt.write_bytes(gzip.compress("".join(t + "\n" for _, t in pairs).encode(), mtime=0))
    return src, tgt, pairs


def config(src: Path, tgt: Path, **data) -> RunConfig:
    raw = {"task": "translate",
           "data": {"train": str(src), "train_tgt": str(tgt), "valid": str(src), "valid_tgt": str(tgt),
                    "max_len": 40, "tokenizer": {"vocab_size": 90}, **data},
           "model": {"transformer": {"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 1,
                                     "decoder_layers": 1, "dropout": 0.0, "max_len": 64}},
           "train": {"max_tokens": 300, "max_updates": 4, "valid_every": 1000, "progress": False, "precision": "fp32",
                     "threads": 1, "warmup": 2, "valid_bleu_sentences": 0, "average_last": 0}}
    return load_config(RunConfig, raw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, list[tuple[str, str]]]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# -- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_prepared_ids_equal_in_memory_tokenization(tmp_path, corpus, workers):
    """In one process or several (spawned): the kept pairs' ids, in corpus order, exactly."""
    src, tgt, pairs = corpus
    data = prepare(config(src, tgt), tmp_path / "run", quiet, workers=workers)
    tok = Tokenizer.load(tmp_path / "run")
    src_ids, tgt_ids = tok.encode_src([s for s, _ in pairs]), tok.encode_tgt([t for _, t in pairs])
    keep, stats = filter_examples(list(zip(src_ids, tgt_ids, strict=True)), 40)
    assert stats.empty == 1 and stats.too_long == 1 and len(data) == len(keep) == stats.kept
    assert [data.sides["src"][i] for i in range(len(data))] == [src_ids[i] for i in keep]
    assert [data.sides["tgt"][i] for i in range(len(data))] == [tgt_ids[i] for i in keep]
    assert data.sides["src"].ids.dtype == np.uint16 and isinstance(data.sides["src"].ids, np.memmap)
    assert data.manifest["filter"] == {"kept": stats.kept, "empty": 1, "too_long": 1, "max_len": 40}


def test_task_batches_and_tensors_equal_the_in_memory_path(tmp_path, corpus):
    """Batches from the mapped lengths and tensors gathered from the map == lists of ids padded (the old path)."""
    src, tgt, pairs = corpus
    task = TranslationTask(config(src, tgt), tmp_path / "run", quiet)
    tok = task.tok
    src_ids, tgt_ids = tok.encode_src([s for s, _ in pairs]), tok.encode_tgt([t for _, t in pairs])
    keep, _ = filter_examples(list(zip(src_ids, tgt_ids, strict=True)), 40)
    old_src = [src_ids[i] + [EOS_ID] for i in keep]
    old_tgt = [[BOS_ID] + tgt_ids[i] + [EOS_ID] for i in keep]
    for epoch in (0, 3):
        expected = reference_make_batches([len(s) for s in old_src], [len(t) - 1 for t in old_tgt], 300,
                                          seed=1, epoch=epoch, pad_multiple=4)
        assert task.batches(epoch) == expected
    for idx in task.batches(0)[:5]:
        batch = task.collate(idx, torch.device("cpu"))
        s, tgt_in, real = batch.src, batch.tgt_in, batch.scored
        assert torch.equal(s, pad_batch([old_src[i] for i in idx], PAD_ID, 4))
        assert torch.equal(tgt_in, pad_batch([old_tgt[i][:-1] for i in idx], PAD_ID, 4))
        tgt_out = pad_batch([old_tgt[i][1:] for i in idx], PAD_ID, 4)
        assert torch.equal(real, tgt_out.ne(PAD_ID)) and torch.equal(batch.targets, tgt_out[real])


def test_released_pages_are_mapped_again_unchanged(tmp_path, corpus):
    """Dropping the mapped pages from the resident set (every RELEASE_EVERY batches) changes no gathered id."""
    src, tgt, _ = corpus
    side = prepare(config(src, tgt), tmp_path, quiet).sides["src"]
    idx = list(range(0, len(side), 7))
    before = side.pad(idx, PAD_ID, 4, eos=EOS_ID)
    for _ in range(2 * side.RELEASE_EVERY):
        side.pad(idx[:3], PAD_ID)
    side.release()
    assert torch.equal(side.pad(idx, PAD_ID, 4, eos=EOS_ID), before)


def test_classification_round_trip(tmp_path):
    rows = [(f"text {i} " + "word " * (i % 7), ["pos", "neg", "mid"][i % 3]) for i in range(300)]
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in rows), encoding="utf-8")
    raw = {"task": "classify", "data": {"train": str(path), "valid": str(path), "max_len": 5,
                                        "tokenizer": {"vocab_size": 40}}}
    data = prepare(load_config(RunConfig, raw), tmp_path / "run", quiet, workers=2)
    assert data.classes == ["mid", "neg", "pos"]
    assert data.labels.tolist() == [data.classes.index(label) for _, label in rows]
    expected = classifier_inputs(data.tok, [t for t, _ in rows], load_config(RunConfig, raw).data)
    assert [data.sides["text"][i] for i in range(len(rows))] == expected
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == data.classes


@pytest.mark.parametrize("workers", [0, 2])
def test_classification_holds_out_whole_groups_and_trains_on_the_rest(tmp_path, workers):
    """The held-out rows are whole groups (is_held_out per movie); <br /> and head+tail truncation are applied."""
    rows = [(f"review {i} of movie {i % 25}<br />it was " + "very " * (i % 9) + ("good" if i % 2 else "bad"),
             "pos" if i % 2 else "neg", f"tt{i % 25}") for i in range(300)]
    path = tmp_path / "imdb.tsv"
    path.write_text("label\tmovie\ttext\n" + "".join(f"{y}\t{g}\t{t}\n" for t, y, g in rows), encoding="utf-8")
    raw = {"task": "classify", "data": {"train": str(path), "valid_fraction": 0.2, "group_column": "movie",
                                        "max_len": 8, "truncate": "head+tail", "tokenizer": {"vocab_size": 60}}}
    cfg = load_config(RunConfig, raw)
    data = prepare(cfg, tmp_path / "run", quiet, workers=workers)
    held = [is_held_out(g, 0.2, cfg.data.valid_seed) for _, _, g in rows]
    kept = [r for r, h in zip(rows, held, strict=True) if not h]
    assert 0 < len(kept) < len(rows) and len(data) == len(kept)
    assert [data.sides["text"][i] for i in range(len(kept))] == classifier_inputs(data.tok, [t for t, _, _ in kept],
                                                                                  cfg.data)
    assert all("br" not in "".join(data.tok.src_pieces_from_ids(data.sides["text"][i])) for i in range(len(kept)))
    valid = read_validation(cfg, quiet)
    assert valid.texts == [t for (t, _, _), h in zip(rows, held, strict=True) if h]
    assert not {g for t, _, g in rows if t in set(valid.texts)} & {g for _, _, g in kept}


def test_pretraining_data_are_windows_of_the_training_texts(tmp_path):
    texts = [" ".join(f"word{(i * 7 + j) % 31}" for j in range(3 + i % 40)) for i in range(200)]
    path = tmp_path / "text.txt"
    path.write_text("".join(t + "\n\n" for t in texts), encoding="utf-8")  # blank lines are skipped
    raw = {"task": "pretrain", "data": {"train": str(path), "valid_fraction": 0.1, "max_len": 12,
                                        "tokenizer": {"vocab_size": 60}}, "mlm": {"min_len": 4}}
    cfg = load_config(RunConfig, raw)
    data = prepare(cfg, tmp_path / "run", quiet, workers=2)
    assert data.tok.mask_id == 4 and data.labels is None
    held = [is_held_out(str(i), 0.1, cfg.data.valid_seed) for i in range(len(texts))]
    kept = [t for t, h in zip(texts, held, strict=True) if not h]
    expected = text_windows(data.tok.encode_src(kept), 12, 4)
    assert [data.sides["text"][i] for i in range(len(data))] == expected
    assert all(4 <= len(w) <= 12 for w in expected)


@pytest.mark.parametrize("change", ["data.truncate=head+tail", "data.line_break_tags=keep", "data.valid_fraction=0.3",
                                    "data.valid_seed=2"])
def test_a_changed_classification_setting_prepares_again(tmp_path, change):
    path = tmp_path / "t.tsv"
    path.write_text("label\ttext\n" + "".join(f"{'pos' if i % 2 else 'neg'}\tsome text {i}<br />more\n"
                                               for i in range(100)), encoding="utf-8")
    raw = {"task": "classify", "data": {"train": str(path), "valid_fraction": 0.1, "max_len": 4,
                                        "tokenizer": {"vocab_size": 40}}}
    prepare(load_config(RunConfig, raw), tmp_path / "run", quiet)
    key = change.split("=")[0].removeprefix("data.")
    with pytest.raises(UserError, match=rf"data settings changed \({key} "):
        prepare(load_config(RunConfig, raw, [change]), tmp_path / "run", quiet, resume=True)


# -- reuse and invalidation -----------------------------------------------------------------


def test_same_inputs_reuse_the_prepared_data(tmp_path, corpus, monkeypatch):
    src, tgt, _ = corpus
    first = prepare(config(src, tgt), tmp_path, quiet)
    monkeypatch.setattr(prep, "_encode_into", lambda *a, **k: pytest.fail("prepared again"))
    monkeypatch.setattr(prep, "train_tokenizer", lambda *a, **k: pytest.fail("tokenizer trained again"))
    again = prepare(config(src, tgt), tmp_path, quiet)
    assert again.manifest == first.manifest


def test_changed_inputs_are_prepared_again_but_stop_a_resume(tmp_path):
    src, tgt, pairs = write_corpus(tmp_path)
    run = tmp_path / "run"
    before = prepare(config(src, tgt), run, quiet)
    with src.open("a", encoding="utf-8") as f:  # one more line on both sides
        f.write("1. Januar 2000\n")
    tgt.write_bytes(gzip.compress("".join(t + "\n" for _, t in [*pairs, ("", "2000-01-01")]).encode(), mtime=0))
    with pytest.raises(UserError, match=r"train\.src changed .* --resume cannot continue"):
        prepare(config(src, tgt), run, quiet, resume=True)
    logged: list[str] = []
    after = prepare(config(src, tgt), run, logged.append)
    assert any("changed" in m and "preparing the data again" in m for m in logged)
    assert len(after) == len(before) + 1
    assert after.manifest["sources"][0]["sha256"] != before.manifest["sources"][0]["sha256"]
    # a setting the ids depend on
    with pytest.raises(UserError, match=r"data settings changed \(max_len 40 -> 30\)"):
        prepare(config(src, tgt, max_len=30), run, quiet, resume=True)
    assert prepare(config(src, tgt, max_len=30), run, quiet).manifest["filter"]["max_len"] == 30
    # the tokenizer replaced behind the data's back: encoded again, not retrained
    (run / "tokenizer.json").write_text((run / "tokenizer.json").read_text() + " ")
    logged.clear()
    prepare(config(src, tgt, max_len=30), run, logged.append)
    assert logged[0].startswith("the tokenizer files changed") and not any("training a" in m for m in logged)


def test_train_resume_stops_when_the_data_changed(tmp_path, capsys):
    src, tgt, _ = write_corpus(tmp_path, n=120)
    cfg_path = tmp_path / "c.yaml"
    dump_config(config(src, tgt), cfg_path)
    run = tmp_path / "run"
    assert main(["train", str(cfg_path), "--run-dir", str(run)]) == 0
    src.write_text(src.read_text(encoding="utf-8").replace("1", "2"), encoding="utf-8")
    capsys.readouterr()
    assert main(["train", str(cfg_path), "--run-dir", str(run), "--resume", "train.max_updates=6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.src changed" in err and "--resume cannot continue" in err


# -- kills ----------------------------------------------------------------------------------


def test_an_error_mid_write_leaves_nothing_behind(tmp_path, corpus, monkeypatch):
    src, tgt, _ = corpus
    calls = {"n": 0}
    write = arrays.NpyWriter.write

    def failing(self, values):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("disk full")
        write(self, values)

    monkeypatch.setattr(arrays.NpyWriter, "write", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(config(src, tgt), tmp_path, quiet)
    assert not (tmp_path / DATA_DIR).exists() and not list(tmp_path.glob(".data-*"))


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from attnkit import tasks
from attnkit.data import prepare as prep
from test_prepare import config, quiet
from pathlib import Path
replace = os.replace
def kill(a, b):
    if Path(b).name == {when!r}:
        os.kill(os.getpid(), signal.SIGKILL)  # like kill -9 (or a power cut) at that instant
    replace(a, b)
prep.os.replace = kill
tasks.prepare(config(Path({src!r}), Path({tgt!r})), Path({run!r}), quiet, workers=0)
"""


@pytest.mark.parametrize("reprepare", [False, True])
def test_a_kill_during_prepare_is_never_trusted(tmp_path, corpus, reprepare):
    """SIGKILL just before the finished data is renamed into place (a first prepare, or a re-prepare whose old
    data was moved aside): the next run prepares from scratch, removes the leftovers and gives exactly the
    data of an uninterrupted run."""
    src, tgt, _ = corpus
    run = tmp_path / "run"
    if reprepare:
        prepare(config(src, tgt, max_len=30), run, quiet)
    when = "data"
    script = KILLED.format(tests=str(ROOT / "tests"), when=when, src=str(src), tgt=str(tgt), run=str(run))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert list(run.glob(".data-tmp-*")) and not (run / DATA_DIR / MANIFEST_FILE).exists()
    logged: list[str] = []
    data = prepare(config(src, tgt), run, logged.append)
    assert not any(m.startswith("using the prepared data") for m in logged)
    assert not list(run.glob(".data-*"))
    fresh = prepare(config(src, tgt), tmp_path / "fresh", quiet)
    assert data.manifest["sides"] == fresh.manifest["sides"]
    for side in ("src", "tgt"):
        assert np.array_equal(data.sides[side].ids, fresh.sides[side].ids)


# -- several processes ---------------------------------------------------------------------


def test_ddp_ranks_share_one_map_and_read_disjoint_batches(tmp_path, corpus):
    """Under torchrun, rank 0 prepares and rank 1 maps the same files; each update's batches are split between
    the ranks, none read twice."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this PyTorch build has no torch.distributed with the gloo backend")
    src, tgt, _ = corpus
    cfg_path, run = tmp_path / "c.yaml", tmp_path / "run"
    dump_config(config(src, tgt), cfg_path)  # 4 updates of 2 batches: far from the epoch's end
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "ddp_prepared.py"), str(cfg_path), str(run), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert r0["ids_file"] == r1["ids_file"] == str(run / DATA_DIR / "src.ids.npy")
    assert r0["manifest"] == r1["manifest"]  # rank 1 reused rank 0's data, it did not prepare its own
    assert len(r0["seen"]) == len(r1["seen"]) == 4
    for update, (a, b) in enumerate(zip(r0["seen"], r1["seen"], strict=True)):
        assert [a, b] == r0["batches"][2 * update: 2 * update + 2]
        assert not set(a) & set(b)


# -- command line ----------------------------------------------------------------------------


def test_cli_prepare_then_train_reuses_it(tmp_path, corpus, capsys):
    src, tgt, _ = corpus
    cfg_path = tmp_path / "c.yaml"
    dump_config(config(src, tgt), cfg_path)
    run = tmp_path / "run"
    assert main(["prepare", str(cfg_path), "--run-dir", str(run), "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run / DATA_DIR}: ") and " examples, " in out
    created = json.loads((run / DATA_DIR / MANIFEST_FILE).read_text())["created"]
    logged: list[str] = []
    make_task(config(src, tgt), run, logged.append)
    assert any(m.startswith("using the prepared data") for m in logged)
    assert json.loads((run / DATA_DIR / MANIFEST_FILE).read_text())["created"] == created
    assert main(["prepare", str(cfg_path), "--run-dir", str(run), "--workers", "-1"]) == 2
