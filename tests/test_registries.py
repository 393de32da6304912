"""One registry per axis: what differs by task is its :class:`~attnkit.tasks.TaskSpec`, what differs by model family
its :class:`~attnkit.interop.families.FamilySpec`; code outside asks them (``tests/test_layout.py`` holds it to
that)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from attnkit.common.errors import UserError
from attnkit.config.schema import RunConfig
from attnkit.export import TARGETS
from attnkit.interop.families import FAMILIES, export_family, gguf_family
from attnkit.runs.load import LoadedRun
from attnkit.tasks import TASKS, attention_maps, require, served_by
from attnkit.transformer import TransformerConfig


def run_of(task: str) -> LoadedRun:
    """A run of ``task`` as far as the registry reads one (its config; no trained model)."""
    return LoadedRun(RunConfig(task=task), tok=None, model=nn.Identity(), classes=None, weights_path=Path("w.pt"),
                     run_dir=Path(f"runs/{task}"))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_says_what_differs_by_it(name: str) -> None:
    """A model factory and a hint; export targets that exist; a task whose runs answer no route (a pretrained
    encoder, a starting point) has no attention reader either, and only a language model generates."""
    s = TASKS[name]
    assert s.name == name and callable(s.build_model) and s.hint
    assert set(s.exporters) <= set(TARGETS), s.exporters
    assert (s.attention_maps is None) == (s.serves is None)
    assert s.generates == (name == "lm")


def test_served_by_reads_a_task_name_from_any_file() -> None:
    """A config's or a manifest's ``task`` as read: a known name answers its route; anything else answers none."""
    assert served_by("lm", "generate") and served_by("translate", "translate") and served_by("classify", "classify")
    assert not served_by("lm", "translate") and not served_by("translate", "generate")
    assert not any(served_by(t, route) for t in ("pretrain", "nonesuch", None, ["lm"], 3)
                   for route in ("translate", "classify", "generate"))


def test_require_names_the_run_its_task_and_the_tasks_hint() -> None:
    lm = run_of("lm")
    assert require(lm, "generate", "runs/lm") is lm
    with pytest.raises(UserError, match=r"^runs/lm is a lm model; use `attnkit generate`$"):
        require(lm, "translate", "runs/lm")
    with pytest.raises(UserError, match=r"^runs/p is a pretrain run; fine-tune it \(model.init_from\) first$"):
        require(run_of("pretrain"), "classify", "runs/p", "run")
    with pytest.raises(UserError, match=r"; only translation runs$"):
        require(run_of("classify"), "translate", "runs/c", hint="only translation runs")


def test_a_task_without_an_attention_reader_is_refused_with_its_hint() -> None:
    with pytest.raises(UserError, match=r"^runs/pretrain is a pretrain run, .*; fine-tune it \(model.init_from\)"):
        attention_maps(run_of("pretrain"), "a text")


# -- model families ------------------------------------------------------------------------------------------


def test_every_family_is_read_whole_or_by_its_mapping() -> None:
    """Marian and BERT import themselves; a causal language model has the config and weight mapping both ways; a
    family with GGUF files has their reader, and no two share a GGUF architecture."""
    for f in FAMILIES.values():
        assert FAMILIES[f.model_type] is f and f.architectures
        mapping = (f.config, f.state, f.problem, f.export_config, f.export_state)
        assert (f.importer is not None) != all(m is not None for m in mapping), f.model_type
        assert (f.gguf is None) == (f.gguf_reader is None), f.model_type
    ggufs = [f.gguf for f in FAMILIES.values() if f.gguf]
    assert len(ggufs) == len(set(ggufs)) and {"llama", "qwen2", "gpt2"} <= set(ggufs)


GPT2 = TransformerConfig(encoder_layers=0, positions="learned", scale_embeddings=False, activation="gelu_tanh")
LLAMA = TransformerConfig(encoder_layers=0, positions="rope", norm="rmsnorm", activation="swiglu",
                          scale_embeddings=False, bias=False, norm_first=True)


@pytest.mark.parametrize(("cfg", "family"), [
    (GPT2, "gpt2"), (LLAMA, "llama"), (replace(LLAMA, window=16), "mistral"), (replace(LLAMA, qkv_bias=True), "qwen2"),
    (replace(LLAMA, qkv_bias=True, window=16), "qwen2")])
def test_a_language_model_is_exported_as_the_family_its_options_are(cfg: TransformerConfig, family: str) -> None:
    assert export_family(cfg, "runs/lm") is FAMILIES[family]


@pytest.mark.parametrize(("cfg", "option"), [
    (replace(GPT2, positions="sinusoidal"), "positions: sinusoidal"),
    (replace(LLAMA, norm="layernorm"), "norm: layernorm"), (replace(GPT2, window=8), "window: 8")])
def test_a_language_model_no_family_has_is_refused_naming_the_option(cfg: TransformerConfig, option: str) -> None:
    with pytest.raises(UserError, match=rf"^runs/lm cannot be exported to Hugging Face: model\.transformer\.{option} "):
        export_family(cfg, "runs/lm")


def test_a_gguf_is_read_as_the_family_its_architecture_names() -> None:
    assert gguf_family(SimpleNamespace(arch="qwen2", path=Path("m.gguf"))) is FAMILIES["qwen2"]
    with pytest.raises(UserError, match=r"^m\.gguf: key 'general.architecture' is 'mamba'; attnkit imports GGUF files "
                                        r"of llama, qwen2, gpt2$"):
        gguf_family(SimpleNamespace(arch="mamba", path=Path("m.gguf")))
