"""Every table of results in the docs is what ``benchmarks/report.py`` writes from the committed JSON."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILES = sorted([*ROOT.glob("benchmarks/results/**/*.json"), *ROOT.glob("docs/figures/*.json")])


def load_report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["report"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_docs_are_what_the_report_writes(capsys) -> None:
    code = load_report().main(["--check"])
    assert code == 0, f"run `python benchmarks/report.py`: {capsys.readouterr().err}"


def test_a_stale_section_is_rewritten_and_the_rest_kept() -> None:
    report = load_report()
    page = ROOT / "README.md"
    text = "before\n<!-- generated: ddp -->\n| old | table |\n<!-- /generated: ddp -->\nafter\n"
    new = report.regenerate(text, page, {})
    assert new.startswith("before\n<!-- generated: ddp -->\n| processes x threads |")
    assert new.endswith("<!-- /generated: ddp -->\nafter\n") and "| old | table |" not in new
    assert report.regenerate(new, page, {}) == new
    with pytest.raises(SystemExit, match="no table named 'nonesuch'"):
        report.regenerate("<!-- generated: nonesuch -->\n<!-- /generated: nonesuch -->\n", page, {})


def test_every_table_has_markers_on_some_page() -> None:
    report = load_report()
    marked = {m["name"] for page in report.PAGES for m in report.SECTION.finditer(page.read_text(encoding="utf-8"))}
    assert marked == set(report.TABLES)


def test_a_table_in_two_pages_is_the_same_in_both() -> None:
    report = load_report()
    text = "<!-- generated: ddp -->\n<!-- /generated: ddp -->\n"
    rendered: dict[str, str] = {}
    readme = report.regenerate(text, ROOT / "README.md", rendered)
    assert "| processes x threads |" in readme
    assert report.regenerate(text, ROOT / "docs" / "results.md", rendered) == readme


def test_docs_results_holds_every_headline_table_of_the_readme() -> None:
    report = load_report()
    names = {page: {m["name"] for m in report.SECTION.finditer(page.read_text(encoding="utf-8"))}
             for page in (ROOT / "README.md", ROOT / "docs" / "results.md")}
    full = {name.removesuffix("-brief") for name in names[ROOT / "README.md"]}  # a brief table's full one there
    assert full <= names[ROOT / "docs" / "results.md"]


def test_a_table_whose_json_is_missing_is_empty(tmp_path: Path) -> None:
    report = load_report()
    assert report.Table("benchmarks/results/no-such-file.json", "benchmarks/demo.py").render() == ""


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_result_says_when_and_at_which_commit(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d)?\+00:00", data.get("date", "")), data.get("date")
    assert re.fullmatch(r"[0-9a-f]{7,40}", data.get("commit") or ""), data.get("commit")


# -- races: the latest run per host kind, the count and spread of every run ---------------------------------


RACE_SCRIPT = '''
def part(run):
    return [(run["config"], run)]


def headline(run):
    return run["bleu"]


def markdown_table(runs):
    return "\\n".join(f"| {r['config']} | {r['bleu']} | {r['date'][:10]} |" for r in runs)
'''


def race_run(date: str, bleu: float, cpu: dict | str | None, config: str = "a.yaml") -> dict:
    return {"date": f"{date}T00:00:00+00:00", "commit": "abc1234", "config": config, "bleu": bleu, "cpu": cpu}


def test_a_race_shows_the_latest_run_of_each_part_and_host_kind_with_the_count_and_spread(tmp_path: Path) -> None:
    report = load_report()
    amd = {"model": "AMD EPYC", "amx_bf16": False, "avx512_bf16": True}
    runs = [race_run("2026-01-01", 30.0, amd), race_run("2026-01-03", 36.0, amd), race_run("2026-01-02", 33.0, amd),
            race_run("2026-01-02", 20.0, "Other CPU"), race_run("2026-01-04", 40.0, amd, "b.yaml")]
    (tmp_path / "race.json").write_text(json.dumps({"runs": runs}), encoding="utf-8")
    (tmp_path / "race.py").write_text(RACE_SCRIPT, encoding="utf-8")
    table = report.Table(str(tmp_path / "race.json"), str(tmp_path / "race.py"),
                         race=report.Race("headline", "test BLEU", "part"))
    text = table.render("demo-race")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows == ["| a.yaml | 36.0 | 2026-01-03 |", "| a.yaml | 20.0 | 2026-01-02 |",
                    "| b.yaml | 40.0 | 2026-01-04 |"]
    assert "- AMD EPYC (AVX512-BF16), a.yaml: 3 runs since 2026-01-01; test BLEU 30.00 to 36.00." in text
    assert "- Other CPU, a.yaml: 1 run on 2026-01-02; test BLEU 20.00." in text
    assert "`python benchmarks/report.py --history demo-race`" in text
    history = table.history()  # every run, oldest first, under its part and host kind
    assert history.index("| a.yaml | 30.0 |") < history.index("| a.yaml | 33.0 |") < history.index("| a.yaml | 36.0 |")
    assert "## AMD EPYC (AVX512-BF16), a.yaml: 3 runs" in history
    assert sum(line.startswith("| ") for line in history.splitlines()) == 5


def test_host_kind_names_the_gpu_the_cpu_model_and_its_bf16_units() -> None:
    tables = load_report().tables
    assert tables.host_kind({"cpu": {"model": "Xeon", "amx_bf16": True, "avx512_bf16": True}}) == "Xeon (AMX)"
    assert tables.host_kind({"cpu": "AMD EPYC", "bf16": False}) == "AMD EPYC (no bf16 units)"
    assert tables.host_kind({"cpu": "Xeon", "gpu": "NVIDIA H200", "bf16": True}) == "NVIDIA H200 (host Xeon)"
    assert tables.host_kind({"machine": {"cpu_model": "Xeon", "cpu_flags": ["avx2"]}}) == "Xeon (no bf16 units)"
    assert tables.host_kind({"machine": {"cpu": "x86_64"}}) == "an x86_64 CPU, model not recorded"
    assert tables.host_kind({}) == "CPU not recorded"


def test_the_runs_of_a_results_file_are_its_runs_or_itself() -> None:
    tables = load_report().tables
    one, two = race_run("2026-01-02", 1.0, None), race_run("2026-01-01", 2.0, None)
    assert tables.runs_of({"runs": [one, two]}) == [two, one]  # oldest first
    assert tables.runs_of(one) == [one]
    assert tables.runs_of({"a.json": {"runs": [one]}, "b.json": two}) == [two, one]
    drains = {**one, "runs": [{"rule": "first come"}]}  # "runs" that are not runs (no date): the file is one run
    assert tables.runs_of(drains) == [drains]


def test_appended_runs_are_all_kept_and_the_newest_heads_the_file(tmp_path: Path) -> None:
    tables = load_report().tables
    path = tmp_path / "r.json"
    tables.append_run(path, race_run("2026-01-01", 1.0, None))
    tables.append_run(path, race_run("2026-01-02", 2.0, None), note="beside a training")
    data = json.loads(path.read_text(encoding="utf-8"))
    assert [r["bleu"] for r in data["runs"]] == [1.0, 2.0] and data["runs"][1]["note"] == "beside a training"
    assert data["date"].startswith("2026-01-02") and data["commit"] == "abc1234"


def test_every_race_names_functions_its_script_has() -> None:
    report = load_report()
    for name, table in report.TABLES.items():
        if table.race is None:
            continue
        module = report.script(table.script)
        for function in (table.function, table.race.headline, table.race.part):
            assert function is None or callable(getattr(module, function, None)), (name, function)
