"""Every documented command runs as written: the ``attnkit`` lines of README.md's and docs/*.md's shell blocks.

The commands run in a scratch directory laid out as the repository is (``configs/`` beside a ``../shared/data`` that
holds the first rows of each data file), so each one reads the config it names and the files it names, as a user
types it. Four things differ, and only these:

* ``attnkit train`` gets overrides of the *time* only (a few updates): small runs of the configs as committed, so a
  check or a limit that a documented command trips (a run of 128 positions asked for 300 tokens) fails here. A
  config that fine-tunes a downloaded model gets that model's shape, as its comments tell the user to copy it
  (:func:`shape_of`): the stand-in is smaller than the real download;
* the files a command reads (``test.de``, ``reviews.txt``, ...) are a few lines of the shared data, and the
  Hugging Face directories a user downloads (``opus-mt-de-en/``, ``bert-base-uncased/``, ...) are tiny random
  models of their architecture, built with transformers (tests/hf_models.py);
* ``attnkit serve`` listens on a free port instead of the one written (``curl`` lines are pointed at it);
* lines that set up a machine, download, run for an hour or start several processes are not run here: each is
  matched by :data:`NOT_RUN`, which says why and where it is tested instead.

Commands run in this process (``attnkit.cli.main``), in the order producers first (import, prepare, train, export),
then the rest in the order the docs give them; a line written in several docs runs once. Words are split and
expanded by bash itself (``$'\\n\\n'``, ``"$(head -1 reviews.txt)"``), so what reaches ``main`` is what bash passes.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from attnkit.cli import main
from gguf_files import write_gguf
from hf_models import bert_dir, gpt2_dir, instruct_dir, llama_dir, marian_dir

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))  # their opening comments show the commands that use them
ROWS = 300  # lines kept of each data file (more of tiny Shakespeare: a character vocabulary needs it)
LONGER = {"shakespeare/input.txt": 3000}
#: ``attnkit train``'s small run: a few updates, a validation at the last one
FEW_UPDATES = ["train.max_updates=2", "train.valid_every=2", "train.warmup=1", "train.max_tokens=1024",
               "train.progress=false", "train.threads=1"]
#: Lines not run here, each with why (matched against the line's start).
NOT_RUN = {
    "python3 -m venv": "the README's setup commands: CI runs the test command itself (tests/test_readme.py)",
    "torchrun": "several processes: tests/test_distributed.py trains with torchrun's environment",
    "huggingface-cli download": "a download (nothing is fetched in tests); the directory is built here instead",
    "python benchmarks/": "a benchmark of an hour; tests/test_*_bench.py run the scripts on small inputs",
    "python experiments/": "an experiment over trained runs; its smoke test runs it on small ones",
}
#: The files the documented commands read, made from the shared data: name -> (source under ../shared/data, lines).
INPUTS = {"test.de": ("multi30k/test_2016_flickr.de.gz", 6), "test.en": ("multi30k/test_2016_flickr.en.gz", 6),
          "three.de": ("multi30k/val.de.gz", 3), "big.de.gz": ("multi30k/train.de.gz", 200),
          "big.en.gz": ("multi30k/train.en.gz", 200), "reviews.txt": ("imdb/unsup.tsv.gz", 3),
          "dev.tsv": ("sst2/dev.tsv", 20), "test.tsv": ("imdb/train.tsv.gz", 20),
          "held-out.txt": ("shakespeare/input.txt", 40), "prompts.txt": ("shakespeare/input.txt", 2)}
def gguf_file(out: Path) -> Path:
    """A GGUF file like a download of a quantized Llama: a tiny one written with the gguf package (Q4_0 blocks)."""
    from gguf import GGMLQuantizationType

    hf = llama_dir(out.parent / "hf-llama")
    return write_gguf(hf, out, GGMLQuantizationType.Q4_0)


#: What users download, as tiny random models of the same architecture: Hugging Face directories, a GGUF file.
DOWNLOADS = {"opus-mt-de-en": marian_dir, "bert-base-uncased": lambda out: bert_dir(out, "BertForMaskedLM"),
             "all-MiniLM-L6-v2": lambda out: bert_dir(out, "BertModel"), "path/to/gpt2-dir": gpt2_dir,
             "SmolLM2-135M-Instruct": instruct_dir, "path/to/model-Q4_K_M.gguf": gguf_file,
             "model-Q8_0.gguf": gguf_file}
PRODUCERS = ("import", "prepare", "train", "export")


def shell_lines(text: str) -> list[str]:
    """The lines of ``text``'s bash blocks, continuation lines joined, comments and blank lines left out."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(line.strip())
    return lines


def config_lines(text: str) -> list[str]:
    """The commands a config's comments show (``#   attnkit ...``), their own comments left out."""
    return [re.sub(r"\s+#.*$", "", m) for m in re.findall(r"^#\s{2,}(attnkit .*)$", text, flags=re.M)]


def documented() -> list[tuple[str, str]]:
    """``(doc, line)`` for every shell line of the docs and command of the configs' comments, each line once (where
    it is first written)."""
    seen, out = set(), []
    for doc in DOCS + CONFIGS:
        text = doc.read_text(encoding="utf-8")
        for line in config_lines(text) if doc.suffix == ".yaml" else shell_lines(text):
            if line not in seen:
                seen.add(line)
                out.append((doc.relative_to(ROOT).as_posix(), line))
    return out


def argv(line: str, cwd: Path) -> list[str]:
    """The words bash passes for ``line`` (its quoting, ``$'...'`` and ``$(...)`` expanded in ``cwd``; a trailing
    ``&``, comments and a ``< FILE`` redirection dropped: :func:`stdin_of` reads that)."""
    line = re.sub(r"\s&\s*(#.*)?$", "", line)
    line = re.sub(r"\s<\s*\S+", "", line)
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {line}"], cwd=cwd, capture_output=True, text=True,
                         check=True, env={**os.environ, "KEY": "a-key"})
    return out.stdout.split("\0")[:-1]


def head(source: Path, out: Path, rows: int) -> None:
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as f:
        lines = [line for _, line in zip(range(rows), f, strict=False)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open if out.suffix == ".gz" else open)(out, "wt", encoding="utf-8") as f:
        f.writelines(lines)


def workspace(tmp: Path) -> Path:
    """A repository-like directory: ``configs/``, ``../shared/data`` cut to :data:`ROWS` lines per file, the input
    files and the downloaded directories; returns the directory commands run in."""
    repo = tmp / "repo"
    repo.mkdir()
    shutil.copytree(ROOT / "configs", repo / "configs")
    for source in (SHARED / "data").rglob("*"):
        name = source.relative_to(SHARED / "data")
        if source.is_file():
            head(source, tmp / "shared" / "data" / name, LONGER.get(name.as_posix(), ROWS))
    for name, (source, rows) in INPUTS.items():
        path = repo / name
        if name.endswith((".de", ".en", ".gz", ".txt")) and source.startswith("multi30k"):
            head(SHARED / "data" / source, path, rows)
        elif name == "reviews.txt":
            with gzip.open(SHARED / "data" / source, "rt", encoding="utf-8") as f:
                next(f)
                path.write_text("".join(line.split("\t", 1)[1] for _, line in zip(range(rows), f, strict=False)),
                                encoding="utf-8")
        else:
            head(SHARED / "data" / source, path, rows)
    write_chats(repo / "chats.jsonl", SHARED / "data" / "shakespeare" / "input.txt", 40)
    for name, make in DOWNLOADS.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        make(repo / name)
    return repo


def write_chats(out: Path, source: Path, n: int) -> None:
    """The conversations a user fine-tunes on (``chats.jsonl``, one ``{"messages": [...]}`` a line): ``n`` pairs of
    consecutive lines of ``source``, a question and its answer."""
    with open(source, encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(4 * n), f, strict=False) if line.strip()]
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in zip(lines[0::2], lines[1::2], strict=False)][:n]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def depth(words: list[str], commands: list[tuple[str, str, list[str]]]) -> int:
    """How many documented trainings ``attnkit train CONFIG --run-dir RUN`` waits for: its config's
    ``model.init_from`` run, trained by another documented line (and so on up); 0 for other commands."""
    if words[1] != "train":
        return 0
    init_from = (yaml.safe_load((ROOT / words[2]).read_text(encoding="utf-8")).get("model") or {}).get("init_from")
    parent = next((w for _, _, w in commands if w[1] == "train" and "--run-dir" in w
                   and w[w.index("--run-dir") + 1] == init_from), None)
    return 0 if parent is None else 1 + depth(parent, commands)


def shape_of(config: str, cwd: Path) -> list[str]:
    """Overrides that give a config fine-tuning an imported model (``model.init_from``) that run's
    ``model.transformer`` (dropout aside) and a ``data.max_len`` within its positions; none for other configs."""
    raw = yaml.safe_load((ROOT / config).read_text(encoding="utf-8"))
    init_from = (raw.get("model") or {}).get("init_from")
    base = cwd / init_from / "config.yaml" if init_from else None
    if base is None or not base.exists():
        return []
    imported = yaml.safe_load(base.read_text(encoding="utf-8"))
    if not imported["data"].get("imported_from"):
        return []
    shape = imported["model"]["transformer"]
    out = [f"model.transformer.{key}={shape[key]}" for key in raw["model"].get("transformer") or {}
           if "dropout" not in key]
    return out + [f"data.max_len={min(raw['data'].get('max_len', shape['max_len']), shape['max_len'])}"]


def stdin_of(line: str) -> str | None:
    """The file ``line`` redirects to standard input (``< FILE``), if any."""
    found = re.search(r"\s<\s*(\S+)", line)
    return found[1] if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``attnkit serve ...`` as written, in its own process, on a free port (``--port N`` replaced)."""

    def __init__(self, words: list[str], cwd: Path) -> None:
        if "--port" in words:
            i = words.index("--port")
            words = words[:i] + words[i + 2:]
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "attnkit", *words[1:], "--port", str(self.port)],
                                     cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "KEY": "a-key"})
        line = self.proc.stdout.readline()
        if "attnkit serve: http://" not in line:
            self.proc.kill()
            raise AssertionError(f"{' '.join(words)}: the server did not start: {line}{self.proc.stderr.read()}")

    def curl(self, line: str, cwd: Path) -> str:
        line = re.sub(r"localhost:\d+", f"localhost:{self.port}", line).replace("curl ", "curl --fail-with-body ", 1)
        out = subprocess.run(["bash", "-c", f"{line}; exit ${{PIPESTATUS[0]}}"], cwd=cwd,  # curl's status
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{line}: exit {out.returncode}: {out.stdout} {out.stderr}"
        return out.stdout

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def not_run(line: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)


def piped(line: str) -> bool:
    """``... | attnkit ...``: a command that reads another's output (run by bash, as written)."""
    return "| attnkit " in line


def test_every_documented_line_is_run_or_said_why_not() -> None:
    """A shell line the docs show is an attnkit command (maybe reading a pipe), a curl against a server they start,
    or matched by :data:`NOT_RUN` (a line of another kind would be skipped silently)."""
    for doc, line in documented():
        assert line.startswith(("attnkit ", "curl ")) or piped(line) or not_run(line), \
            f"{doc}: {line!r} is neither run nor excused"
    assert sum(line.startswith("attnkit ") for _, line in documented()) >= 50  # the parser still finds them


def test_the_documented_commands_run_as_written(tmp_path: Path, monkeypatch, capsys) -> None:
    if not (SHARED / "data").is_dir():
        pytest.skip("../shared/data is not beside this checkout: the documented commands read their data there")
    repo = workspace(tmp_path)
    monkeypatch.chdir(repo)
    lines = [(doc, line) for doc, line in documented() if not not_run(line)]
    commands, seen = [], set()
    for doc, line in lines:  # a command written in several places (with other comments) runs once
        if line.startswith("attnkit ") and tuple(words := argv(line, repo)) not in seen:
            seen.add(tuple(words))
            commands.append((doc, line, words))
    order = sorted(commands, key=lambda c: (PRODUCERS.index(c[2][1]) if c[2][1] in PRODUCERS else len(PRODUCERS),
                                            depth(c[2], commands)))
    server: Server | None = None
    try:
        for doc, line, words in order:
            if words[1] == "serve":
                continue  # with the curl lines below
            extra = [*FEW_UPDATES, *shape_of(words[2], repo)] if words[1] == "train" else []
            source = stdin_of(line)  # what the line redirects to standard input; else an empty input (EOF at once)
            monkeypatch.setattr(sys, "stdin", open(source, encoding="utf-8") if source is not None  # noqa: SIM115
                                else io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8"))
            code = main([*words[1:], *extra])
            out, err = capsys.readouterr()
            assert code == 0, f"{doc}: {line}\n{err[-2000:]}"
        bin_dir = str(Path(sys.executable).parent)  # the attnkit command of this environment
        for doc, line in lines:  # a pipe into attnkit runs as written, in bash
            if piped(line):
                out = subprocess.run(["bash", "-c", f"set -o pipefail; {line}"], cwd=repo, capture_output=True,
                                     text=True, timeout=600,
                                     env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]})
                assert out.returncode == 0, f"{doc}: {line}\n{out.stderr[-2000:]}"
        for doc, line in lines:  # each server with the curl lines after it, in the docs' order
            if line.startswith("attnkit serve"):
                if server is not None:
                    server.stop()
                server = Server(argv(line, repo), repo)
            elif line.startswith("curl "):
                assert server is not None, f"{doc}: {line} has no server started before it"
                assert '"error"' not in server.curl(line, repo), f"{doc}: {line}"
    finally:
        if server is not None:
            server.stop()
