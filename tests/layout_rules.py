"""The architecture rule that ``tests/test_layout.py`` holds ``src/attnkit`` to: the layers, the import walker, and
the finders of per-kind behaviour outside its registries.

Layers, lowest first (a module imports only from lower layers, or from its own package)::

    common < textbook < engine, config < data < runs < inference < viz, tasks < interop < training, export
           < serve < cli, demo

One registry per axis: what differs by task is in :data:`attnkit.tasks.TASKS` (:class:`~attnkit.tasks.TaskSpec`),
what differs by model family in :data:`attnkit.interop.families.FAMILIES`. Outside ``tasks/``, code asks a spec
(``spec(run.task).generates``) instead of comparing names: :func:`kind_comparisons` finds the comparisons,
:func:`kind_tables` the tables keyed by a task name or a served kind, :func:`isinstance_ladders` the functions
that choose what to do by asking which model class they hold.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TEXTBOOK = ("attention", "positions", "multihead", "layers", "transformer", "lm", "rnn", "classifier", "ngrams", "mlm",
            "search", "sampling", "lora", "vocab")
LAYERS = [("common",), TEXTBOOK, ("engine", "config"), ("data",), ("runs",), ("inference",), ("viz", "tasks"),
          ("interop",), ("training", "export"), ("serve",), ("cli", "demo", "__main__", "__init__")]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
#: The models a task builds (and the engine's forms of them): what an ``isinstance`` ladder would ask about.
MODEL_CLASSES = frozenset({"Transformer", "RNNSeq2Seq", "TransformerClassifier", "DecoderClassifier",
                           "MaskedLanguageModel", "ReplacedTokenDetection", "LanguageModel", "EagerTransformer",
                           "EagerLanguageModel"})
#: Names whose value is a task's name or what it serves (``run.task``, ``info.task``, ``spec(t).serves``).
KIND_NAMES = frozenset({"task", "serves"})
_COMPARING = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def role(module: str) -> str:
    """The layer name of ``attnkit.X[.Y]``: its package, or the module itself at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules(src: Path) -> dict[str, Path]:
    """Every module under ``src/attnkit`` by its dotted name (a package by its own name)."""
    out = {}
    for p in sorted((src / "attnkit").rglob("*.py")):
        parts = p.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """``(imported attnkit module, inside a function?, line)`` for every import in a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(t, id(node) in nested, node.lineno) for t in dict.fromkeys(targets) if t in known and t != name]
    return found


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each a list of modules: a circle of imports is one of more than one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            out.append([*comp, v])

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


# -- per-kind behaviour ------------------------------------------------------------------------------


def _literals(node: ast.expr, kinds: frozenset[str]) -> bool:
    """``node`` is a kind's name, or a tuple, list or set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in kinds
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_literals(e, kinds) for e in node.elts)


def _names_a_kind(node: ast.expr) -> bool:
    """``node`` reads a task's name or what it serves: ``task``, ``run.task``, ``spec(t).serves``."""
    return (isinstance(node, ast.Name) and node.id in KIND_NAMES) or \
        (isinstance(node, ast.Attribute) and node.attr in KIND_NAMES)


def kind_comparisons(source: str, kinds: frozenset[str]) -> list[int]:
    """The lines of ``source`` that compare a task name or a served kind (``==``, ``!=``, ``in``, ``not in``): one
    side is one of ``kinds`` (``"lm"``, ``("generate", ...)``) or reads a task or what it serves (``run.task``,
    ``serves``). ``is None`` is no comparison of kinds."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, _COMPARING) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(_literals(s, kinds) or _names_a_kind(s) for s in sides):
                lines.append(node.lineno)
    return lines


def kind_tables(source: str, kinds: frozenset[str]) -> list[int]:
    """The lines of ``source`` holding a table keyed by kind: a dict with a kind's name as a key, or a lookup of one
    (``MODELS["lm"]``, ``table.get("generate")``). A name that is not a task's (the command ``attnkit translate``)
    is found too: the list is for reading, not asserted."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict) and any(k is not None and _literals(k, kinds) for k in node.keys):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _literals(node.slice, kinds) and \
                not (isinstance(node.value, ast.Name) and node.value.id == "Literal"):  # a type, not a table
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and _literals(node.args[0], kinds):
            lines.append(node.lineno)
    return lines


def _names_a_model(node: ast.expr) -> bool:
    """An ``isinstance``'s class argument names one of :data:`MODEL_CLASSES` (alone, in a tuple or in ``A | B``)."""
    if isinstance(node, ast.Name):
        return node.id in MODEL_CLASSES
    if isinstance(node, ast.Attribute):
        return node.attr in MODEL_CLASSES
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_names_a_model(e) for e in node.elts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _names_a_model(node.left) or _names_a_model(node.right)
    return False


def isinstance_ladders(source: str) -> list[str]:
    """The functions of ``source`` that ask which model they hold more than once, each ``name (line)``: two or more
    ``isinstance`` calls against :data:`MODEL_CLASSES` in one function (a nested function on its own). A single
    check (a guard: "this needs a LanguageModel", "a classifier of either kind") is no ladder."""
    ladders = []
    for f in ast.walk(ast.parse(source)):
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        inner = {id(n) for g in ast.walk(f) if g is not f and isinstance(g, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(g)}  # a nested function is judged on its own
        checks = sum(_names_a_model(n.args[1]) for n in ast.walk(f) if id(n) not in inner and isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and len(n.args) == 2)
        if checks >= 2:
            ladders.append(f"{f.name} (line {f.lineno})")
    return ladders
