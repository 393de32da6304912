"""Tests for attnkit.common.files: a failed write leaves the old file; a write replaces it whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnkit.common.files import atomic_write, atomic_write_bytes, atomic_write_text


def test_atomic_write_failure_leaves_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.safetensors"
    atomic_write_text(target, "old")

    def failing(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, failing)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_atomic_write_replaces_and_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "notes.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["notes.txt"]


def test_atomic_write_bytes_round_trips(tmp_path: Path) -> None:
    data = bytes(range(256))
    atomic_write_bytes(tmp_path / "model.bin", data)
    assert (tmp_path / "model.bin").read_bytes() == data
