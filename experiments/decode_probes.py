"""What we tried to speed up attnkit's own decoding, measured side by side on one model.

    flock /tmp/attnkit-bench.lock python experiments/decode_probes.py --run runs/de-en [--threads 2]

Four ways to run the same trained de->en model through ``attnkit.inference.translate.translate_texts``, one after
the other in this process (the model loaded once):

* ``float32``: the model as trained;
* ``bf16 autocast``: ``torch.autocast('cpu', bfloat16)`` around decoding, as ``benchmarks/decode.py``;
* ``bf16 weights``: a copy of the model cast to bfloat16 (no per-op casts);
* ``int8 dynamic``: a copy whose ``nn.Linear`` modules (feed-forward, attention output, the output
  layer; not the stacked Q/K/V projection, whose weight the cross-attention slices) are replaced by
  PyTorch's dynamically quantized int8 linears (``torch.ao.quantization.quantize_dynamic``, deprecated
  by PyTorch in favour of torchao; a probe, not a product path).

Each is timed on two workloads: beam 4 over the first ``--sentences`` test_2016_flickr sentences in
batches of 32 (target tokens/s, sacreBLEU on those sentences), and greedy decoding of single sentences
one at a time (median latency over ``--single`` sentences), as one client of ``attnkit serve`` sees it.
The contenders alternate over ``--rounds`` rounds and every round is kept.

Writes ``benchmarks/results/decode-probes.json``; :func:`markdown_table` renders it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # tables: the markdown helpers report.py's tables share
sys.path.insert(0, str(ROOT / "src"))

from tables import markdown, measured, num  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "multi30k"
OUT = ROOT / "benchmarks" / "results" / "decode-probes.json"
LABELS = {"fp32": "float32", "autocast": "bf16 autocast", "bf16": "bf16 weights", "int8": "int8 dynamic"}


def contenders(model):
    """``{name: (model, context factory)}`` for the four ways of running ``model``."""
    import torch

    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("in_proj")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), names, dtype=torch.qint8)
    return {"fp32": (model, contextlib.nullcontext),
            "autocast": (model, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
            "bf16": (copy.deepcopy(model).to(torch.bfloat16), contextlib.nullcontext),
            "int8": (int8, contextlib.nullcontext)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a trained de->en translation run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sentences", type=int, default=320)
    p.add_argument("--single", type=int, default=60, help="sentences decoded one at a time (greedy)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import sacrebleu
    import torch

    from attnkit.common.measure import stamp
    from attnkit.inference.translate import translate_texts
    from attnkit.tasks import load_run

    torch.set_num_threads(args.threads)
    with gzip.open(DATA / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        src = [line.strip() for line in f][: args.sentences]
    with gzip.open(DATA / "test_2016_flickr.en.gz", "rt", encoding="utf-8") as f:
        ref = [line.strip() for line in f][: args.sentences]
    run = load_run(args.run)
    rounds: list[dict] = []
    for r in range(args.rounds):
        for name, (model, context) in contenders(run.model).items():
            with context():
                translate_texts(model, run.tok, src[:32], beam=4)  # warm-up
                start = time.perf_counter()
                hyps = [h[0] for h in translate_texts(model, run.tok, src, beam=4, batch_size=32)]
                seconds = time.perf_counter() - start
                latencies = []
                for sentence in src[: args.single]:
                    t = time.perf_counter()
                    translate_texts(model, run.tok, [sentence], beam=1)
                    latencies.append(1000 * (time.perf_counter() - t))
            tokens = sum(len(ids) + 1 for ids in run.tok.encode_tgt(hyps))  # + </s>
            row = {"round": r + 1, "contender": name, "tokens_per_s": round(tokens / seconds, 1),
                   "bleu": round(sacrebleu.corpus_bleu(hyps, [ref]).score, 2),
                   "single_median_ms": round(statistics.median(latencies), 1)}
            rounds.append(row)
            print(row, flush=True)
    results = {**stamp(), "run": Path(args.run).name, "threads": args.threads, "sentences": len(src),
               "single": args.single, "beam": 4, "batch_size": 32, "rows": rounds,
               "command": " ".join(["python", "experiments/decode_probes.py", *sys.argv[1:]])}
    OUT.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(markdown_table(results))


def markdown_table(results: dict) -> str:
    """benchmarks/README.md: every round of every contender, and each one's speed relative to float32."""
    fp32 = {r["round"]: r for r in results["rows"] if r["contender"] == "fp32"}
    rows = [[r["round"], LABELS[r["contender"]], num(r["tokens_per_s"]),
             f"{r['tokens_per_s'] / fp32[r['round']]['tokens_per_s']:.2f}x", f"{r['bleu']:.2f}",
             f"{r['single_median_ms']:.1f}"] for r in results["rows"]]
    head = (f"{results['run']}, first {results['sentences']} test_2016_flickr sentences, beam {results['beam']} in "
            f"batches of {results['batch_size']}; single sentences greedy ({results['single']}); "
            f"{results['threads']} threads; {measured(results)}.\n\n")
    return head + markdown(["round", "decoding", "beam target tok/s", "vs float32", "BLEU", "single sentence ms"],
                           rows, "rlrrrr")


if __name__ == "__main__":
    main()
