"""The layout is the architecture: imports point down the layers, no circle, small modules and functions.

Layers, lowest first (a module imports only from lower layers, or from its own package)::

    common < textbook < engine, config < data < runs < inference < viz, tasks < training, export < serve < cli, demo

The textbook is the top of ``attnkit`` (attention, multihead, layers, transformer, rnn, classifier, mlm,
search, vocab): plain torch that imports nothing from the engine or any other role. A function-level
import is allowed only where it defers a heavy optional dependency (matplotlib, FastAPI) to the
commands that use it, never to dodge a circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
# the one definition of the layers and of the import walker, shared with the benchmark that measures them
from layout import LAYER, TEXTBOOK, components, modules, role  # noqa: E402
from layout import imports as module_imports  # noqa: E402

PACKAGE = ROOT / "src" / "attnkit"
#: Modules loaded only inside the functions that need them: they import matplotlib or FastAPI.
DEFERRED = {"attnkit.viz.figures", "attnkit.viz.plot", "attnkit.serve.app", "attnkit.serve.server"}
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 80
MODULES = modules(PACKAGE.parent)


def imports(module: str) -> list[tuple[str, bool, int]]:
    """``(imported attnkit module, inside a function?, line)`` for every import in ``module``."""
    return module_imports(module, MODULES[module], MODULES)


def test_every_module_has_a_layer() -> None:
    assert {role(m) for m in MODULES} <= LAYER.keys(), sorted({role(m) for m in MODULES} - LAYER.keys())
    assert len({role(m) for m in MODULES if m.count(".") >= 1 and MODULES[m].parent != PACKAGE}) >= 5


def group(module: str) -> str:
    """What a module may import freely within: its package, the textbook, or the entry points."""
    layer = LAYER[role(module)]
    return {LAYER["attention"]: "textbook", LAYER["cli"]: "entry points"}.get(layer, role(module))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    """An import goes to a lower layer or stays in its own group; nothing runs back up (function level too)."""
    up = [f"{target} (line {line})" for target, _, line in imports(module)
          if group(target) != group(module) and LAYER[role(target)] >= LAYER[role(module)]]
    assert not up, f"{module} imports from its own layer or above: {up}"


@pytest.mark.parametrize("module", [m for m in sorted(MODULES) if role(m) in TEXTBOOK])
def test_the_textbook_imports_only_the_textbook(module: str) -> None:
    outside = [t for t, _, _ in imports(module) if role(t) not in TEXTBOOK]
    assert not outside, f"{module} imports {outside}: the textbook reads like the seeds, apart from the engine"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_function_level_imports_only_defer_heavy_dependencies(module: str) -> None:
    dodging = [f"{target} (line {line})" for target, nested, line in imports(module)
               if nested and target not in DEFERRED]
    assert not dodging, f"{module} imports inside a function: {dodging}"


def test_no_import_circle() -> None:
    graph = {m: {t for t, _, _ in imports(m)} for m in MODULES}
    assert not [sorted(c) for c in components(graph) if len(c) > 1]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_functions_stay_small(module: str) -> None:
    text = MODULES[module].read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{module}: split it by concern"
    functions = [f for f in ast.walk(ast.parse(text)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    long = [f"{f.name} ({f.end_lineno - f.lineno + 1} lines)" for f in functions
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{module}: {long}"


def test_the_checks_see_the_imports() -> None:
    """The walker finds relative, absolute and function-level imports (else every check above passes vacuously)."""
    found = {(t, nested) for t, nested, _ in imports("attnkit.cli.translate")}
    assert ("attnkit.export", False) in found and ("attnkit.viz.figures", True) in found
    assert ("attnkit.runs.layout", False) in {(t, n) for t, n, _ in imports("attnkit.runs.load")}


def test_a_llama_block_reads_in_four_files() -> None:
    """The GPT is one file (issue 56): ``attnkit.lm`` reads from the textbook only the kernel, multi-head attention and
    the positions (and the special ids' constants), neither the encoder-decoder's layers nor its model."""
    textbook = {t for t, _, _ in imports("attnkit.lm")}
    assert textbook <= {"attnkit.attention", "attnkit.multihead", "attnkit.positions", "attnkit.vocab"}, textbook
