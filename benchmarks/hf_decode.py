"""Decoding an imported Hugging Face Marian model: attnkit's engine against transformers' ``generate``.

    python benchmarks/hf_decode.py runs/m30k-de-en        # writes results/hf-decode.json (every run kept)

The model: an attnkit translation run exported with ``attnkit export --to huggingface`` and imported back
with ``attnkit import`` (no download: this machine has no OPUS-MT model), so both contenders hold the
same weights: transformers' ``MarianMTModel`` reads the export, attnkit's engine the import. The
sentences: the first ``--sentences`` of Multi30k's test2016 German. Both decode with beam 4 in batches
of 32 sentences of similar length (attnkit sorts by length itself; the transformers batches are made
from the same order), fairseq's stopping (``early_stopping=True``), a budget of the source length + 50
tokens. They differ in the length penalty (attnkit GNMT's with alpha 0.6, transformers ``length ** 1.0``),
so the table also gives each one's BLEU and the share of identical outputs.

One contender at a time, alternating, each ``--repeats`` times at each thread count (wall time of the
whole set, tokenization and detokenization included; the first pass of each is an untimed warm-up).
transformers is a benchmark and test dependency (the ``dev`` extra), never attnkit's.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.common.measure import stamp  # noqa: E402
from attnkit.inference.translate import translate_texts  # noqa: E402
from attnkit.tasks import load_run  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from tables import append_run, markdown, measured  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "hf-decode.json"
DATA = ROOT.parent / "shared" / "data" / "multi30k"
BEAM, BATCH = 4, 32


def read(name: str, n: int) -> list[str]:
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        return [line.strip() for line in itertools.islice(f, n)]


def attnkit_decoder(run: Path):
    loaded = load_run(run)

    def decode(texts: list[str]) -> list[str]:
        return [h[0] for h in translate_texts(loaded.model, loaded.tok, texts, beam=BEAM, batch_size=BATCH)]

    return decode


def transformers_decoder(hf: Path):
    from transformers import MarianMTModel, MarianTokenizer

    model, tok = MarianMTModel.from_pretrained(str(hf)).eval(), MarianTokenizer.from_pretrained(str(hf))

    def decode(texts: list[str]) -> list[str]:
        lengths = [len(ids) for ids in tok(texts)["input_ids"]]
        order = sorted(range(len(texts)), key=lambda i: lengths[i])
        out: list[str] = [""] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), BATCH):
                chunk = order[start: start + BATCH]
                batch = tok([texts[i] for i in chunk], padding=True, return_tensors="pt")
                generated = model.generate(**batch, num_beams=BEAM, early_stopping=True, do_sample=False,
                                           max_new_tokens=batch["input_ids"].size(1) + 50)
                for i, text in zip(chunk, tok.batch_decode(generated, skip_special_tokens=True), strict=True):
                    out[i] = text
        return out

    return decode


def measure(run: Path, n: int, threads: list[int], repeats: int) -> dict:
    import sacrebleu
    import transformers

    texts, refs = read("test_2016_flickr.de.gz", n), read("test_2016_flickr.en.gz", n)
    work = Path(tempfile.mkdtemp(prefix="hf-decode-"))
    attnkit = [sys.executable, "-m", "attnkit"]
    subprocess.run([*attnkit, "export", str(run), "--to", "huggingface", "-o", str(work / "hf")], check=True)
    subprocess.run([*attnkit, "import", str(work / "hf"), "-o", str(work / "imported")], check=True)
    contenders = {"attnkit engine (imported run)": attnkit_decoder(work / "imported"),
                  "transformers generate (export)": transformers_decoder(work / "hf")}
    rows, outputs = [], {}
    for t in threads:
        torch.set_num_threads(t)
        for decode in contenders.values():
            decode(texts[:BATCH])  # warm-up
        for r in range(repeats):
            for name, decode in contenders.items():
                start = time.perf_counter()
                outputs[name] = decode(texts)
                seconds = time.perf_counter() - start
                rows.append({"contender": name, "threads": t, "repeat": r + 1, "seconds": seconds,
                             "sentences_per_s": n / seconds})
                print(f"{name}, {t} thread(s), pass {r + 1}: {n / seconds:.1f} sentences/s", flush=True)
    a, b = outputs.values()
    bleu = {name: sacrebleu.corpus_bleu(hyps, [refs]).score for name, hyps in outputs.items()}
    return {**stamp(), "cpu": cpu_model(), "command": f"python benchmarks/hf_decode.py {run}", "run": str(run),
            "sentences": n, "beam": BEAM, "batch": BATCH, "torch": torch.__version__,
            "transformers": transformers.__version__, "parameters": sum(p.numel() for p in
                                                                        load_run(run).model.parameters()),
            "measurements": rows, "bleu": bleu, "identical_share": sum(x == y for x, y in zip(a, b, strict=True)) / n}


def attnkit_over_transformers(run: dict) -> float:
    """attnkit's best median sentences/s over transformers', the headline."""
    by: dict[str, list[float]] = {}
    for m in run["measurements"]:
        by.setdefault((m["contender"], m["threads"]), []).append(m["sentences_per_s"])
    best = {}
    for (name, _), rates in by.items():
        best[name] = max(best.get(name, 0.0), sorted(rates)[len(rates) // 2])
    ours = next(v for k, v in best.items() if k.startswith("attnkit"))
    return ours / next(v for k, v in best.items() if not k.startswith("attnkit"))


def markdown_table(runs: list[dict]) -> str:
    """Sentences/s of each contender at each thread count, every pass, per run."""
    rows = []
    for run in runs:
        by = {}
        for m in run["measurements"]:
            by.setdefault((m["contender"], m["threads"]), []).append(m["sentences_per_s"])
        for (name, threads), rates in by.items():
            rows.append([name, threads, " / ".join(f"{v:.1f}" for v in rates), f"{run['bleu'][name]:.2f}",
                         f"{run['identical_share']:.0%}", run.get("cpu") or "", measured(run)])
    return markdown(["contender (same weights)", "threads", "sentences/s, each pass", "BLEU",
                     "identical outputs", "CPU", "measured"], rows, "lrrrrll")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="an attnkit Transformer translation run (Multi30k de->en)")
    p.add_argument("--sentences", type=int, default=500)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    result = measure(args.run, args.sentences, args.threads, args.repeats)
    append_run(OUT, result)
    print(markdown_table([result]))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
