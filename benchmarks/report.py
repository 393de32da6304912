"""Write every table of results in the docs from the JSON files the benchmarks and experiments wrote.

    python benchmarks/report.py                     # rewrite the generated sections
    python benchmarks/report.py --check             # rewrite nothing; exit 1 naming each file that differs
    python benchmarks/report.py --history RACE      # print every run of a race (the pages show the latest)

A generated section is the text between ``<!-- generated: NAME -->`` and ``<!-- /generated: NAME -->``
in one of the :data:`PAGES`. :data:`TABLES` maps each NAME to the JSON it reads and the function that
turns it into markdown (in the script that writes that JSON); a new table is one line there plus its
markers in a page. One NAME may have markers in several pages (the README shows a few headline tables
that docs/results.md also shows): each gets the same table. A section whose JSON does not exist yet is
left empty. ``tests/test_report.py`` fails when a page differs from what this script writes.

A race (a benchmark run again and again, every run kept in its JSON) shows the latest run of each host kind
(CPU model, GPU) and one line per host kind with how many runs there were and the spread of its headline
figure (:class:`Race`); ``--history`` prints the table of every run instead.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tables  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "docs" / "experiments.md",
         ROOT / "docs" / "results.md", ROOT / "docs" / "language-models.md", ROOT / "docs" / "lm-results.md",
         ROOT / "docs" / "sentiment.md")
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
class Race:
    """What makes a :class:`Table` a race's: its function gets the latest run of each part and host kind (a list,
    in :func:`tables.races`' order), and a line per host kind follows with the count and spread of ``headline``.

    :param headline: the name of ``headline(run) -> float | None`` in the script: the figure whose spread is told
        (or ``-> (label, float | None)``, where parts of one race have figures of different kinds).
    :param label: what that figure is, in words (``test BLEU``).
    :param part: the name of ``part(run) -> list[tuple[str, dict]]`` in the script, where one JSON holds several
        races (one per config, say): each part of a run with its name. Default: the whole run, unnamed.
    """

    headline: str
    label: str
    part: str | None = None


@dataclass(frozen=True)
class Table:
    """A generated section: ``render(results)`` over ``source``.

    :param source: a JSON path relative to the repository root (``render`` gets its contents), or
        glob patterns (``render`` gets ``{relative path: contents}`` of every match, sorted).
    :param script: the file holding ``function``.
    :param race: set for a race: ``function`` then gets a list of runs (see :class:`Race`).
    """

    source: str | tuple[str, ...]
    script: str
    function: str = "markdown_table"
    race: Race | None = None

    def results(self) -> dict | None:
        if isinstance(self.source, str):
            path = ROOT / self.source
            return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        paths = sorted({p for pattern in self.source for p in ROOT.glob(pattern)})
        return {str(p.relative_to(ROOT)): json.loads(p.read_text(encoding="utf-8")) for p in paths} or None

    def races(self, module: ModuleType, results: dict) -> list[tables.Race]:
        """The runs of ``results``, by part and host kind (a race's)."""
        part = getattr(module, self.race.part) if self.race.part else lambda run: [("", run)]
        return tables.races([pair for run in tables.runs_of(results) for pair in part(run)])

    def render(self, name: str = "") -> str:
        results = self.results()
        if results is None:
            return ""
        module = script(self.script)
        render: Callable = getattr(module, self.function)
        if self.race is None:
            return render(results).rstrip("\n") + "\n"
        groups = self.races(module, results)
        headline = getattr(module, self.race.headline)
        lines = "\n".join(f"- {tables.history_line(group, headline, self.race.label)}" for group in groups)
        latest = render([group.runs[-1] for group in groups]).rstrip()
        return (f"{latest}\n\nThe latest run on each kind of host; every run (`python benchmarks/report.py --history "
                f"{name}` prints their tables):\n{lines}\n")

    def history(self) -> str:
        """Every run's table, by part and host kind, oldest first."""
        results = self.results()
        if results is None or self.race is None:
            return ""
        module = script(self.script)
        render: Callable = getattr(module, self.function)
        return "\n\n".join(f"## {g.host}{', ' + g.part if g.part else ''}: {len(g.runs)} run"
                             f"{'s' if len(g.runs) > 1 else ''}\n\n{render(g.runs).rstrip()}"
                             for g in self.races(module, results)) + "\n"


RESULTS = "benchmarks/results"
FIGURES = "docs/figures"
MULTI30K = (f"{RESULTS}/multi30k-*.json",)
EVERY_RESULT = (f"{RESULTS}/**/*.json",)

TABLES: dict[str, Table] = {
    "translation": Table(MULTI30K, "benchmarks/multi30k.py", race=Race("bleu", "test BLEU", "config")),
    "decoding": Table(MULTI30K, "benchmarks/multi30k.py", "markdown_decoding",
                      Race("cache_speedup", "speed-up of the cache", "cached")),
    "throughput": Table((f"{RESULTS}/throughput.json", f"{RESULTS}/throughput-base.json"), "benchmarks/throughput.py",
                        race=Race("attnkit_bf16", "attnkit bf16 target tok/s", "model")),
    "sst2": Table((f"{RESULTS}/sst2.json", f"{RESULTS}/earlier/sst2.*.json"), "benchmarks/sst2.py"),
    "imdb": Table(f"{RESULTS}/imdb.json", "benchmarks/imdb.py"),
    "imdb-brief": Table(f"{RESULTS}/imdb.json", "benchmarks/imdb.py", "markdown_brief"),
    "imdb-outside": Table(f"{RESULTS}/imdb.json", "benchmarks/imdb.py", "markdown_outside"),
    "nbsvm": Table(f"{RESULTS}/nbsvm.json", "benchmarks/nbsvm.py",
                   race=Race("nbsvm_accuracy", "NBSVM-bi held-out accuracy", "split")),
    "reading": Table(f"{RESULTS}/reading.json", "benchmarks/reading.py",
                     race=Race("whole", "accuracy read whole", "model")),
    "imdb-variance": Table(f"{RESULTS}/imdb-trials.json", "benchmarks/imdb.py", "markdown_variance"),
    "imdb-ngram-seeds": Table(f"{RESULTS}/imdb-trials.json", "benchmarks/imdb.py", "markdown_ngram_seeds"),
    "mlm-probes": Table(f"{RESULTS}/mlm-probes.json", "benchmarks/imdb.py", "markdown_probes"),
    "demo": Table(f"{RESULTS}/demo.json", "benchmarks/demo.py", race=Race("exact_match", "exact match (%)")),
    "decode": Table(f"{RESULTS}/decode.json", "benchmarks/decode.py",
                    race=Race("bf16_over_int8", "attnkit bf16 / CTranslate2 int8 tokens/s")),
    "scale": Table(f"{RESULTS}/scale.json", "benchmarks/scale.py",
                   race=Race("size_ratio", "tok/s at the largest corpus / the smallest")),
    "attention": Table(f"{RESULTS}/attention.json", "benchmarks/attention.py",
                       race=Race("longest_fp32", "time / torch's at the longest T, fp32")),
    "ddp": Table(f"{RESULTS}/ddp.json", "benchmarks/ddp.py", race=Race("two_processes", "2 processes / 1, tok/s")),
    "hf-decode": Table(f"{RESULTS}/hf-decode.json", "benchmarks/hf_decode.py",
                       race=Race("attnkit_over_transformers", "attnkit / transformers sentences/s")),
    "serve-engines": Table((f"{RESULTS}/serving/*.json",), "benchmarks/serve.py", "markdown_engines",
                           Race("share_of_offline", "32 clients' share of offline", "configuration")),
    "serve-stages": Table((f"{RESULTS}/serving/*.json",), "benchmarks/serve.py", "markdown_stages"),
    "serve-batching": Table(f"{RESULTS}/batching.json", "benchmarks/serve_batching.py",
                            race=Race("length_aware_over_first_come", "length-aware / first come sentences/s")),
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
    "lm": Table(f"{RESULTS}/lm.json", "benchmarks/lm.py",
                race=Race("attnkit_figure", "", "row")),
    "lm-gpu": Table(f"{RESULTS}/lm-gpu.json", "benchmarks/lm.py",
                    race=Race("attnkit_figure", "", "row")),
    "length-extrapolation": Table(f"{FIGURES}/length-extrapolation.json", "experiments/length_extrapolation.py"),
    "generate-race": Table(f"{RESULTS}/generate-race.json", "benchmarks/generate_race.py",
                           race=Race("fastest_attnkit", "attnkit's fastest tok/s at batch 1")),
    "generate-race-gpu": Table(f"{RESULTS}/generate-race-gpu.json", "benchmarks/generate_race.py",
                               race=Race("fastest_attnkit", "attnkit's fastest tok/s at batch 1")),
    "lora": Table(f"{RESULTS}/lora.json", "benchmarks/lora.py",
                  race=Race("attnkit_over_peft", "attnkit's LoRA tokens/s over transformers + PEFT's")),
    "serve-openai": Table(f"{RESULTS}/serve-openai.json", "benchmarks/serve_openai.py",
                          race=Race("ratio", "/v1/chat/completions tokens/s over /generate's")),
    "generation-race": Table(f"{RESULTS}/generation-race.json", "benchmarks/generation_race.py",
                             race=Race("fastest_attnkit", "attnkit's fastest tok/s at batch 1", "model_name")),
    "generation-served": Table(f"{RESULTS}/generation-served.json", "benchmarks/generation_race.py",
                               race=Race("first_token_ratio", "the served first token over a forward pass of the "
                                                              "prompt (the best thread count)", "model_name")),
}


def regenerate(text: str, page: Path, rendered: dict[str, str]) -> str:
    """``text`` with every generated section's body replaced by its table."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"{page.relative_to(ROOT)}: no table named {name!r} in benchmarks/report.py TABLES")
        if name not in rendered:
            rendered[name] = TABLES[name].render(name)
        return match[1] + rendered[name] + match[4]

    return SECTION.sub(body, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs")
    p.add_argument("--history", metavar="RACE", choices=sorted(n for n, t in TABLES.items() if t.race),
                   help="print every run of this race (the pages show the latest run of each host kind)")
    args = p.parse_args(argv)
    if args.history:
        print(TABLES[args.history].history(), end="")
        return 0
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
