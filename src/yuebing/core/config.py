"""Config helpers shared by every component.

Each component keeps a frozen dataclass config beside itself. Fields carry their help text in
``field(metadata={"help": ...})``; `add_config_args` turns a config class into argparse flags
and `config_from_args` builds the instance back, so the CLI is generated from the configs.
Validation lives in each config's ``__post_init__`` and raises `ConfigError` via `require`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from yuebing.core.errors import ConfigError

C = TypeVar("C")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"4GiB"`` → 4294967296, ``"64KiB"`` → 65536, ``"1e6"`` → 1000000, ``"512"`` → 512."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot parse size {text!r}; use e.g. 512, 64KiB, 4MiB, 2GiB, 1e6")
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value):
        raise ConfigError(f"size {text!r} is too large")
    if value != int(value):
        raise ConfigError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_size_list(text: str) -> list[int]:
    """``"1MiB,4MiB"`` → [1048576, 4194304]."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"empty size list {text!r}")
    return [parse_size(t) for t in items]


def format_size(n: float) -> str:
    """Human-readable binary size: 1048576 → ``"1MiB"``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


def require(condition: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless ``condition``; use in ``__post_init__``."""
    if not condition:
        raise ConfigError(message)


def _flag(prefix: str, name: str) -> str:
    return "--" + (prefix + name).replace("_", "-")


def _base_type(tp: Any) -> Any:
    """Strip ``X | None`` to ``X``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def add_config_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
                    only: Collection[str] | None = None, defaults: Any = None) -> None:
    """Add one ``--flag`` per field of dataclass ``cls`` (bools become ``--x/--no-x``), or per
    field named in ``only`` (a command that uses a few of them offers no flags it ignores).

    A nested dataclass field is skipped (compose it with its own prefix) unless its metadata
    names ``"flags"``: those fields of it (``only`` may name them) become flags of this
    command, with the nested default's values (``defaults``) as theirs. Defaults are left
    as ``None`` so `config_from_args` only overrides what the user typed. A field whose
    metadata says ``"secret": True`` (the cluster token) never shows its default in the help.
    """
    hints = typing.get_type_hints(cls)
    names = set(config_flags(cls))
    if only is not None and not set(only) <= names:
        raise ValueError(f"{cls.__name__} has no fields {sorted(set(only) - names)}")
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        default = _default(f)
        if f.init and dataclasses.is_dataclass(tp) and "flags" in f.metadata:
            # a composed config whose named fields are flags here
            nested = [n for n in f.metadata["flags"] if only is None or n in only]
            add_config_args(parser, typing.cast(type, tp), prefix, only=nested,
                            defaults=default)
            continue
        if not f.init or (only is not None and f.name not in only) or \
                dataclasses.is_dataclass(tp):
            continue
        if defaults is not None:
            default = getattr(defaults, f.name)
        help_text = f.metadata.get('help', '')
        if callable(help_text):  # computed when the flags are built
            help_text = help_text()
        if not f.metadata.get("secret"):  # a secret's default (from the environment) stays unseen
            help_text += f" (default: {default})"
        flag = _flag(prefix, f.name)
        dest = prefix + f.name
        if tp is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif tp in (int, float, str):
            conv: Any = parse_size if (tp is int and f.metadata.get("size")) else tp
            parser.add_argument(flag, dest=dest, type=conv, default=None, help=help_text)
        elif typing.get_origin(tp) is tuple:
            (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis} or {str}
            parser.add_argument(flag, dest=dest, default=None, help=help_text + " comma-separated",
                                type=_tuple_of(item))
        else:
            parser.add_argument(flag, dest=dest, type=str, default=None, help=help_text)


def config_flags(cls: type) -> tuple[str, ...]:
    """The names of the flags `add_config_args` can make for ``cls``: its init fields that are
    not configs, and the ``"flags"`` named by its composed ones."""
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(_base_type(hints[f.name])):
            out += f.metadata.get("flags", ())
        else:
            out.append(f.name)
    return tuple(out)


def _tuple_of(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """An argparse ``type=`` converter for a comma-separated tuple of ``item`` values."""
    def convert(text: str) -> tuple[Any, ...]:
        return tuple(item(x) for x in text.split(",") if x)
    convert.__name__ = getattr(item, "__name__", "value") + " list"
    return convert


def config_from_args(cls: type[C], ns: argparse.Namespace, prefix: str = "", **base: Any) -> C:
    """Build ``cls`` from parsed flags: ``base`` values, overridden by flags the user gave."""
    values = dict(base)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "flags" in f.metadata:
            nested = values.get(f.name, _default(f))
            given = {n: getattr(ns, prefix + n) for n in f.metadata["flags"]
                     if getattr(ns, prefix + n, None) is not None}
            if given:
                values[f.name] = config_from_args(type(nested), ns, prefix,
                                                  **{**_values(nested), **given})
            continue
        v = getattr(ns, prefix + f.name, None)
        if v is not None:
            values[f.name] = v
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}: {e}") from None


def _values(cfg: Any) -> dict[str, Any]:
    """A config's init fields by name (nested configs kept as objects)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def config_args(cfg: Any, prefix: str = "", skip: Collection[str] = ()) -> tuple[str, ...]:
    """The flags that rebuild ``cfg`` through `add_config_args` + `config_from_args`: one per
    field whose value differs from its default (fields in ``skip`` and secrets left out; a
    composed config's flagged fields included). The supervisor starts its children with these."""
    out: list[str] = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, default = getattr(cfg, f.name), _default(f)
        if not f.init or f.name in skip or f.metadata.get("secret") or value == default:
            continue
        if dataclasses.is_dataclass(value):
            if "flags" in f.metadata:
                out += [a for n in f.metadata["flags"] if n not in skip and
                        getattr(value, n) != getattr(default, n)
                        for a in _flag_value(_flag(prefix, n), getattr(value, n))]
            continue
        if dataclasses.is_dataclass(_base_type(hints[f.name])):
            continue
        out += _flag_value(_flag(prefix, f.name), value)
    return tuple(out)


def _flag_value(flag: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, tuple | list):
        return [flag, ",".join(map(str, value))]
    return [flag, str(value)]


def replace(cfg: C, **changes: Any) -> C:
    """`dataclasses.replace` that re-runs validation (frozen configs validate in __post_init__)."""
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
