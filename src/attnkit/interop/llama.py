"""Hugging Face Llama (``LlamaForCausalLM``), Mistral (``MistralForCausalLM``) and Qwen2 (``Qwen2ForCausalLM``) as
attnkit language models, and back.

Llama is :class:`attnkit.lm.LanguageModel` with today's options (Touvron et al. 2023):

=========================================  =============================================================
 Llama (Hugging Face)                      attnkit ``model.transformer``
=========================================  =============================================================
 ``embed_tokens``, no scale                ``embed``, ``scale_embeddings: false``
 rotary positions, ``rope_theta``          ``positions: rope``, ``rope_theta``
 ``q_proj``, ``k_proj``, ``v_proj``        ``self_attn.in_proj`` = ``[W^Q; W^K; W^V]``, ``n_kv_heads:
                                           num_key_value_heads`` (grouped-query attention)
 ``o_proj``                                ``self_attn.out_proj``
 ``input_layernorm``,                      ``norm1``, ``norm2``, ``final_norm`` (pre-norm, ``norm: rmsnorm``,
 ``post_attention_layernorm``, ``norm``    ``norm_eps: rms_norm_eps``)
 ``mlp.gate_proj``, ``up_proj``,           ``ff.w1``, ``ff.w3``, ``ff.w2`` (``activation: swiglu``:
 ``down_proj``, ``hidden_act: silu``       ``(swish(x W_1) * x W_3) W_2``)
 ``attention_bias``, ``mlp_bias``          ``bias`` (both or neither)
 Qwen2's ``q_proj``, ``k_proj``,           ``qkv_bias`` (``bias: false``): ``self_attn.in_proj.bias`` =
 ``v_proj`` biases                         ``[b^Q; b^K; b^V]``; ``o_proj`` and the MLP have none
 ``lm_head`` (or tied to the embedding)    ``out_proj``, ``tie_output`` (``tie_word_embeddings``)
 Mistral's ``sliding_window``              ``window``
 Qwen2's ``use_sliding_window``,           ``window``, where every layer has the same one (module doc)
 ``sliding_window``, ``max_window_layers``
=========================================  =============================================================

RoPE's layout: Hugging Face's ``rotate_half`` pairs dimension ``i`` with ``i + d/2`` (its ``q_proj`` and
``k_proj`` rows were permuted into that layout when Meta's checkpoints were converted), which is
:class:`attnkit.positions.RotaryPositions`' layout, so the projections are copied as they are. RoPE with
scaling (``rope_scaling``, a ``rope_type`` other than ``default``: Llama 3.1's, YaRN, linear) is not
attnkit's and is refused. The vocabulary's rows are renumbered by :mod:`attnkit.interop.causal_lm`.

Qwen2's window: only with ``use_sliding_window: true``, and then only in the layers ``layer_types`` calls
``sliding_attention`` (without it, layers ``max_window_layers`` and above). attnkit's ``window`` is every layer's,
so a window in some layers only is refused. Most Qwen2 checkpoints have ``use_sliding_window: false``: their
``sliding_window`` is unused, by transformers and here.
"""

from __future__ import annotations

import torch

from ..common.errors import UserError
from ..transformer import TransformerConfig
from .hf import CONFIG, HFDirectory, tensor

#: ``hidden_act`` -> attnkit's ``activation``: the gated FFN with swish, SwiGLU.
ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}
#: Names per layer (``model.layers.i.``) -> attnkit's (``layers.i.``); the norms have only a weight.
NORMS = {"input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
LINEARS = {"self_attn.o_proj": "self_attn.out_proj", "mlp.gate_proj": "ff.w1", "mlp.up_proj": "ff.w3",
           "mlp.down_proj": "ff.w2"}
#: Qwen2's layers, what transformers' ``Qwen2Config`` calls them.
SLIDING, FULL = "sliding_attention", "full_attention"
MAX_WINDOW_LAYERS = 28  # Qwen2Config's default: the first layer with a window, when use_sliding_window is true


def rope_theta(hf: HFDirectory) -> float:
    """RoPE's base; rotary scaling of any kind (``rope_scaling``, ``rope_parameters``' ``rope_type``) is an error."""
    where = hf.path / CONFIG
    scaling = hf.config.get("rope_scaling")
    params = hf.config.get("rope_parameters")  # transformers 5: {"rope_type": ..., "rope_theta": ...}
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is None:
            continue
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
        if kind != "default":
            raise UserError(f"{where}: key '{key}' has rope type {kind!r}; attnkit's RoPE has no scaling "
                            f"(rope_type: default)")
        if isinstance(value, dict) and value.get("partial_rotary_factor", 1.0) != 1.0:
            raise UserError(f"{where}: key '{key}' has partial_rotary_factor {value['partial_rotary_factor']}; "
                            f"attnkit's RoPE rotates every dimension")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else hf.key("rope_theta", (int, float), 10000.0))


def sliding_window(hf: HFDirectory) -> int:
    """The window every layer has (0: none): Mistral's ``sliding_window``; Qwen2's only with ``use_sliding_window``,
    and then in every layer or none (module doc)."""
    if hf.model_type == "mistral":
        return int(hf.key("sliding_window", int)) if hf.config.get("sliding_window") is not None else 0
    if hf.model_type != "qwen2" or not hf.key("use_sliding_window", bool, False):
        return 0
    where, n = hf.path / CONFIG, hf.key("num_hidden_layers")
    types = hf.config.get("layer_types")
    if types is None:  # what Qwen2Config derives: a window from layer max_window_layers on
        first = hf.key("max_window_layers", int, MAX_WINDOW_LAYERS)
        types, source = [SLIDING if i >= first else FULL for i in range(n)], f"max_window_layers {first}"
    elif not isinstance(types, list) or len(types) != n or not all(t in (SLIDING, FULL) for t in types):
        raise UserError(f"{where}: key 'layer_types' is {types!r}; expected {n} of {SLIDING!r} or {FULL!r}")
    else:
        source = "layer_types"
    sliding = types.count(SLIDING)
    if 0 < sliding < n:
        raise UserError(f"{where}: key 'use_sliding_window' is true with a window in {sliding} of {n} layers "
                        f"({source}); attnkit's window is the same in every layer")
    window = hf.key("sliding_window", int) if sliding else 0
    if sliding and window < 1:
        raise UserError(f"{where}: key 'sliding_window' is {window}; expected a positive number of positions")
    return window


def llama_config(hf: HFDirectory) -> TransformerConfig:
    """attnkit's options for the Llama, Mistral or Qwen2 ``hf.config`` describes; what attnkit cannot represent is
    a one-line error naming the key."""
    where = hf.path / CONFIG
    d, heads = hf.key("hidden_size"), hf.key("num_attention_heads")
    head_dim = hf.config.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != d:
        raise UserError(f"{where}: key 'head_dim' is {head_dim}, not hidden_size / num_attention_heads "
                        f"({d} / {heads}); attnkit's heads split the model width")
    qwen2 = hf.model_type == "qwen2"  # biases on q, k and v only (Qwen2 has no attention_bias or mlp_bias key)
    attention_bias = False if qwen2 else hf.key("attention_bias", bool, False)
    mlp_bias = False if qwen2 else hf.key("mlp_bias", bool, False)
    if attention_bias != mlp_bias:
        raise UserError(f"{where}: keys 'attention_bias' ({attention_bias}) and 'mlp_bias' ({mlp_bias}) differ; "
                        f"attnkit's bias option covers attention and FFN together")
    kv = hf.key("num_key_value_heads", int, heads)
    return TransformerConfig(
        d_model=d, n_heads=heads, d_ff=hf.key("intermediate_size"), encoder_layers=0,
        decoder_layers=hf.key("num_hidden_layers"), dropout=0.0,
        attention_dropout=float(hf.key("attention_dropout", (int, float), 0.0)), norm_first=True, positions="rope",
        rope_theta=rope_theta(hf), max_len=hf.key("max_position_embeddings"),
        tie_output=bool(hf.key("tie_word_embeddings", bool, False)), activation=hf.choice("hidden_act", ACTIVATIONS),
        scale_embeddings=False, norm_eps=float(hf.key("rms_norm_eps", (int, float), 1e-6)), norm="rmsnorm",
        n_kv_heads=0 if kv == heads else kv, window=sliding_window(hf), bias=attention_bias, qkv_bias=qwen2)


def _kinds(cfg: TransformerConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The tensors of ``q_proj``, ``k_proj``, ``v_proj``, then of the other linear maps: a weight, and a bias where
    ``cfg`` has one (``qkv_bias``: on the first three only)."""
    both, weight = ("weight", "bias"), ("weight",)
    return both if cfg.bias or cfg.qkv_bias else weight, both if cfg.bias else weight


def llama_state(hf: HFDirectory, state: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """attnkit's :class:`~attnkit.lm.LanguageModel` tensors from Llama's, the vocabulary in Llama's order."""
    path = hf.path
    out = {"embed.embedding.weight": tensor(state, path, "model.embed_tokens.weight"),
           "final_norm.weight": tensor(state, path, "model.norm.weight")}
    if not cfg.tie_output:
        out["out_proj.weight"] = tensor(state, path, "lm_head.weight")
    qkv_kinds, kinds = _kinds(cfg)
    for i in range(cfg.decoder_layers):
        hf_layer, layer = f"model.layers.{i}", f"layers.{i}"
        for hf_name, name in NORMS.items():
            out[f"{layer}.{name}.weight"] = tensor(state, path, f"{hf_layer}.{hf_name}.weight")
        for kind in qkv_kinds:  # [W^Q; W^K; W^V], and [b^Q; b^K; b^V] in the same order
            out[f"{layer}.self_attn.in_proj.{kind}"] = torch.cat(
                [tensor(state, path, f"{hf_layer}.self_attn.{p}_proj.{kind}") for p in "qkv"])
        for kind in kinds:
            for hf_name, name in LINEARS.items():
                out[f"{layer}.{name}.{kind}"] = tensor(state, path, f"{hf_layer}.{hf_name}.{kind}")
    return out


def llama_problem(cfg: TransformerConfig) -> str | None:
    """The first option of ``cfg`` Llama (or Mistral for ``window``, Qwen2 for ``qkv_bias``) lacks, as
    ``key: value``; None if none."""
    wanted = [("positions", "rope"), ("norm", "rmsnorm"), ("activation", "swiglu"), ("scale_embeddings", False),
              ("output_bias", False), ("attention_score", "scaled_dot")]
    for key, value in wanted:
        if getattr(cfg, key) != value:
            return f"{key}: {getattr(cfg, key)}"
    if cfg.bias and cfg.window:  # Mistral's config has no attention_bias or mlp_bias (Llama's has)
        return f"bias: {cfg.bias}"
    return None


def export_architecture(cfg: TransformerConfig) -> tuple[str, str]:
    """``(architecture, model_type)`` of ``cfg``: Qwen2 with ``qkv_bias`` (a window or not), else Mistral with a
    ``window``, else Llama."""
    if cfg.qkv_bias:
        return "Qwen2ForCausalLM", "qwen2"
    return ("MistralForCausalLM", "mistral") if cfg.window > 0 else ("LlamaForCausalLM", "llama")


def llama_export_config(cfg: TransformerConfig, vocab_size: int, ids: dict[str, int | None]) -> dict:
    """``LlamaForCausalLM``'s ``config.json`` for ``cfg`` (``MistralForCausalLM``'s with a ``window``,
    ``Qwen2ForCausalLM``'s with ``qkv_bias``)."""
    if cfg.norm_first is False:
        raise UserError("model.transformer.norm_first: false (post-norm) has no Hugging Face Llama equivalent")
    architecture, model_type = export_architecture(cfg)
    config = {"architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
              "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.decoder_layers,
              "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
              "head_dim": cfg.d_model // cfg.n_heads, "hidden_act": "silu", "max_position_embeddings": cfg.max_len,
              "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
              "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
              "tie_word_embeddings": cfg.tie_output, "attention_dropout": cfg.attention_dropout,
              "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"], "dtype": "float32"}
    if model_type == "qwen2":  # the window in every layer (max_window_layers 0), or in none
        config.update(use_sliding_window=cfg.window > 0, sliding_window=cfg.window or None,
                      max_window_layers=0 if cfg.window else cfg.decoder_layers,
                      layer_types=[SLIDING if cfg.window else FULL] * cfg.decoder_layers)
    elif model_type == "mistral":
        config["sliding_window"] = cfg.window
    else:
        config.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    return config


def llama_export_state(sd: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM``'s (or Mistral's, Qwen2's) tensors from attnkit's (the vocabulary rows already in the
    export's order)."""
    out = {"model.embed_tokens.weight": sd["embed.embedding.weight"], "model.norm.weight": sd["final_norm.weight"]}
    if not cfg.tie_output:
        out["lm_head.weight"] = sd["out_proj.weight"]
    H, Hkv, dk = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.d_model // cfg.n_heads
    qkv_kinds, kinds = _kinds(cfg)
    for i in range(cfg.decoder_layers):
        hf_layer, layer = f"model.layers.{i}", f"layers.{i}"
        for hf_name, name in NORMS.items():
            out[f"{hf_layer}.{hf_name}.weight"] = sd[f"{layer}.{name}.weight"]
        for kind in qkv_kinds:
            q, k, v = sd[f"{layer}.self_attn.in_proj.{kind}"].split([H * dk, Hkv * dk, Hkv * dk])
            for p, t in zip("qkv", (q, k, v), strict=True):
                out[f"{hf_layer}.self_attn.{p}_proj.{kind}"] = t.contiguous()
        for kind in kinds:
            for hf_name, name in LINEARS.items():
                out[f"{hf_layer}.{hf_name}.{kind}"] = sd[f"{layer}.{name}.{kind}"]
    return out
