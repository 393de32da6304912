"""Long documents: <br /> tags, truncation modes, held-out validation rows grouped by a column."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data.documents import classifier_inputs, clean_text, is_held_out, split_rows, truncate
from attnkit.data.labelled import LabelledReader, read_labelled
from attnkit.data.tokenizer import train_tokenizer

IMDB = Path(__file__).resolve().parents[2] / "shared" / "data" / "imdb" / "train.tsv.gz"


def test_truncate_head_keeps_the_first_subwords() -> None:
    ids = list(range(100, 120))
    assert truncate(ids, 8, "head") == list(range(100, 108))
    assert truncate(ids[:5], 8, "head") == ids[:5]


def test_truncate_head_tail_keeps_a_quarter_from_the_start_and_the_rest_from_the_end() -> None:
    ids = list(range(100, 120))  # 20 subwords
    assert truncate(ids, 8, "head+tail") == [100, 101] + list(range(114, 120))
    assert truncate(ids, 20, "head+tail") == ids
    assert truncate(ids, 3, "head+tail") == [117, 118, 119]  # max_len // 4 == 0: the tail only


def test_line_break_tags_become_line_breaks_or_stay() -> None:
    text = "Great.<br /><br />Really<br/>great<BR>."
    assert clean_text(text, "newline") == "Great.\n\nReally\ngreat\n."
    assert clean_text(text, "keep") == text


def test_a_line_break_is_a_space_to_sentencepiece(tmp_path: Path) -> None:
    texts = ["a good film and a bad film", "the plot was thin but the acting was fine"] * 20
    tok = train_tokenizer(texts, None, tmp_path, vocab_size=40, seed=1)
    assert tok.encode_src(["a good film\nand a bad film"]) == tok.encode_src(["a good film and a bad film"])


def test_classifier_inputs_clean_then_truncate(tmp_path: Path) -> None:
    texts = ["one two three four five six seven eight"] * 30
    tok = train_tokenizer(texts, None, tmp_path, vocab_size=30, model_type="char", seed=1)
    d = load_config(RunConfig, {"task": "classify", "data": {"train": "x.tsv", "valid": "y.tsv", "max_len": 6,
                                                           "truncate": "head+tail"}}).data
    full = tok.encode_src(["one two"])[0]  # ▁ o n e ▁ t w o: the tag reads as one space
    assert len(full) == 8
    assert classifier_inputs(tok, ["one<br />two"], d) == [full[:1] + full[-5:]]


def held_out_rows(n: int, fraction: float, seed: int, groups: list[str] | None = None) -> list[bool]:
    return [is_held_out(key, fraction, seed) for key in (groups or [str(i) for i in range(n)])]


def test_held_out_rows_keep_each_group_on_one_side() -> None:
    groups = [f"tt{i % 300}" for i in range(3000)]
    held = held_out_rows(len(groups), 0.1, seed=1, groups=groups)
    held_groups = {g for g, h in zip(groups, held, strict=True) if h}
    kept_groups = {g for g, h in zip(groups, held, strict=True) if not h}
    assert held_groups and not held_groups & kept_groups
    assert 0.05 < len(held_groups) / 300 < 0.15
    assert held == held_out_rows(len(groups), 0.1, seed=1, groups=groups)  # deterministic
    assert held != held_out_rows(len(groups), 0.1, seed=2, groups=groups)


def test_held_out_rows_without_groups_are_a_seeded_share_of_rows() -> None:
    held = held_out_rows(5000, 0.1, seed=3)
    assert 400 < sum(held) < 600
    assert held_out_rows(4000, 0.1, seed=3) == held[:4000]  # a row's side does not depend on the file's length


def write_tsv(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    path.write_text("label\tmovie\ttext\n" + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


def split_by_movie(path: Path, fraction: float, seed: int = 1) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(training rows, held-out rows)`` as ``(text, movie)``, split as a classification run splits the file."""
    data = load_config(RunConfig, {"task": "classify", "data": {"train": str(path), "valid_fraction": fraction,
                                                              "valid_seed": seed, "group_column": "movie"}}).data
    keyed = [(text, movie, movie) for text, _, movie in LabelledReader(path, group_column="movie").keyed()]
    return list(split_rows(iter(keyed), data, held_out=False)), list(split_rows(iter(keyed), data, held_out=True))


def test_split_by_movie(tmp_path: Path) -> None:
    rows = [("pos" if i % 2 else "neg", f"tt{i % 40}", f"review {i}") for i in range(400)]
    train, valid = split_by_movie(write_tsv(tmp_path / "t.tsv", rows), 0.2)
    assert len(train) + len(valid) == 400 and valid
    assert not {m for _, m in train} & {m for _, m in valid}
    assert sorted(train + valid) == sorted((text, movie) for _, movie, text in rows)


def test_a_review_with_u0085_stays_one_row(tmp_path: Path) -> None:
    path = tmp_path / "r.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
        f.write("label\tmovie\ttext\npos\ttt1\tfirst part\u0085second part<br />third\nneg\ttt2\tbad\n")
    data = read_labelled(path, group_column="movie")
    assert data.texts == ["first part\u0085second part<br />third", "bad"]
    assert data.groups == ["tt1", "tt2"]


def test_group_column_missing_names_the_key(tmp_path: Path) -> None:
    path = write_tsv(tmp_path / "t.tsv", [("pos", "tt1", "good")])
    with pytest.raises(UserError, match="group column 'film' not found.*data.group_column"):
        read_labelled(path, group_column="film")


def test_valid_fraction_or_valid_not_both() -> None:
    with pytest.raises(UserError, match="data.valid or data.valid_fraction"):
        load_config(RunConfig, {"task": "classify", "data": {"train": "a.tsv", "valid": "b.tsv",
                                                           "valid_fraction": 0.1}})


def test_a_held_out_label_never_seen_in_training_is_an_error(tmp_path: Path, capsys) -> None:
    rows = [("pos" if i % 2 else "neg", f"tt{i % 40}", f"review number {i}") for i in range(200)]
    held = held_out_rows(200, 0.2, seed=1, groups=[r[1] for r in rows])
    movie = next(r[1] for r, h in zip(rows, held, strict=True) if h)
    rows += [("meh", movie, "a third class")]  # only in a held-out movie
    train = write_tsv(tmp_path / "t.tsv", rows)
    config = tmp_path / "c.yaml"
    config.write_text(f"task: classify\ndata: {{train: {train}, group_column: movie, valid_fraction: 0.2, "
                      f"max_len: 16, tokenizer: {{vocab_size: 40}}}}\nmodel: {{transformer: {{d_model: 16, n_heads: 2, "
                      f"d_ff: 16, encoder_layers: 1, max_len: 32}}}}\ntrain: {{progress: false, threads: 1}}\n")
    assert main(["train", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the log lines come before it
    assert err.startswith("attnkit: error: ") and "['meh']" in err
    assert "held-out rows" in err and "column 'label'" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.skipif(not IMDB.exists(), reason="needs ../shared/data/imdb/train.tsv.gz beside the repository")
def test_imdb_split_is_grouped_by_movie() -> None:
    data = read_labelled(IMDB, text_column="text", label_column="label", group_column="movie")
    assert len(data) == 25000  # U+0085 inside reviews splits none of them
    train, valid = split_by_movie(IMDB, 0.1)
    assert len(train) + len(valid) == len(data) and 0.07 < len(valid) / len(data) < 0.13
    assert not {m for _, m in train} & {m for _, m in valid}
