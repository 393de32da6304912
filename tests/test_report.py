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
