"""Plain YAML parsed into dataclasses, validated on load.

Unknown keys, wrongly typed values and numbers out of their declared range are errors that name
``file:line`` and the key (unknown keys also list the allowed ones with their defaults); every
problem in a file is reported at once. Each config class declares the range of every numeric
setting in ``RANGES`` (key -> ``">= 1"``, ``"> 0"``, ``"[0, 1)"``, ...; a list setting's range
holds for each element); ``tests/test_config_ranges.py`` fails for a numeric key without one.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hobson.errors import ConfigError
from hobson.io import sha256_file

T = TypeVar("T")


def _line_map(node: yaml.Node, prefix: tuple = ()) -> dict[tuple, int]:
    """``(key, subkey, ...) -> 1-based line`` for every mapping key in a composed YAML tree."""
    out: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = prefix + (k.value,)
            out[key] = k.start_mark.line + 1
            out.update(_line_map(v, key))
    return out


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return isinstance(value, tp)


@dataclasses.dataclass(frozen=True)
class Range:
    """A closed, open or half-open interval; either end may be missing (``">= 1"``, ``"> 0"``)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    @classmethod
    def parse(cls, spec: str) -> Range:
        spec = spec.strip()
        for op, kw in ((">=", {}), (">", {"lo_open": True}), ("<=", {}), ("<", {"hi_open": True})):
            if spec.startswith(op):
                bound = float(spec[len(op):])
                return cls(lo=bound, **kw) if op[0] == ">" else cls(hi=bound, **kw)
        if spec[:1] in "[(" and spec[-1:] in "])" and "," in spec:
            lo, hi = (float(x) for x in spec[1:-1].split(","))
            return cls(lo, hi, spec[0] == "(", spec[-1] == ")")
        raise ValueError(f"not a range: {spec!r} (use '>= a', '> a', '<= b', '< b' or '[a, b)' and the like)")

    def __contains__(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        return f"{'<' if self.hi_open else '<='} {_num(self.hi)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def ranges(cls: type) -> dict[str, Range]:
    """The declared ranges of ``cls``'s numeric settings."""
    return {k: Range.parse(v) for k, v in getattr(cls, "RANGES", {}).items()}


def _out_of_range(value: Any, rng: Range) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v not in rng for v in items)


def _build(cls: type[T], data: dict, path: str, lines: dict[tuple, int], prefix: tuple,
           errors: list[str]) -> T | None:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    declared = ranges(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}:{lines.get(prefix + (key,), '?')}"
        dotted = ".".join(prefix + (key,))
        if key not in fields:
            allowed = ", ".join(f"{n} (default {_default_repr(f)})" for n, f in fields.items())
            errors.append(f"{where}: unknown key '{dotted}'; allowed here: {allowed}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                errors.append(f"{where}: '{dotted}' must be a mapping, got {type(value).__name__}")
                continue
            kwargs[key] = _build(tp, value, path, lines, prefix + (key,), errors)
        elif not _type_ok(value, tp):
            errors.append(f"{where}: '{dotted}' must be {_type_name(tp)}, got {value!r}")
        elif key in declared and _out_of_range(value, declared[key]):
            errors.append(f"{where}: '{dotted}' must be {declared[key]}"
                          + (" (each element)" if isinstance(value, (list, tuple)) else "") + f", got {value!r}")
        else:
            kwargs[key] = float(value) if tp is float else value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, ConfigError) as e:
        errors.append(f"{path}: {'.'.join(prefix) or 'top level'}: {e}")
        return None


def _default_repr(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return "{...}" if dataclasses.is_dataclass(f.default_factory) else repr(f.default_factory())
    return "required"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def load_config(path: str | os.PathLike, cls: type[T]) -> T:
    """Parse ``path`` into ``cls``; raise one ConfigError listing every problem."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    errors: list[str] = []
    obj = _build(cls, data, path, _line_map(node) if node else {}, (), errors)
    if errors or obj is None:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return obj


def config_from_dict(data: dict, cls: type[T], origin: str = "<dict>") -> T:
    errors: list[str] = []
    obj = _build(cls, data, origin, {}, (), errors)
    if errors or obj is None:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return obj


def config_digest(path: str | os.PathLike) -> str:
    return sha256_file(path)
