"""Tests for attnkit.cli: every command end to end on tiny models, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from attnkit.cli import main
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.demo import HELD_OUT, demo_config
from attnkit.inference.classify import predict
from attnkit.tasks import load_run
from attnkit.training.trainer import Trainer
from tiny_runs import classification_config, labelled_rows, translation_config, write_lines, write_tsv, write_yaml

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = {
    "demo": ["--out-dir", "--held-out", "--json", "KEY=VALUE"],
    "train": ["--run-dir", "--resume", "KEY=VALUE"],
    "translate": ["--attention-dir", "--input", "--output", "--beam", "--lenpen", "--n-best"],
    "evaluate": ["--src", "--ref", "--data", "--beam", "--hyp-out"],
    "classify": ["--input", "--with-attention"],
    "export": ["--to", "--output", "--quantization", "--force"],
    "serve": ["--host", "--port", "--threads", "--api-key", "--max-texts", "--max-chars", "--max-body", "--max-queue",
              "--max-batch", "--max-wait-ms", "/translate", "/classify", "/models", "/health", "/docs"],
}
def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``attnkit ARGV`` run in-process; ``[::2]`` picks (code, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit status 2, and the last stderr line is the error: one line, naming what is wrong, no traceback."""
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len([ln for ln in lines if ln.startswith("attnkit: error:")]) == 1, err
    assert lines[-1].startswith("attnkit: error: "), err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return lines[-1]


# -- help ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_for_every_subcommand(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: attnkit {command}")
    for option in SUBCOMMANDS[command]:
        assert option in out


def test_top_level_help_lists_commands_and_demo_default_matches(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in SUBCOMMANDS:
        assert command in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert f"default: {HELD_OUT}" in capsys.readouterr().out


# -- demo ------------------------------------------------------------------------------


DEMO_TINY = ("data.generate_train=300", "data.generate_valid=20", "train.max_updates=20",
             "train.valid_every=10", "train.progress=false", "train.threads=1",
             "model.transformer.d_model=32", "model.transformer.d_ff=64", "train.max_tokens=500",
             "data.tokenizer.vocab_size=100", "train.valid_bleu_sentences=20", "train.precision=fp32")


def test_demo_end_to_end(tmp_path, capsys):
    code, out, err = cli(capsys, "demo", "-o", str(tmp_path), "--held-out", "30", "--json", str(tmp_path / "d.json"),
                         *DEMO_TINY)
    assert code == 0, err
    assert re.search(r"^exact match: \d+\.\d%$", out, flags=re.M)
    assert "held-out dates" in out
    png = tmp_path / "attnkit-demo-attention.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "attnkit-demo-run" / "config.yaml").exists()
    figures = json.loads((tmp_path / "d.json").read_text())
    printed = float(re.search(r"^exact match: (\d+\.\d)%$", out, flags=re.M)[1])
    assert round(figures["exact_match"], 1) == printed and figures["held_out"] == 30
    assert figures["updates"] == 20 and figures["overrides"] == list(DEMO_TINY)
    assert 0 < figures["train_minutes"] <= figures["minutes"] and 0 < figures["peak_rss_gb"] < 64
    assert {"date", "commit"} <= figures.keys()

    # run again: the demo deletes its own earlier run and trains afresh
    (tmp_path / "attnkit-demo-run" / "stale.txt").write_text("from the first run")
    assert cli(capsys, "demo", "-o", str(tmp_path), "--held-out", "5", *DEMO_TINY)[0] == 0
    assert not (tmp_path / "attnkit-demo-run" / "stale.txt").exists()


def test_demo_refuses_to_delete_a_run_it_did_not_write(tmp_path, capsys):
    other = tmp_path / "attnkit-demo-run"
    Trainer(demo_config([*DEMO_TINY, "train.max_updates=1"]), other, log=lambda msg: None).run()
    before = sorted(p.relative_to(other) for p in other.rglob("*"))
    assert_one_line_error(*cli(capsys, "demo", "-o", str(tmp_path), *DEMO_TINY)[::2], "not written by attnkit demo")
    assert sorted(p.relative_to(other) for p in other.rglob("*")) == before


def test_demo_rejects_bad_overrides(tmp_path, capsys):
    assert_one_line_error(*cli(capsys, "demo", "-o", str(tmp_path), "train.max_updatez=3")[::2], "train.max_updatez")
    assert_one_line_error(*cli(capsys, "demo", "-o", str(tmp_path), "--held-out", "0")[::2], "--held-out")


# -- translation -----------------------------------------------------------------------


def test_translate_and_evaluate(translation_run, tmp_path, capsys):
    src = write_lines(tmp_path / "test.src", ["3. März 2021", "May 1, 1999", ""])
    ref = write_lines(tmp_path / "test.ref", ["2021-03-03", "1999-05-01", ""])
    code, out, err = cli(capsys, "translate", str(translation_run), "-i", str(src), "--beam", "2", "--n-best", "2")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and all(line.count("\t") == 1 for line in lines)
    hyp = tmp_path / "hyp.txt"
    code, out, err = cli(capsys, "translate", str(translation_run), "-i", str(src), "-o", str(hyp), "--beam", "1")
    assert code == 0 and out == ""
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == 3
    code, out, err = cli(capsys, "evaluate", str(translation_run), "--src", str(src), "--ref", str(ref),
                         "--beam", "1", "--hyp-out", str(tmp_path / "hyp2.txt"))
    assert code == 0, err
    assert re.search(r"^BLEU \d+\.\d\d  chrF \d+\.\d\d", out, flags=re.M) and "tok:13a" in out
    assert (tmp_path / "hyp2.txt").read_text(encoding="utf-8") == hyp.read_text(encoding="utf-8")


def test_translate_bad_flags(translation_run, capsys):
    assert_one_line_error(*cli(capsys, "translate", str(translation_run), "--beam", "1", "--n-best", "2")[::2],
                          "--n-best")
    assert_one_line_error(*cli(capsys, "translate", str(translation_run), "--beam", "-1")[::2], "--beam")
    assert_one_line_error(*cli(capsys, "translate", str(translation_run), "--beam", "0")[::2], "--beam")
    assert_one_line_error(*cli(capsys, "evaluate", str(translation_run), "--src", "a", "--ref", "b",
                               "--beam", "0")[::2], "--beam")
    assert_one_line_error(*cli(capsys, "classify", str(translation_run))[::2], "attnkit translate")


@pytest.mark.parametrize("argv", [
    ["translate", "RUN", "--lenpen", "nan"], ["translate", "RUN", "--lenpen", "inf"],
    ["translate", "RUN", "--max-len-a", "-1"], ["translate", "RUN", "--max-len-a", "NaN"],
    ["translate", "RUN", "--max-len-b", "inf"], ["translate", "RUN", "--batch-size", "0"],
    ["translate", "RUN", "--n-best", "nan"], ["translate", "RUN", "--beam", "2.5"],
    ["evaluate", "RUN", "--lenpen", "inf"], ["evaluate", "RUN", "--beam", "inf"],
    ["attention", "RUN", "--src", "x", "--lenpen", "nan"], ["demo", "--held-out", "0"],
])
def test_numeric_options_are_finite_and_in_range(translation_run, capsys, argv):
    argv = [str(translation_run) if a == "RUN" else a for a in argv]
    line = assert_one_line_error(*cli(capsys, *argv)[::2], f"argument {argv[-2]}", repr(argv[-1]))
    assert f"attnkit {argv[0]} --help" in line


def test_translate_cuts_an_overlong_line_and_keeps_blank_lines_blank(translation_run, tmp_path, capsys):
    long = " ".join(["3. März 2021"] * 60)
    src = write_lines(tmp_path / "in.txt", ["May 1, 1999", long, "", "  ", "3. März 2021"])
    code, out, err = cli(capsys, "translate", str(translation_run), "-i", str(src), "--beam", "1")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("attnkit: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("attnkit: warning: input line 2 is ")
    lines = out.split("\n")
    assert len(lines) == 6 and lines[2:4] == ["", ""] and lines[5] == ""
    code, out, _ = cli(capsys, "translate", str(translation_run), "-i", str(src), "--beam", "2", "--n-best", "2")
    assert out.split("\n")[2:4] == ["\t", "\t"]


def test_unknown_config_key(tmp_path, capsys):
    raw = translation_config(tmp_path)
    raw["train"]["learning_rate"] = 1e-3
    config = write_yaml(tmp_path / "bad.yaml", raw)
    line = assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))[::2],
                                 "train.learning_rate", str(config))
    assert "did you mean" not in line or "train.lr" in line
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"), "model.d_modle=3")[::2],
                          "model.d_modle")


def test_mistyped_config_value(tmp_path, capsys):
    config = write_yaml(tmp_path / "ok.yaml", translation_config(tmp_path))
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"),
                               "train.max_updates=many")[::2], "train.max_updates", "integer")
    raw = translation_config(tmp_path)
    raw["train"]["progress"] = "yes please"
    bad = write_yaml(tmp_path / "bad.yaml", raw)
    assert_one_line_error(*cli(capsys, "train", str(bad), "--run-dir", str(tmp_path / "r"))[::2], "train.progress")


def test_missing_train_file_and_missing_config(tmp_path, capsys):
    raw = translation_config(tmp_path)
    raw["data"]["train"] = str(tmp_path / "nowhere.src")
    config = write_yaml(tmp_path / "c.yaml", raw)
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))[::2],
                          "nowhere.src", "not found")
    assert_one_line_error(*cli(capsys, "train", str(tmp_path / "none.yaml"))[::2], "none.yaml")


def test_parallel_files_of_different_length(tmp_path, capsys):
    raw = translation_config(tmp_path)
    write_lines(tmp_path / "short.tgt", ["2000-01-01"] * 7)
    raw["data"]["train_tgt"] = str(tmp_path / "short.tgt")
    config = write_yaml(tmp_path / "c.yaml", raw)
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))[::2],
                          "train.src", "150", "short.tgt", "7")


def test_empty_validation_set(tmp_path, capsys):
    config = write_yaml(tmp_path / "c.yaml", translation_config(tmp_path))
    write_lines(tmp_path / "valid.src", [])
    write_lines(tmp_path / "valid.tgt", [])
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))[::2],
                          "valid.src", "no validation pairs")


def test_invalid_utf8_names_file_and_line(tmp_path, capsys):
    raw = translation_config(tmp_path)
    (tmp_path / "train.src").write_bytes(b"1 May 1999\n2 May 1999\nM\xe4rz 1999\n" + b"x\n" * 147)
    config = write_yaml(tmp_path / "c.yaml", raw)
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))[::2],
                          "train.src:3", "UTF-8")


def test_corrupt_checkpoint(translation_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "tokenizer.json", "spm.model"):
        (run / name).write_bytes((translation_run / name).read_bytes())
    bad = run / "best.safetensors"
    bad.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    src = write_lines(tmp_path / "in.txt", ["1 May 1999"])
    assert_one_line_error(*cli(capsys, "translate", str(run), "-i", str(src))[::2], "best.safetensors")
    assert_one_line_error(*cli(capsys, "translate", str(bad), "-i", str(src))[::2], "best.safetensors")


def test_foreign_checkpoint(translation_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "tokenizer.json", "spm.model"):
        (run / name).write_bytes((translation_run / name).read_bytes())
    save_file({"encoder.weight": torch.zeros(3, 4), "head.bias": torch.zeros(2)}, str(run / "best.safetensors"))
    src = write_lines(tmp_path / "in.txt", ["1 May 1999"])
    assert_one_line_error(*cli(capsys, "translate", str(run), "-i", str(src))[::2], "best.safetensors",
                          "does not fit")
    # the right keys but other shapes: a checkpoint of a wider model
    state = load_run(translation_run).model.state_dict()
    save_file({k: torch.zeros(*(2 * s for s in v.shape)) for k, v in state.items() if "out_proj" not in k},
              str(run / "best.safetensors"))
    assert_one_line_error(*cli(capsys, "translate", str(run), "-i", str(src))[::2], "shape")


def test_not_a_run_directory(tmp_path, capsys):
    assert_one_line_error(*cli(capsys, "translate", str(tmp_path))[::2], "not a run directory")
    assert_one_line_error(*cli(capsys, "evaluate", str(tmp_path / "missing"))[::2], "missing")


# -- classification --------------------------------------------------------------------


def test_classification_end_to_end(classifier_run, tmp_path, capsys):
    texts = ["the film was great", "a really awful story", "plot and superb"]
    inputs = write_lines(tmp_path / "in.txt", texts)
    code, out, err = cli(capsys, "classify", str(classifier_run), "-i", str(inputs), "--with-attention")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3
    for line, text in zip(lines, texts, strict=True):
        label, prob, shown, tokens = line.split("\t")
        assert label in ("neg", "pos") and 0.5 <= float(prob) <= 1.0 and shown == text
        assert re.fullmatch(r"(\S+:\d\.\d\d ?)+", tokens)
    assert [line.split("\t")[0] for line in lines] == ["pos", "neg", "pos"]

    code, out, err = cli(capsys, "classify", str(classifier_run), "-i", str(inputs))
    assert code == 0 and all(line.count("\t") == 2 for line in out.splitlines())

    data = write_tsv(tmp_path / "test.tsv", labelled_rows(20, seed=3))
    code, out, err = cli(capsys, "evaluate", str(classifier_run), "--data", str(data),
                         "--hyp-out", str(tmp_path / "pred.txt"))
    assert code == 0, err
    assert re.search(r"^accuracy \d+\.\d\d  macro-F1 \d+\.\d\d$", out, flags=re.M)
    assert "confusion matrix" in out and re.search(r"^neg +\d+ +\d+$", out, flags=re.M)
    assert len((tmp_path / "pred.txt").read_text().splitlines()) == 20
    accuracy = float(re.search(r"accuracy (\S+)", out).group(1))
    assert accuracy >= 90.0


def test_classifier_save_load_round_trip(tmp_path):
    config = load_config(RunConfig, classification_config(tmp_path), ["train.max_updates=5", "train.valid_every=5"])
    trainer = Trainer(config, tmp_path / "run", log=lambda msg: None)
    trainer.run()
    texts = [t for t, _ in labelled_rows(10, seed=4)]
    first = load_run(tmp_path / "run" / "checkpoints" / "step-00000005" / "model.safetensors")
    second = load_run(tmp_path / "run")  # best.safetensors, saved at the same (only) validation
    assert second.weights_path.name == "best.safetensors"
    p1, ids = predict(first, texts)
    p2, _ = predict(second, texts)
    assert torch.equal(p1, p2)
    trainer.model.eval()
    first.model = trainer.model  # the in-memory model, same tokenizer and batching
    p3, _ = predict(first, texts)
    assert torch.equal(p1, p3)
    assert first.classes == ["neg", "pos"]


def test_classification_input_errors(classifier_run, tmp_path, capsys):
    rows = labelled_rows(6, seed=5)
    no_header = write_tsv(tmp_path / "noheader.tsv", rows, header=None)
    assert_one_line_error(*cli(capsys, "evaluate", str(classifier_run), "--data", str(no_header))[::2],
                          "noheader.tsv:1", "header")
    wrong_column = write_tsv(tmp_path / "cols.tsv", rows, header="sentence\tstars")
    assert_one_line_error(*cli(capsys, "evaluate", str(classifier_run), "--data", str(wrong_column))[::2],
                          "cols.tsv", "label")
    empty_text = write_tsv(tmp_path / "empty.tsv", [*rows[:2], ("  ", "pos"), *rows[2:]])
    assert_one_line_error(*cli(capsys, "evaluate", str(classifier_run), "--data", str(empty_text))[::2],
                          "empty.tsv:4", "empty text")
    unknown = write_tsv(tmp_path / "unknown.tsv", [*rows, ("so so film", "neutral")])
    assert_one_line_error(*cli(capsys, "evaluate", str(classifier_run), "--data", str(unknown))[::2],
                          "unknown.tsv", "neutral")
    assert_one_line_error(*cli(capsys, "evaluate", str(classifier_run))[::2], "--data")
    assert_one_line_error(*cli(capsys, "translate", str(classifier_run))[::2], "attnkit classify")


def test_training_a_classifier_on_a_file_without_label_column(tmp_path, capsys):
    raw = classification_config(tmp_path)
    write_tsv(tmp_path / "train.tsv", labelled_rows(10, seed=1), header="sentence\tstars")
    config = write_yaml(tmp_path / "c.yaml", raw)
    assert_one_line_error(*cli(capsys, "train", str(config), "--run-dir", str(tmp_path / "r"))[::2],
                          "train.tsv", "label")


# -- the real command ------------------------------------------------------------------


def run_attnkit(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "attnkit", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_subprocess_user_error_has_no_traceback(tmp_path):
    raw = translation_config(tmp_path)
    raw["train"]["learning_rate"] = 1e-3
    config = write_yaml(tmp_path / "bad.yaml", raw)
    proc = run_attnkit("train", str(config), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("attnkit: error: ")
    assert "train.learning_rate" in proc.stderr and "Traceback" not in proc.stderr


def test_subprocess_translate_corrupt_checkpoint(translation_run, tmp_path):
    bad = tmp_path / "model.safetensors"
    for name in ("config.yaml", "tokenizer.json", "spm.model"):
        (tmp_path / name).write_bytes((translation_run / name).read_bytes())
    bad.write_bytes(os.urandom(1000))
    proc = run_attnkit("translate", str(bad), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("attnkit: error: ") and proc.stderr.count("\n") == 1
    assert "model.safetensors" in proc.stderr and "Traceback" not in proc.stderr


def test_invalid_utf8_on_stdin_and_unwritable_output_are_one_line_errors(capsys, monkeypatch, translation_run) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok line\n\xff\xfe bad\n")))
    assert_one_line_error(*cli(capsys, "translate", str(translation_run), "--beam", "1")[::2], "<stdin>:2",
                          "UTF-8")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"3 March 2021\n")))
    assert_one_line_error(*cli(capsys, "translate", str(translation_run), "-o", "/nonexistent-dir/out.txt")[::2],
                          "/nonexistent-dir/out.txt", "cannot write")


def test_config_values_are_checked(capsys, tmp_path) -> None:
    raw = translation_config(tmp_path)
    raw["train"]["valid_every"] = 0
    assert_one_line_error(*cli(capsys, "train", str(write_yaml(tmp_path / "a.yaml", raw)))[::2], "valid_every")
    raw = translation_config(tmp_path)
    raw["data"]["max_len"] = 500
    assert_one_line_error(*cli(capsys, "train", str(write_yaml(tmp_path / "b.yaml", raw)))[::2],
                          "data.max_len=500", "model.transformer.max_len")


def test_translate_saves_attention_heatmaps(capsys, tmp_path, translation_run) -> None:
    src = write_lines(tmp_path / "in.txt", ["3 March 2021", "12.10.1999"])
    code, out, _ = cli(capsys, "translate", str(translation_run), "-i", str(src), "--beam", "1",
                       "--attention-dir", str(tmp_path / "attn"))
    assert code == 0 and len(out.splitlines()) == 2
    for name in ("attention-0001.png", "attention-0002.png"):
        assert (tmp_path / "attn" / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
