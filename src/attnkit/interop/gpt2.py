"""Hugging Face GPT-2 (``GPT2LMHeadModel``) as an attnkit language model, and back.

GPT-2 is :class:`attnkit.lm.LanguageModel` with options (Radford et al. 2019):

====================================  ==================================================================
 GPT-2 (Hugging Face)                 attnkit ``model.transformer``
====================================  ==================================================================
 ``wte``, no scale                    ``embed``, ``scale_embeddings: false``
 ``wpe``                              ``positions: learned`` (``max_len: n_positions``)
 ``ln_1``, ``ln_2``, ``ln_f``         ``norm1``, ``norm2``, ``final_norm`` (pre-norm, LayerNorm,
                                      ``norm_eps: layer_norm_epsilon``)
 ``attn.c_attn`` (Conv1D, ``(d, 3d)``)  ``self_attn.in_proj`` = its transpose, ``[W^Q; W^K; W^V]``
 ``attn.c_proj``, ``mlp.c_fc``,       ``self_attn.out_proj``, ``ff.w1``, ``ff.w2`` (transposed likewise)
 ``mlp.c_proj``
 ``activation_function`` gelu_new    ``activation: gelu_tanh`` (the same tanh approximation; ``gelu`` is
                                      the exact one, ``relu`` and ``silu`` are ``relu`` and ``swish``)
 ``scale_attn_weights: false``        ``attention_score: dot``
 ``lm_head`` tied to ``wte``          ``tie_output`` (``tie_word_embeddings``)
====================================  ==================================================================

Conv1D stores ``y = x W + b`` with ``W`` ``(in, out)``; ``nn.Linear`` stores ``W^T`` ``(out, in)``. The
vocabulary's rows are renumbered by :mod:`attnkit.interop.causal_lm`; here every tensor keeps GPT-2's order.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..common.errors import UserError
from ..transformer import TransformerConfig
from .hf import HFDirectory, tensor

#: ``activation_function`` -> attnkit's ``activation`` (each exactly the same function).
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
               "silu": "swish", "swish": "swish"}
EXPORT_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "swish": "silu"}
#: GPT-2's layer names -> attnkit's (every one a weight and a bias; the Conv1D weights are transposed).
LAYER = {"ln_1": "norm1", "attn.c_attn": "self_attn.in_proj", "attn.c_proj": "self_attn.out_proj", "ln_2": "norm2",
         "mlp.c_fc": "ff.w1", "mlp.c_proj": "ff.w2"}
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def gpt2_config(hf: HFDirectory) -> TransformerConfig:
    """attnkit's options for the GPT-2 ``hf.config`` describes; what it cannot represent is a one-line error."""
    hf.refuse("add_cross_attention", False, "imports GPT-2 as a language model, without cross-attention")
    hf.refuse("scale_attn_by_inverse_layer_idx", False, "scales every layer's attention by 1/sqrt(d_k) alike")
    d = hf.key("n_embd")
    inner = hf.config.get("n_inner")
    return TransformerConfig(
        d_model=d, n_heads=hf.key("n_head"), d_ff=hf.key("n_inner") if inner is not None else 4 * d,
        encoder_layers=0, decoder_layers=hf.key("n_layer"), dropout=float(hf.key("resid_pdrop", (int, float), 0.1)),
        attention_dropout=float(hf.key("attn_pdrop", (int, float), 0.1)), norm_first=True, positions="learned",
        attention_score="scaled_dot" if hf.key("scale_attn_weights", bool, True) else "dot",
        max_len=hf.key("n_positions"), tie_output=bool(hf.key("tie_word_embeddings", bool, True)),
        activation=hf.choice("activation_function", ACTIVATIONS, "gelu_new"), scale_embeddings=False,
        norm_eps=float(hf.key("layer_norm_epsilon", (int, float), 1e-5)), norm="layernorm", bias=True)


def gpt2_state(hf: HFDirectory, state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """attnkit's :class:`~attnkit.lm.LanguageModel` tensors from GPT-2's, the vocabulary in GPT-2's order."""
    path: Path = hf.path
    p = "transformer." if any(k.startswith("transformer.") for k in state) else ""  # GPT2Model has no prefix
    out = {"embed.embedding.weight": tensor(state, path, f"{p}wte.weight"),
           "positions.table.weight": tensor(state, path, f"{p}wpe.weight"),
           "final_norm.weight": tensor(state, path, f"{p}ln_f.weight"),
           "final_norm.bias": tensor(state, path, f"{p}ln_f.bias")}
    if not cfg.tie_output:
        out["out_proj.weight"] = tensor(state, path, "lm_head.weight")
    for i in range(cfg.decoder_layers):
        for hf_name, name in LAYER.items():
            weight = tensor(state, path, f"{p}h.{i}.{hf_name}.weight")
            out[f"layers.{i}.{name}.weight"] = weight.t().contiguous() if hf_name in CONV1D else weight
            out[f"layers.{i}.{name}.bias"] = tensor(state, path, f"{p}h.{i}.{hf_name}.bias")
    return out


def gpt2_problem(cfg: TransformerConfig) -> str | None:
    """The first option of ``cfg`` GPT-2 lacks (as ``key: value``), or None when it is a GPT-2."""
    wanted = [("positions", "learned"), ("norm", "layernorm"), ("scale_embeddings", False), ("output_bias", False),
              ("window", 0)]  # bias: false is exported as zero biases (GPT-2 has them everywhere)
    for key, value in wanted:
        if getattr(cfg, key) != value:
            return f"{key}: {getattr(cfg, key)}"
    if cfg.activation not in EXPORT_ACTIVATIONS:
        return f"activation: {cfg.activation}"
    if cfg.n_kv_heads not in (0, cfg.n_heads):
        return f"n_kv_heads: {cfg.n_kv_heads}"
    return None


def gpt2_export_config(cfg: TransformerConfig, vocab_size: int, ids: dict[str, int | None]) -> dict:
    """``GPT2LMHeadModel``'s ``config.json`` for ``cfg`` (``ids``: bos, eos and pad token ids)."""
    if cfg.norm_first is False:
        raise UserError("model.transformer.norm_first: false (post-norm) has no Hugging Face GPT-2 equivalent")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
            "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_layer": cfg.decoder_layers, "n_inner": cfg.d_ff,
            "n_positions": cfg.max_len, "activation_function": EXPORT_ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.attention_dropout, "scale_attn_weights": cfg.attention_score == "scaled_dot",
            "tie_word_embeddings": cfg.tie_output, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
            "pad_token_id": ids["pad"], "add_cross_attention": False, "dtype": "float32"}


def gpt2_export_state(sd: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel``'s tensors from attnkit's (the vocabulary rows already in the export's order)."""
    out = {"transformer.wte.weight": sd["embed.embedding.weight"],
           "transformer.wpe.weight": sd["positions.table.weight"],
           "transformer.ln_f.weight": sd["final_norm.weight"], "transformer.ln_f.bias": sd["final_norm.bias"]}
    if not cfg.tie_output:  # a tied lm_head is wte, which transformers does not store twice
        out["lm_head.weight"] = sd["out_proj.weight"]
    for i in range(cfg.decoder_layers):
        for hf_name, name in LAYER.items():
            weight = sd[f"layers.{i}.{name}.weight"]
            out[f"transformer.h.{i}.{hf_name}.weight"] = weight.t().contiguous() if hf_name in CONV1D else weight
            bias = sd.get(f"layers.{i}.{name}.bias")  # bias: false -> zeros, which compute the same
            out[f"transformer.h.{i}.{hf_name}.bias"] = weight.new_zeros(weight.size(0)) if bias is None else bias
    return out
