"""attnkit.common.measure: the date, commit and cost every result JSON records."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.common import measure

ROOT = Path(__file__).resolve().parents[1]


def test_stamp_names_the_checkout_commit_and_the_time() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout with git installed: the commit cannot be known")
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    stamp = measure.stamp()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert stamp["commit"] and head.startswith(stamp["commit"])
    assert before <= dt.datetime.fromisoformat(stamp["date"]) <= dt.datetime.now(dt.timezone.utc)


def test_stamp_outside_a_checkout_of_attnkit_has_no_commit(tmp_path: Path, monkeypatch) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=False)  # some other repository, if git exists
    monkeypatch.setattr(measure, "_PACKAGE_DIR", tmp_path)
    assert measure.stamp()["commit"] is None


def test_peak_rss_counts_an_allocation_and_the_clock_runs() -> None:
    # Linux keeps the peak across exec: a child's starts at least at its parent's RSS when it forked (pytest's,
    # over 1 GB late in the suite), so the child writes 1 GB more than the peak it starts with
    code = ("from attnkit.common.measure import peak_rss_gb, process_seconds; import time; a = peak_rss_gb(); "
            "t = process_seconds(); b = b'x' * int((a + 1) * 2**30); time.sleep(0.05); "
            "print(a, peak_rss_gb(), t, process_seconds())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, started, ended = map(float, out.split())
    # what it wrote is resident at once, in GB of 2^30 bytes
    assert after > before + 0.99
    assert 0 < started < ended
