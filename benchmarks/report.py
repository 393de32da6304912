"""Write every table of results in the docs from the JSON files the benchmarks and experiments wrote.

    python benchmarks/report.py           # rewrite the generated sections
    python benchmarks/report.py --check   # rewrite nothing; exit 1 naming each file that differs

A generated section is the text between ``<!-- generated: NAME -->`` and ``<!-- /generated: NAME -->``
in one of the :data:`PAGES`. :data:`TABLES` maps each NAME to the JSON it reads and the function that
turns it into markdown (``markdown_table(results) -> str`` in the script that writes that JSON); a new
table is one line there plus its markers in a page. One NAME may have markers in several pages (the
README shows a few headline tables that docs/results.md also shows): each gets the same table. A
section whose JSON does not exist yet is left empty. ``tests/test_report.py`` fails when a page
differs from what this script writes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "docs" / "experiments.md",
         ROOT / "docs" / "results.md", ROOT / "docs" / "language-models.md", ROOT / "docs" / "sentiment.md")
SECTION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated: (?P=name) -->)", re.S)


def script(path: str) -> ModuleType:
    """Import a benchmark or experiment script by its path (they are scripts, not a package)."""
    file = ROOT / path
    for folder in (file.parent, ROOT / "benchmarks", ROOT / "src"):  # as when the script is run from the root
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"report_{file.parent.name}_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as for any import (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Table:
    """A generated section: ``render(results)`` over ``source``.

    :param source: a JSON path relative to the repository root (``render`` gets its contents), or
        glob patterns (``render`` gets ``{relative path: contents}`` of every match, sorted).
    :param script: the file holding ``function``.
    """

    source: str | tuple[str, ...]
    script: str
    function: str = "markdown_table"

    def results(self) -> dict | None:
        if isinstance(self.source, str):
            path = ROOT / self.source
            return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        paths = sorted({p for pattern in self.source for p in ROOT.glob(pattern)})
        return {str(p.relative_to(ROOT)): json.loads(p.read_text(encoding="utf-8")) for p in paths} or None

    def render(self) -> str:
        results = self.results()
        if results is None:
            return ""
        render: Callable[[dict], str] = getattr(script(self.script), self.function)
        return render(results).rstrip("\n") + "\n"


RESULTS = "benchmarks/results"
FIGURES = "docs/figures"
MULTI30K = (f"{RESULTS}/multi30k-*.json", f"{RESULTS}/earlier/multi30k-*.json")
EVERY_RESULT = (f"{RESULTS}/*.json", f"{RESULTS}/earlier/*.json")

TABLES: dict[str, Table] = {
    "translation": Table(MULTI30K, "benchmarks/multi30k.py"),
    "decoding": Table(MULTI30K, "benchmarks/multi30k.py", "markdown_decoding"),
    "throughput": Table((f"{RESULTS}/throughput.json", f"{RESULTS}/throughput-base.json",
                         f"{RESULTS}/earlier/throughput.*.json"), "benchmarks/throughput.py"),
    "profile": Table(f"{RESULTS}/profile.json", "experiments/profile_update.py"),
    "ceiling": Table((f"{RESULTS}/throughput.json", f"{RESULTS}/profile.json"), "benchmarks/throughput.py",
                     "markdown_ceiling"),
    "sst2": Table((f"{RESULTS}/sst2.json", f"{RESULTS}/earlier/sst2.*.json"), "benchmarks/sst2.py"),
    "imdb": Table(f"{RESULTS}/imdb.json", "benchmarks/imdb.py"),
    "imdb-brief": Table(f"{RESULTS}/imdb.json", "benchmarks/imdb.py", "markdown_brief"),
    "imdb-outside": Table(f"{RESULTS}/imdb.json", "benchmarks/imdb.py", "markdown_outside"),
    "nbsvm": Table(f"{RESULTS}/nbsvm.json", "benchmarks/nbsvm.py"),
    "reading": Table(f"{RESULTS}/reading.json", "benchmarks/reading.py"),
    "imdb-trials": Table(f"{RESULTS}/imdb-trials.json", "benchmarks/imdb.py", "markdown_trials"),
    "imdb-variance": Table(f"{RESULTS}/imdb-trials.json", "benchmarks/imdb.py", "markdown_variance"),
    "imdb-ngram-seeds": Table(f"{RESULTS}/imdb-trials.json", "benchmarks/imdb.py", "markdown_ngram_seeds"),
    "mlm-probes": Table(f"{RESULTS}/mlm-probes.json", "benchmarks/imdb.py", "markdown_probes"),
    "recipe-probes": Table(f"{RESULTS}/recipe-probes.json", "experiments/recipe_probes.py"),
    "electra-diagnosis": Table((f"{RESULTS}/electra-diagnosis*.json",), "experiments/electra_diagnosis.py",
                               "markdown_runs"),
    "electra-chain": Table(f"{RESULTS}/electra-chain.json", "experiments/electra_chain.py"),
    "demo": Table((f"{RESULTS}/demo.json", f"{RESULTS}/earlier/demo.*.json"), "benchmarks/demo.py"),
    "decode": Table((f"{RESULTS}/decode.json", f"{RESULTS}/earlier/decode.*.json"), "benchmarks/decode.py"),
    "decode-probes": Table(f"{RESULTS}/decode-probes.json", "experiments/decode_probes.py"),
    "serve": Table((f"{RESULTS}/serve.json", f"{RESULTS}/serve-*.json", f"{RESULTS}/earlier/serve*.json"),
                   "benchmarks/serve.py"),
    "scale": Table(f"{RESULTS}/scale.json", "benchmarks/scale.py"),
    "scale-earlier": Table((f"{RESULTS}/earlier/scale.*.json",), "benchmarks/scale.py", "markdown_earlier"),
    "compare": Table((f"{RESULTS}/compare-*.json",), "experiments/compare_commits.py"),
    "compare-serving": Table((f"{RESULTS}/compare-serving/*.json",), "experiments/compare_commits.py",
                             "markdown_serving"),
    "attention": Table(f"{RESULTS}/attention.json", "benchmarks/attention.py"),
    "ddp": Table(f"{RESULTS}/ddp.json", "benchmarks/ddp.py"),
    "hf-decode": Table(f"{RESULTS}/hf-decode.json", "benchmarks/hf_decode.py"),
    "lora": Table(f"{RESULTS}/lora.json", "benchmarks/lora.py"),
    "serve-engines": Table((f"{RESULTS}/serving/*.json",), "benchmarks/serve.py", "markdown_engines"),
    "serve-stages": Table((f"{RESULTS}/serving/*.json",), "benchmarks/serve.py", "markdown_stages"),
    "serve-batching": Table((f"{RESULTS}/batching.json", f"{RESULTS}/earlier/batching.*.json"),
                            "benchmarks/serve_batching.py"),
    "measured-at": Table(EVERY_RESULT, "benchmarks/tables.py", "markdown_commits"),
    "bottleneck": Table(f"{FIGURES}/bottleneck.json", "experiments/bottleneck.py"),
    "scaling-random": Table(f"{FIGURES}/scaling.json", "experiments/scaling.py"),
    "scaling-training": Table(f"{FIGURES}/scaling-training.json", "experiments/scaling.py", "markdown_training"),
    "heads-profile": Table(f"{FIGURES}/heads.json", "experiments/heads.py", "markdown_profile"),
    "heads-count": Table(f"{FIGURES}/heads.json", "experiments/heads.py"),
    "parallelism-models": Table(f"{FIGURES}/parallelism.json", "experiments/parallelism.py"),
    "parallelism-layers": Table(f"{FIGURES}/parallelism.json", "experiments/parallelism.py", "markdown_layers"),
    "hard-soft": Table(f"{FIGURES}/hard_soft.json", "experiments/hard_soft.py"),
    "no-projection": Table(f"{FIGURES}/no_projection.json", "experiments/no_projection.py"),
    "lm": Table(f"{RESULTS}/lm.json", "benchmarks/lm.py"),
    "lm-gpu": Table(f"{RESULTS}/lm-gpu.json", "benchmarks/lm.py"),
    "length-extrapolation": Table(f"{FIGURES}/length-extrapolation.json", "experiments/length_extrapolation.py"),
    "generate-race": Table(f"{RESULTS}/generate-race.json", "benchmarks/generate_race.py"),
    "generate-race-gpu": Table(f"{RESULTS}/generate-race-gpu.json", "benchmarks/generate_race.py"),
    "generation-race": Table(f"{RESULTS}/generation-race.json", "benchmarks/generation_race.py"),
    "serve-switch-interval": Table(f"{RESULTS}/gil-switch-interval.json", "experiments/serve_switch_interval.py"),
    "serve-breakdown": Table(f"{RESULTS}/lm-serve-breakdown.json", "experiments/serve_breakdown.py"),
    "matvec-probe": Table(f"{RESULTS}/matvec-probe.json", "experiments/matvec_probe.py"),
    "openmp-pools": Table(f"{RESULTS}/openmp-pools.json", "experiments/openmp_pools.py"),
}


def regenerate(text: str, page: Path, rendered: dict[str, str]) -> str:
    """``text`` with every generated section's body replaced by its table."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"{page.relative_to(ROOT)}: no table named {name!r} in benchmarks/report.py TABLES")
        if name not in rendered:
            rendered[name] = TABLES[name].render()
        return match[1] + rendered[name] + match[4]

    return SECTION.sub(body, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    args = p.parse_args(argv)
    rendered: dict[str, str] = {}
    stale = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        new = regenerate(text, page, rendered)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new, encoding="utf-8")
    unused = TABLES.keys() - rendered.keys()
    if unused:
        print(f"tables no page has markers for: {', '.join(sorted(unused))}", file=sys.stderr)
    for page in stale:
        print(f"{page}: {'differs from' if args.check else 'rewritten from'} the JSON results", file=sys.stderr)
    return 1 if args.check and (stale or unused) else 0


if __name__ == "__main__":
    sys.exit(main())
