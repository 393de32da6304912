"""What a result file records about a measurement: when, at which commit, and at what cost.

Every JSON under ``benchmarks/results/`` and ``docs/figures/`` carries ``date`` and ``commit``
(:func:`stamp`), so the tables generated from them (``benchmarks/report.py``) can say which code
each number belongs to. ``attnkit demo --json`` writes the same fields.
"""

from __future__ import annotations

import datetime as dt
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _git(*args: str) -> str | None:
    """Output of ``git args`` run in this package's directory; None without git or outside a checkout."""
    try:
        proc = subprocess.run(["git", "-C", str(_PACKAGE_DIR), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def stamp() -> dict[str, str | bool | None]:
    """``{"date": ISO 8601 UTC, "commit": short hash}`` of the attnkit checkout being measured.

    ``commit`` is None for an installed copy that is not a git checkout of attnkit (the package
    file must be tracked, so a virtualenv inside some other repository does not count);
    ``uncommitted_changes`` is added, True, when tracked files differ from that commit (``benchmarks/results``
    aside: a benchmark rewrites its results file as it goes).
    """
    out: dict[str, str | bool | None] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                         "commit": None}
    if _git("ls-files", "--error-unmatch", Path(__file__).name) is None:
        return out
    out["commit"] = _git("rev-parse", "--short", "HEAD")
    # the result files a benchmark writes as it goes are its output, not a change to what it measures
    if _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)benchmarks/results"):
        out["uncommitted_changes"] = True
    return out


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (2^30 bytes), from ``getrusage``."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes on macOS, KiB on Linux


def process_seconds() -> float:
    """Wall-clock seconds since this process started (interpreter start-up and imports included).

    Read from ``/proc`` on Linux; elsewhere, the time since this module was imported.
    """
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
