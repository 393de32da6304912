"""Tiny translation and classification runs for the tests: configs, data files and helpers to write them.

Imported by the tests (``from tiny_runs import ...``; pytest puts ``tests/`` on the path) and by the
fixtures in ``conftest.py`` that train them.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import MappingProxyType

import yaml

from attnkit.data import dates

#: read-only, so that a test editing its config cannot change the next test's (configs take copies)
TINY_MODEL = MappingProxyType({"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 1, "decoder_layers": 1,
                               "dropout": 0.0, "max_len": 128})
TINY_TRAIN = MappingProxyType({"progress": False, "precision": "fp32", "threads": 1, "warmup": 5, "lr": 3e-3,
                               "max_tokens": 400, "valid_bleu_sentences": 5, "average_last": 0})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def translation_config(tmp: Path, n: int = 150) -> dict:
    train = dates.generate_pairs(n, seed=1, split="train")
    valid = dates.generate_pairs(10, seed=1, split="valid")
    write_lines(tmp / "train.src", [s for s, _ in train])
    write_lines(tmp / "train.tgt", [t for _, t in train])
    write_lines(tmp / "valid.src", [s for s, _ in valid])
    write_lines(tmp / "valid.tgt", [t for _, t in valid])
    return {"task": "translate",
            "data": {"train": str(tmp / "train.src"), "train_tgt": str(tmp / "train.tgt"),
                     "valid": str(tmp / "valid.src"), "valid_tgt": str(tmp / "valid.tgt"),
                     "max_len": 64, "tokenizer": {"vocab_size": 70}},
            "model": {"transformer": {**TINY_MODEL}},  # a copy: tests edit it
            "train": {**TINY_TRAIN, "max_updates": 6, "valid_every": 6},
            "decode_beam": 2}


POSITIVE = ["good", "great", "lovely", "fine", "superb", "happy"]
NEGATIVE = ["bad", "awful", "poor", "sad", "terrible", "boring"]
FILLER = ["the", "film", "was", "a", "plot", "story", "and", "really"]


def labelled_rows(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        words = rng.sample(FILLER, 3) + [rng.choice(POSITIVE if label == "pos" else NEGATIVE)]
        rng.shuffle(words)
        rows.append((" ".join(words), label))
    return rows


def write_tsv(path: Path, rows: list[tuple[str, str]], header: str | None = "sentence\tlabel") -> Path:
    return write_lines(path, ([header] if header else []) + [f"{t}\t{y}" for t, y in rows])


def classification_config(tmp: Path) -> dict:
    write_tsv(tmp / "train.tsv", labelled_rows(80, seed=1))
    write_tsv(tmp / "valid.tsv", labelled_rows(20, seed=2))
    return {"task": "classify",
            "data": {"train": str(tmp / "train.tsv"), "valid": str(tmp / "valid.tsv"),
                     "tokenizer": {"vocab_size": 40}},
            "model": {"transformer": {**TINY_MODEL}},  # a copy: tests edit it
            "train": {**TINY_TRAIN, "max_updates": 60, "valid_every": 60, "label_smoothing": 0.0, "lr": 5e-3}}
