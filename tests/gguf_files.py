"""Small GGUF files written here, with the `gguf` package's writer, from the tiny Hugging Face models of
tests/hf_models.py: what llama.cpp's ``convert_hf_to_gguf.py`` does, in a few lines.

- Tensor names come from gguf's own map (``gguf.get_tensor_name_map``), the one the converter uses; Llama's
  ``q_proj`` and ``k_proj`` rows are permuted for llama.cpp's RoPE (the converter's ``LlamaModel.permute``);
  GPT-2's Conv1D weights are transposed and its tied ``wte`` is written again as ``output``.
- 2-D weights take the file's type, 1-D ones (norms, biases) stay F32, as the converter writes them.
- The tokenizer becomes ``tokenizer.ggml.*`` metadata: a Llama tokenizer as a SentencePiece vocabulary
  (``model: llama``, a score per piece and no merges; a piece made by merge ``i`` scores ``-i``, as SentencePiece's
  BPE scores its pieces); a byte-level BPE as ``model: gpt2`` with its merges and a pre-tokenizer name. The model's
  rows past the tokenizer's vocabulary are ``[PAD<i>]`` pieces of type UNUSED, as the converter pads them.

``gguf.quants.quantize`` writes F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 but not the K-quants (it only
reads them): a K-quant file's weights are random blocks (:func:`random_blocks`), so they are not the Hugging Face
model's; the tests compare such a file with transformers' reading of the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from safetensors.torch import load_file

#: K-quant type -> (byte offset of each block's float16 scale d; of its float16 dmin, or None; of its 16 int8
#: sub-block scales, or None; the mean of its unsigned quants, so that dmin = mean * d centres the values).
K_QUANTS = {Q.Q2_K: (80, 82, None, 1.5), Q.Q3_K: (108, None, None, 0.0), Q.Q4_K: (0, 2, None, 7.5),
            Q.Q5_K: (0, 2, None, 15.5), Q.Q6_K: (208, None, 192, 0.0)}
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
         "gpt2": gguf.MODEL_ARCH.GPT2}
#: tokenizer.ggml.pre of each byte-level test tokenizer (llama.cpp's converter recognises a real one by a hash of
#: its output).
PRE = {"gpt2": "gpt-2", "qwen2": "qwen2"}


def random_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """``(rows, bytes per row)`` uint8: random ``qtype`` blocks with small scales and values about zero."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    d_at, dmin_at, scales_at, mean = K_QUANTS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-4, size=(len(data), 1)).astype(np.float16)
    data[:, d_at:d_at + 2] = d.view(np.uint8)
    if dmin_at is not None:
        data[:, dmin_at:dmin_at + 2] = (d * np.float16(mean)).view(np.uint8)
    if scales_at is not None:
        data[:, scales_at:scales_at + 16] = rng.integers(-8, 9, size=(len(data), 16)).astype(np.int8).view(np.uint8)
    return data.reshape(rows, -1)


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter: each head's rows from Hugging Face's rotate_half layout to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(config: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors under GGUF's names, laid out as llama.cpp's converter writes them."""
    model_type = config["model_type"]
    names = gguf.get_tensor_name_map(ARCHS[model_type], config.get("num_hidden_layers", config.get("n_layer")))
    out = {}
    for name, t in state.items():
        if model_type == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = t.t()
        if model_type in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            t = permute(t, config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"])
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise KeyError(f"gguf has no name for {name}")
        out[new] = t.contiguous()
    if model_type == "gpt2" and "output.weight" not in out:  # the converter writes the tied wte again
        out["output.weight"] = out["token_embd.weight"]
    return out


def _sentencepiece_vocab(tk: dict) -> dict[str, Any]:
    """``tokenizer.ggml.*`` of a Llama tokenizer (BPE with byte fallback over ``▁`` words) as SentencePiece's."""
    vocab, merges = tk["model"]["vocab"], tk["model"]["merges"]
    made_by = {"".join(m.split(" ") if isinstance(m, str) else m): i for i, m in enumerate(merges)}
    special = {t["content"] for t in tk["added_tokens"] if t["special"]}
    tokens = [p for p, _ in sorted(vocab.items(), key=lambda item: item[1])]
    scores, types = [], []
    for i, p in enumerate(tokens):
        byte = p.startswith("<0x") and p.endswith(">") and len(p) == 6
        scores.append(0.0 if p in special or byte else -float(made_by.get(p, len(merges) + i)))
        types.append(gguf.TokenType.CONTROL if p in special else gguf.TokenType.BYTE if byte else gguf.TokenType.NORMAL)
    types[vocab["<unk>"]] = gguf.TokenType.UNKNOWN
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": [int(t) for t in types],
            "tokenizer.ggml.unknown_token_id": vocab["<unk>"]}


def _byte_level_vocab(tk: dict, pre: str) -> dict[str, Any]:
    """``tokenizer.ggml.*`` of a byte-level BPE: its pieces, merges and added tokens (CONTROL when special)."""
    pieces, types = dict(tk["model"]["vocab"]), {}
    for t in tk["added_tokens"]:
        pieces[t["content"]] = t["id"]
        types[t["id"]] = gguf.TokenType.CONTROL if t["special"] else gguf.TokenType.USER_DEFINED
    tokens = [p for p, _ in sorted(pieces.items(), key=lambda item: item[1])]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tk["model"]["merges"]],
            "tokenizer.ggml.token_type": [int(types.get(i, gguf.TokenType.NORMAL)) for i in range(len(tokens))]}


def gguf_metadata(hf: Path) -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for the Hugging Face directory ``hf`` (keys without the
    architecture are written as ``{arch}.key``)."""
    config = json.loads((hf / "config.json").read_text())
    tk = json.loads((hf / "tokenizer.json").read_text())
    settings = json.loads((hf / "tokenizer_config.json").read_text())
    model_type = config["model_type"]
    if model_type == "gpt2":
        d = config["n_embd"]
        meta = {".context_length": config["n_positions"], ".embedding_length": d,
                ".feed_forward_length": config.get("n_inner") or 4 * d, ".block_count": config["n_layer"],
                ".attention.head_count": config["n_head"],
                ".attention.layer_norm_epsilon": config["layer_norm_epsilon"]}
    else:
        d, heads = config["hidden_size"], config["num_attention_heads"]
        meta = {".context_length": config["max_position_embeddings"], ".embedding_length": d,
                ".feed_forward_length": config["intermediate_size"], ".block_count": config["num_hidden_layers"],
                ".attention.head_count": heads, ".attention.head_count_kv": config["num_key_value_heads"],
                ".rope.dimension_count": d // heads,
                ".rope.freq_base": float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]),
                ".attention.layer_norm_rms_epsilon": config["rms_norm_eps"]}
    meta.update(_sentencepiece_vocab(tk) if model_type in ("llama", "mistral") else
                _byte_level_vocab(tk, PRE[model_type]))
    size = config["vocab_size"]
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + [f"[PAD{i}]" for i in range(n, size)]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [int(gguf.TokenType.UNUSED)] * (size - n)
    if "tokenizer.ggml.scores" in meta:
        meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"] + [-1000.0] * (size - n)
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if config.get(key) is not None:
            meta[f"tokenizer.ggml.{name}"] = config[key]
    meta["tokenizer.ggml.add_bos_token"] = bool(settings.get("add_bos_token", False))
    meta["tokenizer.ggml.add_eos_token"] = False
    return meta


def _value_type(value: Any, item: bool = False) -> V:
    """The GGUF type llama.cpp writes ``value`` as: counts and ids UINT32, list items (token types) INT32."""
    if isinstance(value, bool):
        return V.BOOL
    if isinstance(value, int):
        return V.INT32 if item or value < 0 else V.UINT32
    return {float: V.FLOAT32, str: V.STRING, list: V.ARRAY}[type(value)]


def write_gguf(hf: Path, out: Path, qtype: Q = Q.F32, *, seed: int = 0, arch: str | None = None,
               metadata: dict[str, Any] | None = None, types: dict[str, Q] | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """Write the GGUF of the Hugging Face directory ``hf`` (a tiny GPT-2, Llama, Mistral or Qwen2) with its 2-D
    weights in ``qtype`` (module doc) -> ``out``. For files attnkit must refuse: ``arch`` replaces
    ``general.architecture``, ``metadata`` sets keys (None: drops one; a key starting with ``.`` is the
    architecture's), ``types`` gives some tensors another type (F64 included), ``extra`` adds tensors."""
    config = json.loads((hf / "config.json").read_text())
    arch = arch or gguf.MODEL_ARCH_NAMES[ARCHS[config["model_type"]]]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(hf.name)
    writer.add_file_type(int(qtype))
    meta = {**gguf_metadata(hf), **(metadata or {})}
    for key, value in meta.items():
        if value is not None:
            key = f"{arch}{key}" if key.startswith(".") else key
            writer.add_key_value(key, value, _value_type(value), sub_type=_value_type(value[0], item=True)
                                 if isinstance(value, list) else None)
    tensors = gguf_tensors(config, load_file(str(hf / "model.safetensors")))
    for i, (name, t) in enumerate({**tensors, **{k: torch.from_numpy(v) for k, v in (extra or {}).items()}}.items()):
        data, kind = t.float().numpy(), (types or {}).get(name, qtype)
        if kind == Q.F64:
            writer.add_tensor(name, data.astype(np.float64))
        elif data.ndim == 1 or kind == Q.F32:
            writer.add_tensor(name, data)
        elif kind in K_QUANTS:
            writer.add_tensor(name, random_blocks(*data.shape, kind, seed + i), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
