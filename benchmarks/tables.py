"""Small helpers for the ``markdown_table(results) -> str`` functions that ``report.py`` collects.

Every table of results in README.md and docs/ is written by such a function from the JSON a script wrote;
these keep their formatting alike. A race (a benchmark run again and again) shows the latest run of each host
kind and one line on all of them: :func:`host_kind`, :func:`races` and :func:`history_line`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def write_runs(path: Path, runs: list[dict]) -> None:
    """Write a results file ``{"date", "commit", "runs": [...]}``: every run, the newest run's date and commit at its
    head (for the ``measured-at`` line)."""
    latest = {k: runs[-1][k] for k in ("date", "commit", "uncommitted_changes") if k in runs[-1]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**latest, "runs": runs}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def append_run(path: Path, result: dict, note: str = "") -> None:
    """Add ``result`` to the runs of a results file (:func:`write_runs`; every run is kept), with ``note`` (what else
    ran on the machine, say) as its ``note`` if given."""
    if note:
        result["note"] = note
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"] if path.exists() else []
    write_runs(path, [*runs, result])

def cpu_info() -> dict:
    """The CPU's model name and whether it has the bf16 matrix instructions that set the bf16 peak."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    found = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(found[1].split()) if found else set()
    return {"model": model[1].strip() if model else None, "amx_bf16": "amx_bf16" in flags,
            "avx512_bf16": "avx512_bf16" in flags}


# -- races: the latest run per host kind, the count and spread of every run ---------------------------------


#: What ``platform.machine()`` answers: an architecture, not a CPU model (older runs recorded only that).
ARCHITECTURES = ("x86_64", "amd64", "aarch64", "arm64")


def host_kind(run: dict) -> str:
    """``AMD EPYC (AVX512-BF16)``, ``NVIDIA H200 (host Intel(R) Xeon(R) Processor)``: the GPU a run used, else its CPU
    model and bf16 units where recorded. Speeds carry over between hosts of one kind only."""
    machine = run.get("machine") if isinstance(run.get("machine"), dict) else {}
    cpu = run.get("cpu") or machine.get("cpu") or machine.get("cpu_model") or run.get("machine") or run.get("host")
    flags = machine.get("cpu_flags")
    if isinstance(cpu, dict):
        flags = [f for f in ("amx_bf16", "avx512_bf16") if cpu.get(f)]
        cpu = cpu.get("model")
    units = ("AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "no bf16 units"
             ) if flags is not None else ""
    if not units and isinstance(run.get("bf16"), bool) and not run.get("gpu"):
        units = "bf16 units" if run["bf16"] else "no bf16 units"
    if not isinstance(cpu, str) or cpu.lower() in ARCHITECTURES:
        cpu = f"an {cpu} CPU, model not recorded" if isinstance(cpu, str) else "CPU not recorded"
    name = f"{cpu} ({units})" if units else cpu
    return f"{run['gpu']} (host {name})" if run.get("gpu") else name


def runs_of(results: dict) -> list[dict]:
    """Every run, oldest first, in a results file (``{"runs": [...]}``, or one run) or in ``{path: contents}`` of
    several (what :class:`report.Table` reads from glob patterns)."""
    if isinstance(results.get("runs"), list) and all("date" in run for run in results["runs"]):
        runs = list(results["runs"])
    elif "date" in results:
        runs = [results]
    else:
        runs = [run for contents in results.values() for run in runs_of(contents)]
    return sorted(runs, key=lambda run: run["date"])


@dataclass
class Race:
    """The runs of one race (``part``: which, where one JSON holds several) on one host kind, oldest first."""

    part: str
    host: str
    runs: list[dict]


def races(parts: Sequence[tuple[str, dict]]) -> list[Race]:
    """``(part, run)`` pairs grouped by part and host kind, in the order each group first appears."""
    groups: dict[tuple[str, str], Race] = {}
    for part, run in sorted(parts, key=lambda pair: pair[1]["date"]):
        key = (part, host_kind(run))
        groups.setdefault(key, Race(part, key[1], [])).runs.append(run)
    return sorted(groups.values(), key=lambda race: (race.part, race.host))


def figure(value: float) -> str:
    """``1,853`` / ``38.62`` / ``0.82``: whole numbers from 100 up, two decimals below."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def history_line(race: Race, headline: Callable[[dict], float | tuple[str, float] | None], label: str) -> str:
    """``AMD EPYC (AVX512-BF16): 15 runs since 2026-11-25; test BLEU 36.10 to 38.62.``: how many runs of the race
    this host kind has had, and the spread of its headline figure over them (runs without one are counted).
    ``headline`` may name its figure (``(label, value)``), in place of ``label``."""
    values = []
    for run in race.runs:
        value = headline(run)
        if isinstance(value, tuple):
            label, value = value
        if value is not None:
            values.append(value)
    count = f"{len(race.runs)} run{'s' if len(race.runs) > 1 else ''}"
    since = f"since {race.runs[0]['date'][:10]}" if len(race.runs) > 1 else f"on {race.runs[0]['date'][:10]}"
    low, high = (figure(min(values)), figure(max(values))) if values else ("", "")
    spread = ("" if not values else f"; {label} {low}" if len(values) == 1 else
              f"; {label} {low} in each" if low == high else f"; {label} {low} to {high}")
    where = f"{race.host}, {race.part}" if race.part else race.host
    return f"{where}: {count} {since}{spread}."
