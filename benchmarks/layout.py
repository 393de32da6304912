"""The package's architecture, measured: module count, import levels, circles, back-arrows, sizes, task-name
comparisons, and how often two jobs climb back up the layers at run time. Side by side for two commits.

    python benchmarks/layout.py 0bc1665 HEAD        # writes benchmarks/results/layout.json, prints the table

Each commit is checked out into a temporary git worktree. The static figures come from its
``src/attnkit`` (every import, function-level ones included). The layers are those of
``tests/test_layout.py``; a module of the flat layout before the role packages is given the layer of
the package it moved to (:data:`FLAT`). The run-time figures trace every call between attnkit
modules (``sys.setprofile``) while the commit's own CLI runs two jobs in a fresh process:

* **demo**: ``attnkit train`` on the demo's config (a tiny model, 20 updates), then ``attnkit translate``;
* **export**: ``attnkit export --to ctranslate2`` of that run, then ``attnkit translate`` of the export.

A call from module A into module B counts as an *entry* into B; it *climbs* when B sits in a higher
layer than A (a lower module calling back up, e.g. through a callback or a protocol). The goal is
every module entered from few places and no climb.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from tables import markdown  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "layout.json"
TEXTBOOK = ("attention", "positions", "multihead", "layers", "transformer", "lm", "rnn", "classifier", "ngrams", "mlm",
            "search", "sampling", "lora", "vocab")
LAYERS = [("common",), TEXTBOOK, ("engine", "config"), ("data",), ("runs",), ("inference",),
          ("viz", "tasks", "interop"),
          ("training", "export"), ("serve",), ("cli", "demo", "__main__", "__init__")]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
#: Where each module of the flat layout (0bc1665) went: its role package.
FLAT = {"errors": "common", "files": "common", "measure": "common", "config": "config", "runconfig": "config",
        "documents": "data", "dates": "data", "tokenizer": "data", "data": "data", "prepare": "data",
        "checkpoint": "runs", "rundir": "runs", "tasks": "tasks", "pretrain": "tasks", "train": "training",
        "distributed": "training", "runtime": "training", "progress": "training", "evaluate": "inference",
        "classify": "inference", "attention_maps": "inference", "plot": "viz", "explorer": "viz",
        "export": "export", "serve": "serve", "batching": "serve"}
TASK_COMPARISON = re.compile(r"""task\s*[!=]=|[!=]=\s*["'](translate|classify|pretrain)["']|"""
                             r"""["'](translate|classify|pretrain)["']\s*[!=]=|task\s+(not\s+)?in\s""")
DEMO = ["data.generate_train=400", "data.generate_valid=10", "data.tokenizer.vocab_size=100",
        "model.transformer.d_model=32", "model.transformer.d_ff=64", "train.max_updates=20", "train.valid_every=20",
        "train.progress=false", "train.threads=1", "train.valid_bleu_sentences=5", "train.max_tokens=600"]


def role(module: str) -> str:
    """The layer name of ``attnkit.X[.Y]`` (a flat-layout module by where it moved)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return FLAT.get(name, name) if len(parts) == 2 and name in FLAT else name


def modules(src: Path) -> dict[str, Path]:
    out = {}
    for p in sorted((src / "attnkit").rglob("*.py")):
        parts = p.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """``(imported attnkit module, inside a function?, line)`` for every import in a module (``tests/test_layout.py``
    holds the rules over them)."""
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
    """Strongly connected components (Tarjan), each a list of modules."""
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


def levels(graph: dict[str, set[str]]) -> int:
    """Import levels: the longest chain of imports, circles collapsed into one node."""
    comps = components(graph)
    of = {m: i for i, comp in enumerate(comps) for m in comp}
    depth: dict[int, int] = {}

    def level(c: int) -> int:
        if c not in depth:
            depth[c] = 1 + max((level(of[w]) for m in comps[c] for w in graph[m] if of[w] != c), default=0)
        return depth[c]

    return max(level(c) for c in range(len(comps)))


def static(src: Path, readme: Path) -> dict:
    known = modules(src)
    edges = {m: imports(m, p, known) for m, p in known.items()}
    graph = {m: {t for t, _, _ in e} for m, e in edges.items()}
    back = [(m, t) for m, e in edges.items() for t, _, _ in e
            if role(t) != role(m) and LAYER[role(t)] > LAYER[role(m)]
            and not (role(t) in TEXTBOOK and role(m) in TEXTBOOK)]
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in known.items()}
    functions = [(f"{m}.{f.name}", f.end_lineno - f.lineno + 1) for m, p in known.items()
                 for f in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    comparisons = [m for m, p in known.items() if role(m) != "tasks"
                   for line in p.read_text(encoding="utf-8").splitlines() if TASK_COMPARISON.search(line)]
    top = [p for p in (src / "attnkit").iterdir() if p.name != "__pycache__"]
    return {
        "modules": len(known), "top_level_entries": len(top),
        "role_packages": sum(1 for p in top if p.is_dir()),
        "import_levels": levels(graph), "circles": [c for c in components(graph) if len(c) > 1],
        "back_arrows": [f"{m} -> {t}" for m, t in back],
        "function_level_imports": sum(nested for e in edges.values() for _, nested, _ in e),
        "largest_module": max(lines.items(), key=lambda kv: kv[1]),
        "modules_over_450": sum(n > 450 for n in lines.values()),
        "longest_function": max(functions, key=lambda f: f[1]),
        "functions_over_80": sum(n > 80 for _, n in functions),
        "task_comparisons_outside_tasks": len(comparisons), "modules_comparing_task_names": len(set(comparisons)),
        "readme_bytes": readme.stat().st_size,
    }


TRACER = r"""
import json, sys
from pathlib import Path
SRC = Path(sys.argv[1]).resolve()
ROLE = json.loads(sys.argv[2])
jobs = json.loads(sys.argv[3])
sys.path.insert(0, str(SRC))
from attnkit.cli import main
def module_of(code):
    try:
        parts = Path(code.co_filename).resolve().relative_to(SRC).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
results = {}
for name, commands in jobs.items():
    entries, climbs, visited = {}, [], set()
    def profile(frame, event, arg):
        if event != "call":
            return
        callee = module_of(frame.f_code)
        caller = frame.f_back and module_of(frame.f_back.f_code)
        if callee is None or caller is None or callee == caller:
            return
        visited.update((callee, caller))
        entries[callee] = entries.get(callee, 0) + 1
        if ROLE[callee][1] > ROLE[caller][1] and not (ROLE[callee][0] == ROLE[caller][0] == "textbook"):
            climbs.append(f"{caller} -> {callee}")
    for argv in commands:
        sys.setprofile(profile)
        try:
            code = main(argv)
        finally:
            sys.setprofile(None)
        assert code == 0, argv
    results[name] = {"modules_entered": len(visited), "entries": sum(entries.values()),
                     "climbs": len(climbs), "distinct_climbs": sorted(set(climbs))}
print(json.dumps(results))
"""


def traced(src: Path, work: Path) -> dict:
    """The two jobs under the call tracer, in a fresh interpreter that imports the commit's ``src``."""
    known = modules(src)
    roles = {m: ["textbook" if role(m) in TEXTBOOK else role(m), LAYER[role(m)]] for m in known}
    demo_yaml = src / "attnkit" / "demo.yaml"
    (work / "in.txt").write_text("March 3rd, 2021\n3. März 2021\n", encoding="utf-8")
    run, out, inputs = str(work / "run"), str(work / "export"), str(work / "in.txt")
    jobs = {"demo": [["train", str(demo_yaml), "--run-dir", run, *DEMO], ["translate", run, "-i", inputs]],
            "export": [["export", run, "--to", "ctranslate2", "-o", out], ["translate", out, "-i", inputs]]}
    done = subprocess.run([sys.executable, "-c", TRACER, str(src), json.dumps(roles), json.dumps(jobs)],
                          check=True, capture_output=True, text=True, cwd=work)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(commit: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="attnkit-layout-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout.strip()
            work = Path(tmp) / "work"
            work.mkdir()
            return {"commit": sha, **static(tree / "src", tree / "README.md"), "jobs": traced(tree / "src", work)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)


ROWS = [("modules in src/attnkit", "modules"), ("entries in `ls src/attnkit`", "top_level_entries"),
        ("role packages", "role_packages"), ("import levels", "import_levels"),
        ("import circles", lambda r: len(r["circles"])),
        ("imports back up the layers", lambda r: len(r["back_arrows"])),
        ("function-level imports", "function_level_imports"),
        ("largest module (lines)", lambda r: f"{r['largest_module'][1]} (`{r['largest_module'][0]}`)"),
        ("modules over 450 lines", "modules_over_450"),
        ("longest function (lines)", lambda r: f"{r['longest_function'][1]} (`{r['longest_function'][0]}`)"),
        ("functions over 80 lines", "functions_over_80"),
        ("task-name comparisons outside the tasks package", "task_comparisons_outside_tasks"),
        ("README.md bytes", "readme_bytes"),
        *[(f"{job} job: modules entered / entries / calls that climb / distinct climbs (caller -> callee)",
           lambda r, job=job: "{modules_entered} / {entries:,} / {climbs:,} / {n}".format(
               **r["jobs"][job], n=len(r["jobs"][job]["distinct_climbs"])))
          for job in ("demo", "export")]]


def markdown_table(results: dict) -> str:
    """docs/results.md: the layout figures of each measured commit, side by side."""
    commits = results["commits"]
    header = ["", *[f"`{c['commit']}`" for c in commits]]
    rows = [[label, *[str(key(c) if callable(key) else c[key]) for c in commits]] for label, key in ROWS]
    climbs = [f"`{c['commit']}`: " + ", ".join(f"`{x}`" for x in sorted(
        {x for job in c["jobs"].values() for x in job["distinct_climbs"]})) for c in commits]
    return markdown(header, rows, "l" + "r" * len(commits)) + (
        f"\nMeasured {results['date'][:10]} by `{results['command']}`. The climbs, caller -> callee: "
        + "; ".join(climbs) + ".\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commits", nargs="+", help="commits to measure (HEAD = as committed)")
    args = p.parse_args()
    results = {**stamp(), "command": "python benchmarks/layout.py " + " ".join(args.commits),
               "commits": [measure(c) for c in args.commits]}
    OUT.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(markdown_table(results), end="")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
