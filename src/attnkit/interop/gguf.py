"""GGUF files (llama.cpp's format) as Hugging Face checkpoints: what ``attnkit import model.gguf -o RUN`` reads.

A GGUF holds what a Hugging Face directory spreads over several files: the architecture as metadata
(``llama.block_count``, ``llama.rope.freq_base``, ...), the weights, often quantized in blocks, and the tokenizer
as ``tokenizer.ggml.*`` metadata. The file is read with the `gguf` package (``gguf.GGUFReader``), and turned into
what the Hugging Face import reads, which then writes the run (:func:`attnkit.interop.import_gguf`, through
:func:`attnkit.interop.causal_lm.import_causal_lm`): a ``config.json`` and the state dict under Hugging Face's names
(a reader here per layout, :func:`llama_checkpoint` and :func:`gpt2_checkpoint`; each family names its own in
:data:`attnkit.interop.families.FAMILIES`) and a ``tokenizer.json`` (:mod:`attnkit.interop.gguf_tokenizer`). One
importer, two ways in.

=======================================  =====================================================================
 GGUF                                    Hugging Face
=======================================  =====================================================================
 ``general.architecture: llama``         ``LlamaForCausalLM`` (Llama, and Mistral, which llama.cpp writes as
                                         llama); ``qwen2``: ``Qwen2ForCausalLM``; ``gpt2``: ``GPT2LMHeadModel``
 ``{arch}.embedding_length``,            ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
 ``feed_forward_length``,                ``num_attention_heads``, ``num_key_value_heads``,
 ``block_count``, ``attention.head_      ``max_position_embeddings``, ``rope_theta``, ``rms_norm_eps``
 count``, ``head_count_kv``,             (GPT-2: ``n_embd``, ``n_inner``, ``n_layer``, ``n_head``,
 ``context_length``, ``rope.freq_base``, ``n_positions``, ``layer_norm_epsilon``)
 ``attention.layer_norm_rms_epsilon``
 ``token_embd``, ``output_norm``,        ``model.embed_tokens``, ``model.norm``, ``lm_head`` (absent: tied)
 ``output``
 ``blk.N.attn_norm``, ``ffn_norm``       ``model.layers.N.input_layernorm``, ``post_attention_layernorm``
 ``blk.N.attn_q``, ``attn_k``,           ``self_attn.q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; Llama's
 ``attn_v``, ``attn_output``             ``q`` and ``k`` rows put back (below)
 ``blk.N.ffn_gate``, ``ffn_up``,         ``mlp.gate_proj``, ``up_proj``, ``down_proj``
 ``ffn_down``
 GPT-2's ``position_embd``,              ``wpe``, ``h.N.attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
 ``attn_qkv``, ``attn_output``,          ``mlp.c_proj`` (Conv1D: transposed back), ``ln_1``, ``ln_2``, ``ln_f``
 ``ffn_up``, ``ffn_down``, the norms
=======================================  =====================================================================

**Weights** are dequantized to float32 by ``gguf.quants.dequantize``, which reads F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, the K-quants (Q2_K to Q6_K) and the IQ types; a type it cannot read is a one-line error naming
the tensor. The run is float32: the quantization's rounding stays in the weights, its memory saving does not.

**RoPE's layout.** llama.cpp rotates interleaved pairs ``(2i, 2i+1)``; its converter permutes the rows of a
Llama's ``q_proj`` and ``k_proj`` (per head, ``(2, d/2)`` -> ``(d/2, 2)``) to that layout, and the import undoes
it, as transformers' GGUF loader does, back to Hugging Face's ``rotate_half`` pairs ``(i, i + d/2)``, which are
:class:`attnkit.positions.RotaryPositions`'. Qwen2's GGUF keeps Hugging Face's layout (llama.cpp's NEOX rope).

What attnkit cannot represent is one line naming the key or tensor: another architecture, RoPE scaling
(``rope.scaling.type``, Llama 3.1's ``rope_freqs`` tensor), a head width that is not ``embedding_length /
head_count`` (``rope.dimension_count``, ``attention.key_length``), per-layer head counts, experts, a tensor the
architecture does not have, a file split in parts (``split.count``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..common.errors import UserError
from .gguf_file import GGUFFile

#: A Llama-family layer's tensors (``blk.N.``) -> Hugging Face's (``model.layers.N.``).
LLAMA_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
#: A GPT-2 layer's tensors (``blk.N.``) -> Hugging Face's (``transformer.h.N.``); the last four are Conv1D.
GPT2_LAYER = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
              "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
#: The ends a GGUF may name (``tokenizer.ggml.{name}_token_id``): of the text, of a turn (an instruct model's
#: ``<|im_end|>``, ``<|eot_id|>``), of a message; generation stops at each (the first is attnkit's ``</s>``).
END_TOKENS = ("eos", "eot", "eom")
GENERATION_CONFIG = "generation_config.json"
#: Tensors some GGUFs have that say what attnkit's model is not.
REFUSED_TENSORS = {"rope_freqs.weight": "RoPE frequency factors (Llama 3.1's rope scaling); attnkit's RoPE has "
                                        "no scaling"}


def _refuse_extra(g: GGUFFile, expected: set[str]) -> None:
    """An error for the first tensor the architecture does not have."""
    for name in g.tensors:
        if name not in expected:
            why = REFUSED_TENSORS.get(name, f"not part of a {g.arch} model attnkit can represent")
            raise UserError(f"{g.path}: tensor '{name}': {why}")


def _heads(g: GGUFFile, d: int) -> tuple[int, int, int]:
    """``(heads, key/value heads, head width)``; per-layer counts and a head width other than ``d / heads`` are
    errors."""
    heads = g.arch_value("attention.head_count", int)
    kv = g.arch_value("attention.head_count_kv", int, heads) if g.arch != "gpt2" else heads
    if heads < 1 or d % heads or kv < 1 or heads % kv:
        raise UserError(f"{g.path}: keys '{g.arch}.attention.head_count' ({heads}) and 'head_count_kv' ({kv}) do not "
                        f"split embedding_length {d} into heads")
    head_dim = d // heads
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = g.arch_value(key, int, head_dim)
        if value != head_dim:
            raise UserError(f"{g.path}: key '{g.arch}.{key}' is {value}, not embedding_length / head_count "
                            f"({head_dim}); attnkit's heads split the model width and RoPE rotates all of each head")
    return heads, kv, head_dim


def _refuse_options(g: GGUFFile) -> None:
    """Errors for what no supported architecture has: RoPE scaling and experts."""
    scaling = g.arch_value("rope.scaling.type", str, "none")
    if scaling != "none":
        raise UserError(f"{g.path}: key '{g.arch}.rope.scaling.type' is {scaling!r}; attnkit's RoPE has no scaling")
    experts = g.arch_value("expert_count", int, 0)
    if experts:
        raise UserError(f"{g.path}: key '{g.arch}.expert_count' is {experts}; attnkit has no mixture of experts")


def _ids(g: GGUFFile) -> dict[str, int]:
    """The special token ids the metadata names, under ``config.json``'s keys."""
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    return {hf: g.value(f"tokenizer.ggml.{key}", int) for hf, key in keys.items() if g.has(f"tokenizer.ggml.{key}")}


def _read(g: GGUFFile, shapes: dict[str, tuple[int, ...]], names: dict[str, str],
          block: Callable[[str, str, str, torch.Tensor], tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each tensor of ``shapes`` read (its shape checked) under its Hugging Face name: ``names[name]`` outside the
    blocks, ``block(layer, part, kind, tensor) -> (name, tensor)`` for ``blk.{layer}.{part}.{kind}``."""
    state = {}
    for name, shape in shapes.items():
        t = g.tensor(name, shape)
        if name.startswith("blk."):
            _, i, part, kind = name.split(".")
            hf_name, t = block(i, part, kind, t)
            state[hf_name] = t
        else:
            state[names[name]] = t
    return state


def llama_checkpoint(g: GGUFFile) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json, state dict)`` of a Llama or Qwen2 GGUF, under Hugging Face's names (module doc); the config
    without ``model_type`` and ``architectures``, which its family gives."""
    d, ff = g.arch_value("embedding_length", int), g.arch_value("feed_forward_length", int)
    layers = g.arch_value("block_count", int)
    heads, kv, head_dim = _heads(g, d)
    _refuse_options(g)
    vocab = g.shape("token_embd.weight")[0] if "token_embd.weight" in g.tensors else 0
    qwen2 = g.arch == "qwen2"
    qkv_bias = qwen2 or "blk.0.attn_q.bias" in g.tensors
    mlp_bias = not qwen2 and "blk.0.ffn_up.bias" in g.tensors
    if not qwen2 and qkv_bias != mlp_bias:
        raise UserError(f"{g.path}: tensors 'blk.0.attn_q.bias' and 'blk.0.ffn_up.bias': one is present without "
                        f"the other; attnkit's bias option covers attention and FFN together")
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if "output.weight" in g.tensors:
        shapes["output.weight"] = (vocab, d)
    layer = {"attn_norm": (d,), "ffn_norm": (d,), "attn_q": (heads * head_dim, d), "attn_k": (kv * head_dim, d),
             "attn_v": (kv * head_dim, d), "attn_output": (d, heads * head_dim), "ffn_gate": (ff, d),
             "ffn_up": (ff, d), "ffn_down": (d, ff)}
    for i in range(layers):
        for name, shape in layer.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
            if (qkv_bias and name in ("attn_q", "attn_k", "attn_v")) or \
                    (mlp_bias and name in ("attn_output", "ffn_gate", "ffn_up", "ffn_down")):
                shapes[f"blk.{i}.{name}.bias"] = shape[:1]
    _refuse_extra(g, set(shapes))
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}

    def block(i: str, part: str, kind: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        if g.arch == "llama" and part in ("attn_q", "attn_k"):
            t = unpermute(t, heads if part == "attn_q" else kv)
        return f"model.layers.{i}.{LLAMA_LAYER[part]}.{kind}", t

    state = _read(g, shapes, names, block)
    config = {"vocab_size": vocab, "hidden_size": d,
              "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu",
              "max_position_embeddings": g.arch_value("context_length", int),
              "rope_theta": g.arch_value("rope.freq_base", float, 10000.0),
              "rms_norm_eps": g.arch_value("attention.layer_norm_rms_epsilon", float),
              "tie_word_embeddings": "output.weight" not in g.tensors, **_ids(g)}
    if not qwen2:
        config.update(attention_bias=qkv_bias, mlp_bias=mlp_bias)
    return config, state


def gpt2_checkpoint(g: GGUFFile) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config.json, state dict)`` of a GPT-2 GGUF, under Hugging Face's names (module doc); the config without
    ``model_type`` and ``architectures``, which its family gives."""
    d, ff = g.arch_value("embedding_length", int), g.arch_value("feed_forward_length", int)
    layers, positions = g.arch_value("block_count", int), g.arch_value("context_length", int)
    heads, _, _ = _heads(g, d)
    _refuse_options(g)
    vocab = g.shape("token_embd.weight")[0] if "token_embd.weight" in g.tensors else 0
    shapes = {"token_embd.weight": (vocab, d), "position_embd.weight": (positions, d), "output_norm.weight": (d,),
              "output_norm.bias": (d,)}
    if "output.weight" in g.tensors:
        shapes["output.weight"] = (vocab, d)
    layer = {"attn_norm": (d,), "ffn_norm": (d,), "attn_qkv": (3 * d, d), "attn_output": (d, d), "ffn_up": (ff, d),
             "ffn_down": (d, ff)}
    for i in range(layers):
        for name, shape in layer.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
            shapes[f"blk.{i}.{name}.bias"] = shape[:1]
    _refuse_extra(g, set(shapes))
    names = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
             "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
             "output.weight": "lm_head.weight"}

    def block(i: str, part: str, kind: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        if part in CONV1D and kind == "weight":  # (out, in) -> Conv1D's (in, out)
            t = t.t().contiguous()
        return f"transformer.h.{i}.{GPT2_LAYER[part]}.{kind}", t

    state = _read(g, shapes, names, block)
    config = {"vocab_size": vocab, "n_embd": d,
              "n_inner": ff, "n_layer": layers, "n_head": heads, "n_positions": positions,
              "layer_norm_epsilon": g.arch_value("attention.layer_norm_epsilon", float),
              "activation_function": "gelu_new", "tie_word_embeddings": "output.weight" not in g.tensors,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **_ids(g)}
    return config, state


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """``w`` ``(n_head * d_k, ...)`` from llama.cpp's interleaved RoPE rows back to Hugging Face's ``rotate_half``
    rows: per head, row ``2i + j`` goes to ``j * d_k/2 + i`` (the inverse of llama.cpp's converter ``permute``)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
