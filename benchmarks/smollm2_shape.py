"""A random-weight Llama of SmolLM2-135M's shape, built with transformers (nothing downloaded), for the races.

    python benchmarks/smollm2_shape.py OUT_DIR [--seed 0] [--set num_hidden_layers=2 ...]

Speed does not depend on training, so the generation race decodes a model of a real small LM's shape
(:data:`SMOLLM2_135M`: 30 layers, 576 wide, 9 query and 3 key/value heads, SwiGLU 1536, a vocabulary of 49,152,
tied embeddings) with random weights from a fixed seed. Its tokenizer is Llama's kind (BPE over ``▁``-prefixed
words with byte fallback, ``<unk> <s> </s>`` at 0..2; ``tests/hf_models.py``'s :func:`llama_tokenizer`), trained
to exactly the vocabulary's size on tiny Shakespeare's training part (and, where that has too few merges to learn, as
for 49,152 pieces, Multi30k's English and German training sides too), because llama.cpp's converter writes one
token per embedding row and reads this kind of tokenizer without knowing it beforehand (a byte-level BPE it
has not seen is refused).

Two departures from a plain ``LlamaForCausalLM(config)``, so that greedy texts can be compared between
implementations: the weights are drawn with a larger spread than the initializer's (:data:`SPREAD`; with
transformers' 0.02 and tied embeddings, each layer moves the residual so little that every model repeats the
prompt's last token), and the embedding rows of ``<unk>``, ``<s>`` and ``</s>`` are zero (their logits are 0, never
the greatest), so no contender's choice falls on a token one of them treats specially (attnkit never samples
``<unk>`` or ``<s>``; transformers' ``min_new_tokens`` bans ``</s>``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"

#: SmolLM2-135M's config.json, the keys that set its shape and its arithmetic.
SMOLLM2_135M = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
                "rope_theta": 100000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
#: The standard deviation of every random matrix (norms stay 1).
SPREAD = 0.08
#: The written directory's marker, last: a directory without it is incomplete and is built again.
DONE = "attnkit-race-model.json"


def shape(overrides: list[str]) -> dict:
    """:data:`SMOLLM2_135M` with ``KEY=VALUE`` overrides (a smaller model for a smoke run), values as JSON."""
    out = dict(SMOLLM2_135M)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in out:
            raise SystemExit(f"--set {item}: expected KEY=VALUE with KEY one of {', '.join(out)}")
        out[key] = json.loads(value)
    return out


def build(out: Path, config: dict, seed: int = 0) -> Path:
    """Write the model directory (config, random weights, tokenizer) into ``out``, or reuse it if one of the same
    ``config`` and ``seed`` is there already; returns ``out``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import transformers

    from hf_models import llama_tokenizer  # the tests' Llama-kind tokenizer, at another size

    recipe = {"config": config, "seed": seed, "spread": SPREAD, "transformers": transformers.__version__}
    marker = out / DONE
    if marker.exists() and json.loads(marker.read_text(encoding="utf-8")) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    text = (DATA / "shakespeare" / "input.txt").read_text(encoding="utf-8")
    lines = [line for line in text[: int(len(text) * 0.9)].splitlines() if line.strip()]  # nanoGPT's training part
    size = config["vocab_size"]
    tk = llama_tokenizer(out, lines, trained=size - 256)
    if tk.get_vocab_size() < size:  # more text: Multi30k's training sides
        for side in ("en", "de"):
            with gzip.open(DATA / "multi30k" / f"train.{side}.gz", "rt", encoding="utf-8") as f:
                lines += f.read().splitlines()
        tk = llama_tokenizer(out, lines, trained=size - 256)
    if tk.get_vocab_size() != size:
        raise SystemExit(f"the tokenizer learned {tk.get_vocab_size()} pieces, not {size}: too little text for "
                         f"vocab_size {size}")
    settings = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings["model_max_length"] = config["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    cfg = transformers.LlamaConfig(**config, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 2:  # every matrix (the embedding included); norms stay 1
                p.copy_(torch.randn(p.shape, generator=g) * SPREAD)
        model.get_input_embeddings().weight[:3] = 0.0  # <unk>, <s>, </s>: never the greedy choice (module doc)
    model.save_pretrained(out)
    marker.write_text(json.dumps(recipe), encoding="utf-8")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="change the shape (e.g. for a smoke run)")
    args = p.parse_args()
    print(build(args.out, shape(args.set), args.seed))


if __name__ == "__main__":
    main()
