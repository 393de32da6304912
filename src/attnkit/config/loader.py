"""Typed configuration: nested dataclasses loaded from commented YAML, checked key by key.

The concrete config classes live next to the code they configure; this module is the
generic machinery. A config file mirrors the dataclass tree::

    model:
      d_model: 512    # comments are welcome
    train:
      lr: 3.0e-4

``load_config(ExperimentConfig, "run.yaml", ["train.lr=1e-3"])`` checks every key against
the field types (unknown keys get a "did you mean"), fills in defaults, then calls each
dataclass's optional ``validate()`` for cross-field checks. Every problem is a one-line
:class:`UserError` naming the source (file path, ``override`` or ``<config>``) and the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from ..common.errors import UserError
from ..common.files import atomic_write_text

T = TypeVar("T")

# PyYAML follows YAML 1.1, which reads `1e-4` (no dot) as a string; accept it for floats.
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key written twice in one mapping (a silent overwrite otherwise)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader's own error for unhashable keys is clear enough
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}'; keep only one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` semantics; a syntax error becomes ``source:line: problem``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{where}: invalid YAML: {problem}") from None


def load_config(cls: type[T], source: str | Path | dict, overrides: Sequence[str] = ()) -> T:
    """Build dataclass ``cls`` from a YAML file (or a dict), then apply ``dotted.key=value`` overrides.

    Override values are parsed as YAML (``train.bf16=false``, ``x.sizes=[1,2]``) and checked
    against the field type before they are applied.
    """
    if isinstance(source, dict):
        name, data = "<config>", copy.deepcopy(source)  # overrides must not touch the caller's dict
    else:
        name = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as err:
            raise UserError(f"{name}: cannot read config file ({err.strerror}); check the path") from None
        data = _parse_yaml(text, name)
        data = {} if data is None else data
    if not isinstance(data, dict):
        raise UserError(f"{name}: the top level must be a mapping of keys (e.g. 'model:'), got {type(data).__name__}")
    for override in overrides:
        _apply_override(cls, data, override)
    config = _convert(cls, data, "", name)
    _validate_tree(config, "", name + (" (with overrides)" if overrides else ""))
    return config


def _apply_override(cls: type, data: dict, override: str) -> None:
    """Check ``key=value`` against the schema of ``cls`` and set it in the raw ``data`` tree."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"override '{override}': expected dotted.key=value, e.g. model.d_model=256")
    value = _parse_yaml(text, f"override '{override}'")
    parts = key.split(".")
    tp: Any = cls
    for depth, part in enumerate(parts):
        tp = _child_type(tp, part, ".".join(parts[:depth]), "override")
    _convert(tp, value, key, "override")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _child_type(tp: Any, part: str, prefix: str, source: str) -> Any:
    """The type of key ``part`` inside ``tp`` (a dataclass or ``dict[str, X]``, optionally ``| None``)."""
    tp = _strip_none(tp)
    if tp is Any:
        return Any
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp) if f.init]
        if part not in names:
            _unknown_key(part, prefix, names, source)
        return hints[part]
    if typing.get_origin(tp) is dict:
        return typing.get_args(tp)[1] if typing.get_args(tp) else Any
    raise UserError(f"{source}: key '{prefix}' is {_describe(tp)}, so '{prefix}.{part}' does not exist")


def _unknown_key(key: str, prefix: str, names: list[str], source: str) -> typing.NoReturn:
    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
    raise UserError(f"{source}: unknown key '{full}'{hint}")


def _strip_none(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    """A type in words, for error messages: ``a float``, ``a list of integers``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list" + (f" of {_describe(args[0])}" if origin is list and args else "")
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    words = {
        bool: "a boolean (true/false)",
        int: "an integer",
        float: "a float",
        str: "a string",
        Path: "a path (string)",
    }
    return words.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any, key: str, source: str) -> Any:
    """Check ``value`` against type ``tp`` and return it converted (``Path``, ``tuple``, dataclass)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def wrong() -> UserError:
        return UserError(f"{source}: key '{key}' must be {_describe(tp)}, got {value!r}")

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: let X give the precise message
            return _convert(options[0], value, key, source)
        for option in options:
            try:
                return _convert(option, value, key, source)
            except UserError:
                continue
        raise wrong()
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise wrong()
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise wrong()
        return _build(tp, value, key, source)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            return float(value)
        raise wrong()
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong()
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise wrong()
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise wrong()
        item = args[0] if args else Any
        return [_convert(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise wrong()
        if len(args) == 2 and args[1] is Ellipsis:
            items = [args[0]] * len(value)
        elif args:
            if len(args) != len(value):
                raise UserError(f"{source}: key '{key}' must be a list of {len(args)} items, got {value!r}")
            items = list(args)
        else:
            items = [Any] * len(value)
        return tuple(_convert(t, v, f"{key}[{i}]", source) for i, (t, v) in enumerate(zip(items, value, strict=True)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise wrong()
        item = args[1] if args else Any
        return {k: _convert(item, v, f"{key}.{k}" if key else k, source) for k, v in value.items()}
    raise TypeError(f"config field '{key}' has type {tp!r}, which attnkit.config does not support")


def _build(cls: type, data: dict, prefix: str, source: str) -> Any:
    """Construct dataclass ``cls`` from mapping ``data`` (unknown keys rejected, defaults filled in)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            _unknown_key(str(key), prefix, names, source)
    kwargs = {}
    for field in fields:
        full = f"{prefix}.{field.name}" if prefix else field.name
        if field.name in data:
            kwargs[field.name] = _convert(hints[field.name], data[field.name], full, source)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise UserError(f"{source}: missing required key '{full}'; add it to the config")
    return cls(**kwargs)


def _validate_tree(config: Any, prefix: str, source: str) -> None:
    """Call ``validate()`` on every dataclass in the tree, innermost first; prefix errors with the source."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _validate_tree(value, f"{prefix}.{field.name}" if prefix else field.name, source)
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except (UserError, ValueError) as err:  # model configs raise ValueError: they know nothing of the CLI
            where = f" in '{prefix}'" if prefix else ""
            raise UserError(f"{source}{where}: {err}") from None


def config_to_dict(config: Any) -> Any:
    """A dataclass tree as plain YAML-ready values (``Path`` -> ``str``, tuples -> lists)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}
    if isinstance(config, Path):
        return str(config)
    if isinstance(config, (list, tuple)):
        return [config_to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: config_to_dict(v) for k, v in config.items()}
    return config


class _BlockDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` writing a string of several lines (a chat template) as a ``|`` block, readable as it is
    (PyYAML falls back to quotes for one a block cannot hold, such as one with trailing spaces)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_BlockDumper.add_representer(str, _represent_str)


def dump_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically); :func:`load_config` reads it back equal."""
    text = yaml.dump(config_to_dict(config), Dumper=_BlockDumper, sort_keys=False, allow_unicode=True)
    atomic_write_text(path, text)
