"""Small helpers for the ``markdown_table(results) -> str`` functions that ``report.py`` collects.

Every table of results in README.md, benchmarks/README.md and docs/experiments.md is written by
such a function from the JSON a script wrote; these keep their formatting alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def markdown(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A GitHub markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: all left)."""
    align = align or "l" * len(header)
    if len(align) != len(header) or any(len(row) != len(header) for row in rows):
        raise ValueError(f"{len(header)} columns in the header, alignment {align!r}, rows of "
                         f"{sorted({len(row) for row in rows})} cells")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *[[str(cell) for cell in row] for row in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def measured(data: dict) -> str:
    """``2026-11-22, b73c08f``: the day and the commit a result JSON says it was measured at (``+ changes``
    when the checkout measured differed from that commit)."""
    return f"{data['date'][:10]}, `{data['commit']}`" + (" + changes" if data.get("uncommitted_changes") else "")


def num(value: float, digits: int = 0) -> str:
    """``5,250`` / ``40.74``: thousands separated, ``digits`` after the point."""
    return f"{value:,.{digits}f}"


def markdown_commits(results: dict[str, dict]) -> str:
    """One sentence: how many commits the result files span, and the git command listing the changes between."""
    by_date = sorted(results.values(), key=lambda data: data["date"])
    first, last = by_date[0], by_date[-1]
    commits = len({data["commit"] for data in by_date})
    return (f"The results above were measured at {commits} commits, from `{first['commit']}` "
            f"({first['date'][:10]}) to `{last['commit']}` ({last['date'][:10]}); rows at different commits "
            f"measured different code: `git log --oneline {first['commit']}..{last['commit']} -- src` lists "
            f"what changed in between.")


def caption(data: dict) -> str:
    """The line under an experiment's table: when, at which commit, by which command and how long it ran."""
    return (f"Measured {data['date'][:10]} at commit `{data['commit']}` by `{data['command']}` "
            f"({data['run_seconds'] / 60:.1f} min, {data['torch_threads']} torch "
            f"thread{'s' if data['torch_threads'] > 1 else ''}).")


def append_run(path: Path, result: dict, note: str = "") -> None:
    """Add ``result`` to the runs of a results file ``{"date", "commit", "runs": [...]}`` (every run is kept; the
    newest run's date and commit head the file, for the ``measured-at`` line), with ``note`` (what else ran on the
    machine, say) as its ``note`` if given."""
    if note:
        result["note"] = note
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"] if path.exists() else []
    latest = {k: result[k] for k in ("date", "commit", "uncommitted_changes") if k in result}
    path.write_text(json.dumps({**latest, "runs": [*runs, result]}, indent=2) + "\n", encoding="utf-8")
