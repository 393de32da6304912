"""Tests for attnkit.config: typed YAML loading, overrides, errors that name the key, round trips."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from attnkit.common.errors import UserError
from attnkit.config.loader import config_to_dict, dump_config, load_config


@dataclass
class ModelCfg:
    d_model: int = 64
    n_heads: int = 4
    dropout: float = 0.1
    norm: Literal["pre", "post"] = "pre"
    tie_embeddings: bool = True

    def validate(self) -> None:
        if self.d_model % self.n_heads:
            raise UserError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


@dataclass
class DataCfg:
    src: Path
    vocab_size: int | None = None
    buckets: list[int] = field(default_factory=lambda: [8, 16])
    betas: tuple[float, float] = (0.9, 0.98)
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class RunCfg:
    data: DataCfg
    model: ModelCfg = field(default_factory=ModelCfg)
    lr: float = 1e-3
    name: str = "run"
    seeds: tuple[int, ...] = ()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_loads_commented_yaml_with_defaults_and_conversions(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# a run\n"
        "data:\n"
        "  src: corpus/train.de.gz   # a path\n"
        "  betas: [0.9, 0.999]\n"
        "  extra: {smoothing: 1}\n"
        "model:\n"
        "  d_model: 128\n"
        "  norm: post\n"
        "lr: 3\n"
        "seeds: [1, 2]\n",
    )
    cfg = load_config(RunCfg, path)
    assert cfg.data.src == Path("corpus/train.de.gz")
    assert cfg.data.vocab_size is None and cfg.data.buckets == [8, 16]
    assert cfg.data.betas == (0.9, 0.999) and cfg.data.extra == {"smoothing": 1.0}
    assert cfg.model == ModelCfg(d_model=128, norm="post")
    assert cfg.lr == 3.0 and isinstance(cfg.lr, float)
    assert cfg.seeds == (1, 2)


def test_overrides_are_parsed_as_yaml_and_applied() -> None:
    cfg = load_config(
        RunCfg,
        {"data": {"src": "a"}},
        [
            "model.d_model=256",
            "model.tie_embeddings=false",
            "data.src=path.de.gz",
            "data.buckets=[1,2]",
            "data.vocab_size=8000",
            "lr=1e-4",
            "data.extra.x=2.5",
        ],
    )
    assert cfg.model.d_model == 256 and cfg.model.tie_embeddings is False
    assert cfg.data.src == Path("path.de.gz") and cfg.data.buckets == [1, 2]
    assert cfg.data.vocab_size == 8000
    assert cfg.lr == pytest.approx(1e-4)  # PyYAML reads `1e-4` as a string; floats accept it
    assert cfg.data.extra == {"x": 2.5}


def test_overrides_do_not_mutate_the_source_dict() -> None:
    source = {"data": {"src": "a"}}
    load_config(RunCfg, source, ["data.src=b"])
    assert source == {"data": {"src": "a"}}


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {src: a}\nmodel:\n  d_modle: 3\n")
    with pytest.raises(UserError) as err:
        load_config(RunCfg, path)
    assert str(err.value) == f"{path}: unknown key 'model.d_modle' (did you mean 'model.d_model'?)"


def test_unknown_key_in_override_names_override() -> None:
    with pytest.raises(UserError, match=r"^override: unknown key 'model.d_modle' \(did you mean 'model.d_model'\?\)$"):
        load_config(RunCfg, {"data": {"src": "a"}}, ["model.d_modle=3"])
    with pytest.raises(UserError, match=r"^override: unknown key 'nmae' \(did you mean 'name'\?\)$"):
        load_config(RunCfg, {"data": {"src": "a"}}, ["nmae=x"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"lr": "abc"}, "key 'lr' must be a float, got 'abc'"),
        ({"lr": True}, "key 'lr' must be a float, got True"),
        ({"model": {"d_model": True}}, "key 'model.d_model' must be an integer, got True"),
        ({"model": {"d_model": 1.5}}, "key 'model.d_model' must be an integer, got 1.5"),
        ({"model": {"tie_embeddings": "no"}}, "key 'model.tie_embeddings' must be a boolean"),
        ({"model": {"norm": "mid"}}, "key 'model.norm' must be one of 'pre', 'post', got 'mid'"),
        ({"data": {"src": "a", "buckets": [1, "x"]}}, "key 'data.buckets[1]' must be an integer, got 'x'"),
        ({"data": {"src": "a", "betas": [0.9]}}, "key 'data.betas' must be a list of 2 items"),
        ({"data": {"src": "a", "vocab_size": "big"}}, "key 'data.vocab_size' must be an integer"),
        ({"data": {"src": 3}}, "key 'data.src' must be a path (string), got 3"),
        ({"data": {"src": "a"}, "model": 5}, "key 'model' must be a mapping, got 5"),
        ({"data": {"src": "a"}, "name": 7}, "key 'name' must be a string, got 7"),
    ],
)
def test_wrong_types_name_the_key(data: dict, message: str) -> None:
    data = {"data": {"src": "a"}, **data}
    with pytest.raises(UserError) as err:
        load_config(RunCfg, data)
    assert str(err.value).startswith("<config>: " + message)


def test_wrong_type_in_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {src: a}\nlr: abc\n")
    with pytest.raises(UserError) as err:
        load_config(RunCfg, path)
    assert str(err.value) == f"{path}: key 'lr' must be a float, got 'abc'"


def test_wrong_type_in_override_names_override() -> None:
    with pytest.raises(UserError, match=r"^override: key 'lr' must be a float, got 'abc'$"):
        load_config(RunCfg, {"data": {"src": "a"}}, ["lr=abc"])


def test_missing_required_key(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"missing required key 'data'"):
        load_config(RunCfg, write(tmp_path, "lr: 0.1\n"))
    with pytest.raises(UserError, match=r"missing required key 'data.src'"):
        load_config(RunCfg, {"data": {}})


def test_yaml_syntax_error_has_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  src: a\nmodel: [1, 2\nlr: 3\n")
    with pytest.raises(UserError, match=rf"^{path}:\d+: invalid YAML"):
        load_config(RunCfg, path)


def test_duplicate_key_is_an_error_with_line(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {src: a}\nlr: 0.1\nlr: 0.2\n")
    with pytest.raises(UserError, match=rf"^{path}:3: invalid YAML: duplicate key 'lr'"):
        load_config(RunCfg, path)


def test_top_level_must_be_a_mapping_and_empty_file_uses_defaults(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="top level must be a mapping"):
        load_config(RunCfg, write(tmp_path, "- a\n- b\n"))
    assert load_config(ModelCfg, write(tmp_path, "# only comments\n")) == ModelCfg()


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read config file"):
        load_config(RunCfg, tmp_path / "nope.yaml")


def test_malformed_override() -> None:
    with pytest.raises(UserError, match="expected dotted.key=value"):
        load_config(RunCfg, {"data": {"src": "a"}}, ["model.d_model"])
    with pytest.raises(UserError, match="does not exist"):
        load_config(RunCfg, {"data": {"src": "a"}}, ["lr.x=1"])


def test_validate_runs_for_nested_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {src: a}\nmodel: {d_model: 30, n_heads: 4}\n")
    with pytest.raises(UserError) as err:
        load_config(RunCfg, path)
    assert str(err.value) == f"{path} in 'model': d_model (30) must be divisible by n_heads (4)"
    with pytest.raises(UserError, match=r"\(with overrides\) in 'model': d_model \(64\) must be divisible"):
        load_config(RunCfg, {"data": {"src": "a"}}, ["model.n_heads=3"])


def test_dump_and_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(RunCfg, {"data": {"src": "x/y.gz", "extra": {"a": 0.5}}, "lr": 1e-10, "seeds": [3, 4]})
    as_dict = config_to_dict(cfg)
    assert as_dict["data"]["src"] == "x/y.gz" and as_dict["seeds"] == [3, 4]
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, out)
    assert load_config(RunCfg, out) == cfg
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left
