"""docs/concepts.md and docs/experiments.md cannot go stale: every symbol, test, page and figure they link exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
CONCEPTS = DOCS / "concepts.md"
PAGES = (CONCEPTS, DOCS / "experiments.md")
LINK = re.compile(r"\[`?([^\]`]+)`?\]\(([^)#\s]+)(?:#([^)\s]+))?\)")  # [`name`](path#anchor)


def links(pages: tuple[Path, ...] = PAGES) -> list[tuple[str, str, str, str | None]]:
    """``(page, link text, target path, anchor)`` of every link to a file in ``pages``."""
    return [(page.name, m[1], m[2], m[3]) for page in pages for m in LINK.finditer(page.read_text(encoding="utf-8"))]


def defines(source: str, name: str) -> bool:
    """Whether ``source`` defines ``name``: a function/class, a module-level constant, or ``Class.method``."""
    if "." in name:
        cls, method = name.split(".", 1)
        body = re.search(rf"^class {re.escape(cls)}\b.*?(?=^\S|\Z)", source, re.M | re.S)
        return bool(body and re.search(rf"^\s+def {re.escape(method)}\(", body[0], re.M))
    return bool(re.search(rf"^(?:class|def) {re.escape(name)}\b|^{re.escape(name)}\s*[:=]", source, re.M))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (not - and _), spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_concepts_map_links_many_symbols_and_tests() -> None:
    targets = [path for _, _, path, _ in links((CONCEPTS,))]
    assert sum(p.startswith("../src/") for p in targets) >= 60  # the parser still finds the table's code links
    assert sum(p.startswith("../tests/") for p in targets) >= 50


@pytest.mark.parametrize("page,name,path,anchor", links(), ids=lambda x: str(x))
def test_every_link_resolves(page: str, name: str, path: str, anchor: str | None) -> None:
    target = (DOCS / path).resolve()
    if path.startswith("../../shared/") and not target.parent.parent.exists():
        pytest.skip(f"docs/{page} links to {path}: ../shared (the seeds) is not beside this checkout")
    assert target.exists(), f"docs/{page} links to {path}, which does not exist"
    if path.startswith(("../src/", "../tests/")):
        assert defines(target.read_text(encoding="utf-8"), name), f"{path} defines no {name!r}"
    if anchor is not None:
        headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), re.M)
        assert anchor in {slug(h) for h in headings}, f"{path} has no heading with anchor #{anchor}"
