"""The layout is the architecture: imports point down the layers, no circle, small modules and functions, and one
registry per axis (the rule itself, and its finders, are ``tests/layout_rules.py``).

Layers, lowest first (a module imports only from lower layers, or from its own package)::

    common < textbook < engine, config < data < runs < inference < viz, tasks < interop < training, export
           < serve < cli, demo

The textbook is the top of ``attnkit`` (attention, multihead, layers, transformer, rnn, classifier, mlm,
search, vocab): plain torch that imports nothing from the engine or any other role. A function-level
import is allowed only where it defers a heavy optional dependency (matplotlib, FastAPI) to the
commands that use it, never to dodge a circle. What differs by task is asked of the task's spec
(:data:`attnkit.tasks.TASKS`), never decided by comparing task names outside ``attnkit.tasks`` or by asking
which model class a function holds.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from torch import nn

from attnkit.tasks import TASKS
from layout_rules import (
    LAYER,
    MODEL_CLASSES,
    TEXTBOOK,
    components,
    isinstance_ladders,
    kind_comparisons,
    kind_tables,
    modules,
    role,
)
from layout_rules import imports as module_imports

ROOT = Path(__file__).resolve().parents[1]
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


# -- one registry per axis -------------------------------------------------------------------------------------

#: Every task's name and every route a task's runs answer: what code outside ``tasks/`` must not compare.
KINDS = frozenset({s.name for s in TASKS.values()} | {s.serves for s in TASKS.values() if s.serves is not None})
OUTSIDE_TASKS = sorted(m for m in MODULES if role(m) != "tasks")


@pytest.mark.parametrize("module", OUTSIDE_TASKS)
def test_no_task_name_or_served_kind_is_compared_outside_the_tasks(module: str) -> None:
    """Per-task behaviour is the task's spec's (``spec(run.task).generates``, ``require(run, "generate", ...)``), not a
    comparison of ``run.task``, ``serves`` or a kind's name."""
    text = MODULES[module].read_text(encoding="utf-8")
    lines = text.splitlines()
    found = [f"line {n}: {lines[n - 1].strip()}" for n in kind_comparisons(text, KINDS)]
    assert not found, f"{module} compares task names or served kinds (ask the task's spec instead): {found}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_isinstance_ladder_over_model_classes(module: str) -> None:
    """What a model does is chosen by its task's spec or asked of the model (a protocol), not by a chain of
    ``isinstance`` checks against the model classes."""
    ladders = isinstance_ladders(MODULES[module].read_text(encoding="utf-8"))
    assert not ladders, f"{module}: isinstance ladders over model classes in {ladders}"


def test_the_kinds_are_the_registrys() -> None:
    assert {"translate", "classify", "pretrain", "lm", "generate"} <= KINDS


def test_the_model_classes_are_models() -> None:
    """:data:`layout_rules.MODEL_CLASSES` names real models (else the ladder check passes vacuously)."""
    where = {name: importlib.import_module(module)
             for module in ("attnkit.transformer", "attnkit.rnn", "attnkit.classifier", "attnkit.mlm", "attnkit.lm",
                            "attnkit.engine.eager") for name in dir(importlib.import_module(module))}
    for name in MODEL_CLASSES:
        assert name in where and issubclass(getattr(where[name], name), nn.Module), name


SNIPPET = """
def route(run, spec, served, task, x):
    if run.task == "lm":                        # 3
        pass
    if spec(run.task).serves != served:         # 5
        pass
    if x in ("generate", "translate"):          # 7
        pass
    if task not in TABLE:                       # 9
        pass
    if spec(run.task).serves is None or spec(run.task).generates or x == "rnn":
        pick(state, name, "generate")
    return MODELS["lm"], TABLE.get("classify"), {"pretrain": 1}   # 13


def ladder(model):
    if isinstance(model, LanguageModel):        # 17
        return 1
    return 2 if isinstance(model, (Transformer, RNNSeq2Seq)) else 3


def guard(model):
    if not isinstance(model, (TransformerClassifier, DecoderClassifier)):
        raise TypeError(type(model).__name__)
"""


def test_the_finders_see_what_they_look_for() -> None:
    """Comparisons of kinds (a literal, ``run.task``, ``serves``), tables keyed by kind, isinstance ladders; not
    ``is None``, a capability, another name, a kind passed as an argument, or a single guard."""
    assert kind_comparisons(SNIPPET, KINDS) == [3, 5, 7, 9]
    assert kind_tables(SNIPPET, KINDS) == [13, 13, 13]
    assert isinstance_ladders(SNIPPET) == ["ladder (line 16)"]


def test_per_kind_tables_outside_the_tasks_are_the_routes_of_serve() -> None:
    """Outside ``tasks/`` a table keyed by a kind is the server's own registry of its routes (what ``GET /models``
    says of a run and what decodes it continuously, the models each route serves); ``attnkit``'s commands share
    three names with kinds."""
    found = {m for m in OUTSIDE_TASKS if kind_tables(MODULES[m].read_text(encoding="utf-8"), KINDS)}
    assert {m for m in found if role(m) != "serve"} <= {"attnkit.cli"}, found
