"""LoRA fine-tuning: attnkit against transformers + PEFT, tokens per second and peak memory.

    python benchmarks/lora.py --model SmolLM2-135M        # your download: any Llama, Mistral, Qwen2 or GPT-2 directory
    python benchmarks/lora.py                              # a random Llama of SmolLM2-135M's shape (no download:
                                                           # benchmarks/smollm2_shape.py)
    python benchmarks/lora.py --device cuda                # on a GPU (bf16 autocast by default there)

Both contenders fine-tune the same weights with LoRA adapters of the same rank, alpha and dropout on every
attention and FFN projection (attnkit's ``targets: [attention, feed_forward]``, PEFT's ``q_proj`` .. ``down_proj``, or
GPT-2's ``c_attn``, ``c_proj``, ``c_fc``), on the same batches of the same text (``--data``, default ``../shared``'s
tiny Shakespeare, cut by attnkit's ``task: lm`` into blocks of ``--block`` tokens, ``--batch`` blocks an update),
in the same precision, with AdamW and the gradient clipped to 1:

* **attnkit**: ``attnkit import`` of the model, then its trainer's own update (:meth:`Trainer.train_step` of a
  ``task: lm`` run with ``model.lora``: the engine's eager kernels, the output layer fused with the loss);
* **transformers + PEFT**: ``AutoModelForCausalLM`` (``sdpa`` attention) wrapped by ``peft.get_peft_model``, the
  cross-entropy of its logits as its ``labels=`` loss computes it (in float32, the mean), the same AdamW.

One contender at a time, each in a fresh process (so its peak memory is its own: the resident set on a CPU,
``torch.cuda.max_memory_allocated`` on a GPU), alternating, ``--repeats`` times; ``--warmup`` updates untimed, then
``--steps`` timed. Tokens/s counts the tokens predicted (batch x block per update). Every run is appended to
``results/lora.json``; the table in ``docs/lm-results.md`` shows the latest run per host kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from attnkit.cli import main as attnkit  # noqa: E402
from attnkit.common.measure import peak_rss_gb, stamp  # noqa: E402
from attnkit.config.loader import load_config  # noqa: E402
from attnkit.config.schema import RunConfig  # noqa: E402
from attnkit.interop.families import FAMILIES  # noqa: E402
from attnkit.tasks import load_run, make_task  # noqa: E402
from nbsvm import cpu_model  # noqa: E402
from smollm2_shape import build, shape  # noqa: E402
from tables import append_run, cpu_info, markdown, measured, num  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "lora.json"
DATA = ROOT.parent / "shared" / "data" / "shakespeare" / "input.txt"
CONTENDERS = ("attnkit", "transformers + PEFT")
def quiet(message: str) -> None:
    pass


def lora_config(args: argparse.Namespace, base: Path, data: Path) -> dict:
    """The attnkit run both contenders' settings come from."""
    transformer = load_run(base).cfg.model.transformer.__dict__
    return {"task": "lm",
            "data": {"train": str(data), "documents": "text", "valid_fraction": 0.01, "block_size": args.block,
                     "valid_blocks": 1},
            "model": {"init_from": str(base), "transformer": transformer,
                      "lora": {"rank": args.rank, "alpha": args.alpha, "dropout": args.dropout,
                               "targets": ["attention", "feed_forward"]}},
            "train": {"max_tokens": args.batch * args.block, "max_updates": 10**6, "valid_every": 10**6,
                      "optimizer": "adamw", "lr": 1e-4, "warmup": 1, "label_smoothing": 0.0, "clip_norm": 1.0,
                      "precision": args.precision, "threads": args.threads, "average_last": 0, "progress": False,
                      "seed": 1}}


def prepare(args: argparse.Namespace, work: Path) -> dict:
    """Import the model, write the attnkit config, prepare its data and the same batches in Hugging Face's ids ->
    what the result records of the setting."""
    data = Path(args.data)
    hf = Path(args.model) if args.model else build(work / "hf", shape(args.set))
    if attnkit(["import", str(hf), "-o", str(work / "base")]) != 0:
        raise SystemExit(f"attnkit import {hf} failed")
    raw = lora_config(args, work / "base", data)
    (work / "lora.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    task = make_task(load_config(RunConfig, raw), work / "run", quiet)
    groups = task.batches(0)[: args.warmup + args.steps]
    if len(groups) < args.warmup + args.steps:
        raise SystemExit(f"{data} gives {len(groups)} batches; ask for fewer --steps or a smaller --batch")
    to_hf = torch.tensor([h if h is not None else 0 for h in task.tok.original_ids])  # attnkit id -> Hugging Face's
    blocks = []
    for group in groups:
        batch = task.collate(group, torch.device("cpu"))
        blocks.append(to_hf[torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)])  # (B, T + 1)
    blocks = torch.stack(blocks)  # (updates, B, T + 1)
    save_file({"blocks": blocks}, str(work / "blocks.safetensors"))  # tensors only: nothing unpickled
    config = json.loads((hf / "config.json").read_text(encoding="utf-8"))
    name = "random SmolLM2-135M-shaped Llama" + (f" ({' '.join(args.set)})" if args.set else "")
    return {"model": str(args.model or name), "model_type": config["model_type"],
            "hf": str(hf), "parameters": sum(p.numel() for p in load_run(work / "base").model.parameters())}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: GPU memory allocated by torch on a GPU, else the resident set."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else peak_rss_gb()


def run_attnkit(args: argparse.Namespace, work: Path, device: torch.device) -> tuple[float, float]:
    """attnkit's trainer on the prepared run: ``--warmup`` updates, then the timed ones -> ``(seconds of those, the
    first update's loss)``."""
    from attnkit.training.trainer import Trainer

    cfg = load_config(RunConfig, work / "lora.yaml")
    trainer = Trainer(cfg, work / "run", log=quiet)  # the data prepared by the parent: reused
    trainer.model.train()
    groups = trainer.task.batches(0)
    first = float(trainer.train_step(groups[:1])[0])
    for i in range(1, args.warmup):
        trainer.train_step(groups[i: i + 1])
    synchronize(device)
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        trainer.train_step(groups[i: i + 1])
    synchronize(device)
    return time.perf_counter() - start, first


def run_peft(args: argparse.Namespace, work: Path, device: torch.device, hf: Path, model_type: str
             ) -> tuple[float, float]:
    """transformers + PEFT on the same batches (module doc) -> ``(seconds of the timed updates, the first update's
    loss)``."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, attn_implementation="sdpa")
    targets = sorted({m.split(".")[-1] for m in FAMILIES[model_type].peft.modules.values()})
    model = peft.get_peft_model(model.to(device), peft.LoraConfig(
        r=args.rank, lora_alpha=args.alpha, lora_dropout=args.dropout, target_modules=targets, task_type="CAUSAL_LM"))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0,
                                  fused=device.type in ("cpu", "cuda"))
    blocks = load_file(str(work / "blocks.safetensors"))["blocks"]

    def update(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(input_ids=x[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())  # as labels= computes it
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = float(update(blocks[0]))
    for x in blocks[1: args.warmup]:
        update(x)
    synchronize(device)
    start = time.perf_counter()
    for x in blocks[args.warmup:]:
        update(x)
    synchronize(device)
    return time.perf_counter() - start, first


def contender(args: argparse.Namespace) -> None:
    """In a fresh process: one contender's timed updates, one JSON line on standard output."""
    work, device = Path(args.work), torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    setting = json.loads((work / "setting.json").read_text(encoding="utf-8"))
    if args.contender == "attnkit":
        seconds, first = run_attnkit(args, work, device)
    else:
        seconds, first = run_peft(args, work, device, Path(setting["hf"]), setting["model_type"])
    tokens = args.steps * args.batch * args.block
    print(json.dumps({"contender": args.contender, "seconds": seconds, "tokens_per_s": tokens / seconds,
                      "peak_memory_gb": peak_memory_gb(device), "first_loss": first}), flush=True)


def measure(args: argparse.Namespace) -> dict:
    import peft
    import transformers

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    setting = prepare(args, work)
    (work / "setting.json").write_text(json.dumps(setting), encoding="utf-8")
    options = ["--work", str(work), "--device", args.device, "--precision", args.precision, "--threads",
               str(args.threads), "--rank", str(args.rank), "--alpha", str(args.alpha), "--dropout", str(args.dropout),
               "--block", str(args.block), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
               str(args.warmup)]
    rows = []
    for r in range(args.repeats):
        for name in CONTENDERS:
            done = subprocess.run([sys.executable, __file__, "--contender", name, *options], check=True,
                                  capture_output=True, text=True)
            row = {**json.loads(done.stdout.strip().splitlines()[-1]), "repeat": r + 1}
            rows.append(row)
            print(f"{name}, pass {r + 1}: {row['tokens_per_s']:.0f} tokens/s, peak {row['peak_memory_gb']:.2f} GB",
                  flush=True)
    host = torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_model()
    command = "python benchmarks/lora.py " + " ".join(sys.argv[1:])
    return {**stamp(), "host": host, "cpu": cpu_info(), "device": args.device, "command": command.strip(), **setting,
            "rank": args.rank, "alpha": args.alpha, "dropout": args.dropout, "block": args.block, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup, "precision": args.precision, "threads": args.threads,
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "measurements": rows}


def summary(run: dict) -> dict[str, tuple[float, float, float, list[float]]]:
    """Per contender: ``(median tokens/s, median peak GB, spread of tokens/s (max/min - 1), every pass's tokens/s)``."""
    out = {}
    for name in CONTENDERS:
        rates = [m["tokens_per_s"] for m in run["measurements"] if m["contender"] == name]
        memory = [m["peak_memory_gb"] for m in run["measurements"] if m["contender"] == name]
        out[name] = (statistics.median(rates), statistics.median(memory), max(rates) / min(rates) - 1, rates)
    return out


def attnkit_over_peft(run: dict) -> float:
    """The headline: attnkit's median tokens/s over transformers + PEFT's."""
    s = summary(run)
    return s["attnkit"][0] / s["transformers + PEFT"][0]


def markdown_table(runs: list[dict]) -> str:
    """docs/lm-results.md: each of ``runs`` (``report.py`` gives the latest of each host kind), each contender's
    median tokens/s and peak memory, and its ratio to transformers + PEFT's."""
    rows = []
    for run in runs:
        s = summary(run)
        peft_rate, peft_memory = s["transformers + PEFT"][:2]
        host = f"{run['device']}: {run['host']}"
        for name, (rate, memory, spread, rates) in s.items():
            rows.append([name, host, run["model"], f"r {run['rank']}, {run['batch']} x {run['block']}, "
                         f"{run['precision']}", num(rate), f"{rate / peft_rate:.2f}x", f"{memory:.2f}",
                         f"{memory / peft_memory:.2f}x", f"{len(rates)}, {spread:.0%}", measured(run)])
    table = markdown(["contender", "host", "model", "LoRA, batch, precision", "tokens/s", "vs PEFT", "peak GB",
                      "vs PEFT", "passes, spread", "measured"], rows, "llllrrrrrl")
    return f"{table}\n\nEach row is the median of its passes, the spread (max / min - 1) of their tokens/s beside it.\n"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face causal LM directory (default: a random Llama of SmolLM2-135M's "
                                   "shape, benchmarks/smollm2_shape.py)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="the random Llama's shape changed (smollm2_shape.py's keys; a smoke run's smaller model)")
    p.add_argument("--data", default=str(DATA), help="a text file (default: ../shared's tiny Shakespeare)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["float32", "bf16"], default=None,
                   help="both contenders' (default: float32 on a CPU, bf16 on a GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT, help="the results file (every run appended)")
    p.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)  # a child process's one contender
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "float32")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    return args


def main() -> None:
    args = arguments()
    if args.contender:
        contender(args)
        return
    result = measure(args)
    append_run(args.out, result)
    print(markdown_table([result]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
