"""An adapted run's LoRA adapters (:mod:`attnkit.lora`) as Hugging Face PEFT writes them: ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained(model, DIR)`` puts on the base model.

    attnkit export RUN --to huggingface --adapters -o DIR

The base model is the Hugging Face checkpoint the base run was imported from (``base_model_name_or_path``), or,
for a base trained here, what ``attnkit export BASE --to huggingface`` writes of it. Each target maps to the
module PEFT adapts (its ``target_modules``), the tensors named ``base_model.model.<module>.lora_A.weight``
``(r, d_in)`` and ``lora_B.weight`` ``(d_out, r)``, scaled by ``lora_alpha / r`` as here:

==========  ============================  =======================================================================
target      Llama, Mistral, Qwen2         GPT-2
==========  ============================  =======================================================================
``q k v``   ``q_proj``, ``k_proj``,       one adapter on the fused ``c_attn`` (a Conv1D: ``fan_in_fan_out``) of
            ``v_proj``                    rank ``n r`` for ``n`` of them: ``A = [A_q; A_k; A_v]`` ``(n r, d)``,
                                          ``B = diag(B_q, B_k, B_v)`` ``(3 d, n r)`` (zero rows for a part not
                                          adapted), ``lora_alpha`` ``n alpha``: ``(n alpha / n r) B A`` is exactly
                                          the three adapters (``rank_pattern``, ``alpha_pattern``)
``o``       ``o_proj``                    ``attn.c_proj``
``w1``      ``gate_proj``                 ``mlp.c_fc``
``w3``      ``up_proj``                   (none: GPT-2's FFN is not gated)
``w2``      ``down_proj``                 ``mlp.c_proj``
==========  ============================  =======================================================================

``tests/test_lora.py`` loads the export with the real ``peft`` on tiny Llama and GPT-2 checkpoints: the logits are
the adapted run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..common.errors import UserError
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..lm import LanguageModel, LMConfig
from ..lora import LoRAConfig, apply_lora, lora_state_dict, place_rows
from ..runs.adapters import checked_base
from ..runs.checkpoint import check_compatible, load_weights
from ..runs.layout import CONFIG_FILE, find_run, find_weights
from .families import PeftLayout, export_family
from .hf import write_directory

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_peft_adapters"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
#: Where each target's layer is in attnkit's block.
PATHS = {"q": "self_attn.in_proj", "k": "self_attn.in_proj", "v": "self_attn.in_proj", "o": "self_attn.out_proj",
         "w1": "ff.w1", "w3": "ff.w3", "w2": "ff.w2"}
QKV = ("q", "k", "v")


def _adapters(run_dir: Path, weights: Path, cfg: RunConfig) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """``(the adapters of weights, model.lora)``, checked against what ``cfg``'s model has (names and shapes)."""
    lora = cfg.model.lora
    if lora is None:
        raise UserError(f"{run_dir} has no LoRA adapters (model.lora); export the whole model: drop --adapters")
    with torch.device("meta"):  # shapes only
        skeleton = apply_lora(LanguageModel(LMConfig.of(cfg.model.transformer), 8), lora)
    state, _ = load_weights(weights)
    check_compatible(lora_state_dict(skeleton), state, weights)
    return state, lora


def _fused_qkv(state: dict[str, torch.Tensor], layer: str, targets: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-2's ``c_attn`` adapter from the ``q``, ``k``, ``v`` adapters (module doc): ``(A (n r, d), B (3 d, n r))``."""
    A = [state[f"{layer}.self_attn.in_proj.lora_A.{t}"] for t in targets]  # (r, d) each
    B = [state[f"{layer}.self_attn.in_proj.lora_B.{t}"] for t in targets]  # (d, r) each (GPT-2: H_kv = H)
    d = B[0].size(0)
    return torch.cat(A), place_rows(B, [(QKV.index(t) * d, (QKV.index(t) + 1) * d) for t in targets], 3 * d)


def peft_state(state: dict[str, torch.Tensor], cfg: RunConfig, layout: PeftLayout
               ) -> tuple[dict[str, torch.Tensor], dict]:
    """``(PEFT's tensors, the per-module rank and alpha patterns)`` of an adapted run's adapters ``state``, placed
    as its family's ``layout`` says."""
    lora = cfg.model.lora
    if lora is None:
        raise ValueError("peft_state needs a config with model.lora")
    prefix, modules = layout.prefix, layout.modules
    targets = lora.expanded(gated=cfg.model.transformer.activation == "swiglu")
    out: dict[str, torch.Tensor] = {}
    patterns: dict = {"rank_pattern": {}, "alpha_pattern": {}}
    for i in range(cfg.model.transformer.decoder_layers):
        layer, hf = f"layers.{i}", "base_model.model." + prefix.format(i=i)
        qkv = [t for t in QKV if t in targets]
        if layout.fused_qkv and qkv:
            A, B = _fused_qkv(state, layer, qkv)
            out[f"{hf}attn.c_attn.lora_A.weight"], out[f"{hf}attn.c_attn.lora_B.weight"] = A, B
            if len(qkv) > 1:
                patterns["rank_pattern"]["c_attn"] = len(qkv) * lora.rank
                patterns["alpha_pattern"]["c_attn"] = len(qkv) * lora.alpha
        for t in targets:
            if layout.fused_qkv and t in QKV:
                continue
            for m in "AB":
                out[f"{hf}{modules[t]}.lora_{m}.weight"] = state[f"{layer}.{PATHS[t]}.lora_{m}.{t}"].contiguous()
    return {k: v.detach().float().contiguous() for k, v in out.items()}, patterns


def export_peft_adapters(run_path: str | Path, out: str | Path, *, force: bool = False) -> Path:
    """Write the adapters of the adapted run ``run_path`` as a PEFT adapter directory ``out`` (module doc)."""
    run_dir, weights = find_weights(Path(run_path))
    cfg = load_config(RunConfig, run_dir / CONFIG_FILE)
    state, lora = _adapters(run_dir, weights, cfg)
    layout = export_family(LMConfig.of(cfg.model.transformer), str(run_path)).peft
    if layout is None:
        raise ValueError("every language-model family has a PEFT layout")
    tensors, patterns = peft_state(state, cfg, layout)
    base_dir = find_run(checked_base(run_dir))
    imported = load_config(RunConfig, base_dir / CONFIG_FILE).data.imported_from
    modules = layout.modules
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": imported or None,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
              "target_modules": sorted({modules[t] for t in
                                        lora.expanded(gated=cfg.model.transformer.activation == "swiglu")}),
              "fan_in_fan_out": layout.conv1d, "bias": "none", "use_rslora": False, "init_lora_weights": True,
              "modules_to_save": None, "layers_to_transform": None, "inference_mode": True, **patterns}

    def write(directory: Path) -> None:
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    return write_directory(out, write, marker=ADAPTER_CONFIG, force=force)
