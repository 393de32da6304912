"""The model families attnkit crosses to and from: one :class:`FamilySpec` each in :data:`FAMILIES`, the one place
a family is named.

===========================  ===========================================  =======================================
family (``model_type``)      import (``attnkit import``)                  export (``--to huggingface``)
===========================  ===========================================  =======================================
``marian``                   :func:`~.marian.import_marian`               :func:`~.marian.export_marian`
``bert``                     :func:`~.bert.import_bert`                   none
``llama``, ``mistral``,      :func:`~.causal_lm.import_causal_lm` with    :func:`~.causal_lm.export_causal_lm`
``qwen2``                    :mod:`.llama`'s mapping; GGUF ``llama``,     with :mod:`.llama`'s mapping, as the
                             ``qwen2``                                    family :func:`export_family` picks
``gpt2``                     the same with :mod:`.gpt2`'s mapping;        the same with :mod:`.gpt2`'s mapping
                             GGUF ``gpt2``
===========================  ===========================================  =======================================

Marian and BERT are read whole by their own modules (an encoder-decoder and an encoder, each with its own
tokenizer); the causal language models share one import and one export (:mod:`.causal_lm`: the vocabulary, the
chat template, the files) and differ in their mapping, which their spec carries. Which runs export at all is the
task's (:attr:`attnkit.tasks.TaskSpec.exporters`). llama.cpp writes a Mistral GGUF as ``llama``: it is read as
Llama.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import UserError
from ..transformer import TransformerConfig
from .bert import ARCHITECTURES as BERT_ARCHITECTURES
from .bert import import_bert
from .gguf import gpt2_checkpoint, llama_checkpoint
from .gguf_file import GGUFFile
from .gpt2 import gpt2_config, gpt2_export_config, gpt2_export_state, gpt2_problem, gpt2_state
from .hf import HFDirectory
from .llama import (
    export_architecture,
    llama_config,
    llama_export_config,
    llama_export_state,
    llama_problem,
    llama_state,
)
from .marian import import_marian

__all__ = ["FAMILIES", "FamilySpec", "PeftLayout", "export_family", "family", "gguf_family"]

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PeftLayout:
    """Where a family's layers keep the modules LoRA adapts, as PEFT names them (:mod:`attnkit.interop.peft`).

    :param prefix: layer ``i``'s prefix, ``{i}`` in it.
    :param modules: each ``model.lora.targets`` name (``q``, ``k``, ``v``, ``o``, ``w1``, ``w3``, ``w2``) -> the
        module's name in the layer.
    :param conv1d: its linear layers are ``Conv1D`` s (GPT-2's): weights stored ``(in, out)``, PEFT's
        ``fan_in_fan_out``.
    """

    prefix: str
    modules: dict[str, str]
    conv1d: bool = False

    @property
    def fused_qkv(self) -> bool:
        """One module computes the queries, keys and values (GPT-2's ``c_attn``): their adapters become one."""
        return self.modules["q"] == self.modules["k"] == self.modules["v"]


@dataclass(frozen=True)
class FamilySpec:
    """One model family (:data:`FAMILIES`): how its checkpoints become runs and runs become its checkpoints.

    :param model_type: ``config.json``'s ``model_type``.
    :param architectures: the ``architectures`` its ``config.json`` may name; an export writes the first.
    :param importer: a family read whole by its own module (Marian, BERT): ``(hf, out, *, force) -> out``; None for
        a causal language model, which :func:`attnkit.interop.causal_lm.import_causal_lm` reads with the mapping
        below.
    :param config: a causal language model's ``config.json`` as attnkit's ``model.transformer``.
    :param state: its weights under attnkit's names ``(hf, weights, cfg) -> state``.
    :param problem: why a run's ``model.transformer`` cannot be written as this family (None: it can).
    :param export_config: the ``config.json`` a run is written with ``(cfg, vocab_size, ids) -> config``.
    :param export_state: the run's weights under the family's names ``(state, cfg) -> state``.
    :param gguf: the ``general.architecture`` of its GGUF files, and ``gguf_reader`` what reads one as a Hugging Face
        checkpoint (:mod:`attnkit.interop.gguf`): ``g -> (config.json, weights)``.
    :param peft: where its LoRA adapters go in a PEFT adapter (``attnkit export --adapters``).
    """

    model_type: str
    architectures: tuple[str, ...]
    importer: Callable[..., Path] | None = None
    config: Callable[[HFDirectory], TransformerConfig] | None = None
    state: Callable[[HFDirectory, State, TransformerConfig], State] | None = None
    problem: Callable[[TransformerConfig], str | None] | None = None
    export_config: Callable[[TransformerConfig, int, dict], dict] | None = None
    export_state: Callable[[State, TransformerConfig], State] | None = None
    gguf: str | None = None
    gguf_reader: Callable[[GGUFFile], tuple[dict, State]] | None = None
    peft: PeftLayout | None = None


_GPT2 = {"config": gpt2_config, "state": gpt2_state, "problem": gpt2_problem, "export_config": gpt2_export_config,
         "export_state": gpt2_export_state,
         "peft": PeftLayout("transformer.h.{i}.", {"q": "attn.c_attn", "k": "attn.c_attn", "v": "attn.c_attn",
                                                   "o": "attn.c_proj", "w1": "mlp.c_fc", "w2": "mlp.c_proj"},
                            conv1d=True)}
_LLAMA = {"config": llama_config, "state": llama_state, "problem": llama_problem, "export_config": llama_export_config,
          "export_state": llama_export_state,
          "peft": PeftLayout("model.layers.{i}.", {"q": "self_attn.q_proj", "k": "self_attn.k_proj",
                                                   "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                                                   "w1": "mlp.gate_proj", "w3": "mlp.up_proj",
                                                   "w2": "mlp.down_proj"})}

#: Every family, by ``config.json``'s ``model_type``.
FAMILIES: dict[str, FamilySpec] = {f.model_type: f for f in (
    FamilySpec("marian", ("MarianMTModel",), importer=import_marian),
    FamilySpec("bert", BERT_ARCHITECTURES, importer=import_bert),
    FamilySpec("llama", ("LlamaForCausalLM", "LlamaModel"), **_LLAMA, gguf="llama", gguf_reader=llama_checkpoint),
    FamilySpec("mistral", ("MistralForCausalLM", "MistralModel"), **_LLAMA),
    FamilySpec("qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), **_LLAMA, gguf="qwen2", gguf_reader=llama_checkpoint),
    FamilySpec("gpt2", ("GPT2LMHeadModel", "GPT2Model"), **_GPT2, gguf="gpt2", gguf_reader=gpt2_checkpoint),
)}


def family(hf: HFDirectory) -> FamilySpec:
    """The family of the checkpoint ``hf`` (its ``model_type``).

    :raises UserError: a ``model_type`` attnkit does not import, naming those it does.
    """
    if hf.model_type not in FAMILIES:
        raise UserError(f"{hf.path / 'config.json'}: key 'model_type' is {hf.model_type!r}; attnkit imports "
                        f"{', '.join(FAMILIES)}")
    return FAMILIES[hf.model_type]


def gguf_family(g: GGUFFile) -> FamilySpec:
    """The family of the GGUF file ``g`` (its ``general.architecture``).

    :raises UserError: an architecture attnkit does not import, naming those it does.
    """
    found = {f.gguf: f for f in FAMILIES.values() if f.gguf is not None}
    if g.arch not in found:
        raise UserError(f"{g.path}: key 'general.architecture' is {g.arch!r}; attnkit imports GGUF files of "
                        f"{', '.join(found)}")
    return found[g.arch]


def export_family(cfg: TransformerConfig, name: str) -> FamilySpec:
    """The family a language model's ``cfg`` is written as: GPT-2 (learned positions), else Llama (rope): Qwen2 with
    ``qkv_bias``, Mistral with a ``window``, else Llama itself.

    :raises UserError: an option neither has an equivalent for, naming it.
    """
    if cfg.positions == "learned":
        found = FAMILIES["gpt2"]
    elif cfg.positions == "rope":
        found = FAMILIES[export_architecture(cfg)[1]]
    else:
        found = None
    problem = found.problem(cfg) if found is not None and found.problem is not None else f"positions: {cfg.positions}"
    if problem:
        raise UserError(f"{name} cannot be exported to Hugging Face: model.transformer.{problem} has no equivalent in "
                        f"GPT-2 (learned positions, LayerNorm) or Llama (rope, rmsnorm, swiglu)")
    return found
