"""Typed configs from YAML plus `key.sub=value` overrides (cleanrl's `Args`, verifiers' configs).

Each entry point owns one small dataclass; every field has a docstring (the string right after it),
which `describe` prints as `--help`. Unknown keys are errors that name the closest valid key, and
values are checked against the field types, so a typo fails at start, never hours into a run.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
RECIPES = Path(__file__).with_name("recipes")  # the recipes ship in the package (`recipes/` in a clone links here)


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line naming what is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, even when a key or a value holds a newline


def recipe_path(path: str) -> str:
    """`path` itself when it exists; else the bundled recipe it names (`recipes/demo.yaml` or `demo.yaml`), so
    the README's commands work from any directory once agent-r1 is installed."""
    name = Path(path).name
    if Path(path).exists() or Path(path).parent.name not in ("", "recipes") or not (RECIPES / name).is_file():
        return path
    return str(RECIPES / name)


def load_config(cls: type[T], path: str | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from an optional YAML file (or bundled recipe), then `key.sub=value` overrides (YAML-parsed
    values)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = recipe_path(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        raw = _parse_yaml(text, f"config file {path}") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            if isinstance(node.get(part), str):  # a named section: `task=gsm8k` then `task.data=...`
                node[part] = {"name": node[part]}
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        parsed = _parse_yaml(value, f"override {_clip(item)!r}") if value else ""
        if isinstance(node.get(leaf), dict) and isinstance(parsed, str):  # `task.ops=[1]` then `task=calculator`
            if node[leaf].get("name", parsed) != parsed:  # another task: the earlier options were the old one's
                node[leaf] = {}
            node[leaf]["name"] = parsed
        else:
            node[leaf] = parsed
    return _build(cls, raw, prefix="")


def _parse_yaml(text: str, what: str) -> Any:
    """`text` as YAML, or a one-line ConfigError saying what (a file, an override) is not valid YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = (str(exc).splitlines() or [type(exc).__name__])[0]
    except ValueError as exc:  # an int of more than 4300 digits, which Python will not convert
        problem = str(exc).split(":")[0]
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        problem = "nested too deeply"
    raise ConfigError(f"{what} is not valid YAML: {problem}")


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."


def build(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    """`cls` from a plain dict (nested sections as dicts), with every check `load_config` makes."""
    return _build(cls, raw, prefix)


def _build(cls: type[T], raw: dict[str, Any], prefix: str) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = _in_a_section(key, fields, raw) or difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        if hasattr(hints[key], "from_raw"):  # a section whose fields depend on its name (TaskSpec)
            try:
                kwargs[key] = hints[key].from_raw(value, f"{prefix}{key}", _default(fields[key]))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def _in_a_section(key: str, fields: dict[str, dataclasses.Field], raw: dict[str, Any]) -> list[str]:
    """`section.key` when `key` is a field of one of the sections (e.g. `data` -> `task.data`); a task's
    section has the options of the task `raw` names (`task=hotpotqa retriever=dense` -> `task.retriever`)."""
    for name, f in fields.items():
        default = _default(f)
        named = raw.get(name)
        named = named.get("name") if isinstance(named, dict) else named
        if hasattr(default, "from_raw") and isinstance(named, str):
            with contextlib.suppress(ValueError):  # an unknown task is reported on its own
                default = type(default)(named)
        section = getattr(default, "options", default)  # a task's options, or a plain section
        if dataclasses.is_dataclass(section) and key in {g.name for g in dataclasses.fields(section)}:
            return [f"{name}.{key}"]
    return []


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check (and gently convert: int -> float, list -> tuple) a value against a field type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{key}' must be {_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; set its fields like {key}.field=value")
        return _build(tp, value, prefix=f"{key}.")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; set its fields like {key}.field=value")
        return dict(value)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            value = [value]
        inner = args[0] if args else Any
        items = [_coerce(inner, v, key) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"config key '{key}' must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"config key '{key}' must be float, got an int too large for one") from None
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "2e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"config key '{key}' must be {_name(tp)}, got {value!r}")
    return value


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def describe(cls: type, prefix: str = "") -> str:
    """`key = default  # docstring` lines for every field (nested sections flattened)."""
    docs = _field_docs(cls)
    lines = []
    for f in dataclasses.fields(cls):
        default = _default(f)
        if hasattr(default, "to_raw"):  # a task: its name, then its own options
            lines.append(f"  {prefix}{f.name} = {default.name!r}  # {docs.get(f.name, '')}")
            lines.append(describe(type(default.options), prefix=f"{prefix}{f.name}."))
            lines.append(describe(type(default.context), prefix=f"{prefix}{f.name}.context."))
            continue
        if dataclasses.is_dataclass(default):
            lines.append(describe(type(default), prefix=f"{prefix}{f.name}."))
            continue
        lines.append(f"  {prefix}{f.name} = {default!r}  # {docs.get(f.name, '')}")
    return "\n".join(lines)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after each field in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in itertools.pairwise(body):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if is_field and is_doc and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def to_dict(config: Any) -> dict[str, Any]:
    """Plain dict of a config, for saving the resolved config next to a run (`load_config` reads it back)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if hasattr(value, "to_raw"):
            value = value.to_raw()
        elif dataclasses.is_dataclass(value):
            value = to_dict(value)
        else:
            value = copy.deepcopy(value)
        out[f.name] = value
    return out
