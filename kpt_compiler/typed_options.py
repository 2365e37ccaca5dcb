"""Frozen dataclasses built from a user's dict: the checking every options class here goes through.

``build_options(cls, given, where)`` checks each key against the dataclass's fields and each value against its
type hint (the simple types options use: bool, int, float, str, Literal, unions, lists, dicts), so that a typo
or a wrong type fails with an ``OptionError`` naming the key, what was given and what is allowed; the class's
``__post_init__`` adds what types cannot say. ``options_to_dict`` is its inverse. A leaf: it imports only
``errors``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Mapping

from .errors import OptionError

__all__ = ["build_options", "options_to_dict", "unknown_key_error", "describe_type", "coerce"]


def _closest(key: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""


def unknown_key_error(key: str, valid: list[str], where: str) -> OptionError:
    return OptionError(
        f"unknown option {key!r} in {where}{_closest(key, valid)} Valid options: {', '.join(sorted(valid))}."
    )


def describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin in (tuple, list):
        args = typing.get_args(tp)
        return f"a list of {describe_type(args[0])}" if args else "a list"
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return "a dict"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, value converted to the field's type) for the simple types options use."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if origin in (tuple, list):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            return False, value
        (arg, *_rest) = typing.get_args(tp) or (Any,)
        out = []
        for item in value:
            ok, v = coerce(item, arg)
            if not ok:
                return False, value
            out.append(v)
        return True, tuple(out)
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return isinstance(value, Mapping), types.MappingProxyType(dict(value)) if isinstance(value, Mapping) else value
    return isinstance(value, tp), value


def build_options(cls: type, given: Mapping[str, Any] | None, where: str) -> Any:
    """Build the frozen dataclass ``cls`` from a user's dict, with errors that name the key (see module doc)."""
    given = dict(given or {})
    if not isinstance(given, dict):
        raise OptionError(f"{where} must be a dict, got {type(given).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in given.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name not in fields:
            raise unknown_key_error(str(key), list(fields), where)
        ok, converted = coerce(value, hints[name])
        if not ok:
            raise OptionError(
                f"option {key!r} in {where} must be {describe_type(hints[name])}; got {value!r}"
                f" ({type(value).__name__})"
            )
        kwargs[name] = converted
    try:
        return cls(**kwargs)
    except OptionError:
        raise
    except (TypeError, ValueError) as e:
        raise OptionError(f"{where}: {e}") from e


def options_to_dict(obj: Any) -> dict[str, Any]:
    """The inverse of build_options: a plain dict that builds the same object again."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = options_to_dict(v)
        elif isinstance(v, Mapping):
            v = {k: options_to_dict(x) if dataclasses.is_dataclass(x) else x for k, x in v.items()}
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out
