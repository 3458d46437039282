"""One codec for every rule's state: dataclasses in, plain JSON out, and back by their types.

A rule keeps what it remembers (per rank, or per run for the rules that compare ranks) in a
dataclass. ``dump`` turns it into JSON-able values field by field, by name; ``load`` builds
it again from the field types, so no rule writes its own save and restore. Types it knows:
``int``, ``float``, ``str``, ``bool``, ``Optional[...]``, ``list``, ``tuple``, ``deque``,
``set``, ``dict`` (keys saved as strings, read back by their type), nested dataclasses,
and the rolling windows of stats.py.

A window's size is a setting (``window: int = 50``), not state: a field declared with
``window("window")`` names the setting, and ``new`` / ``load`` size the window from the
rule's current config, so a changed setting takes effect across a restart. A field declared
with ``transient(...)`` is not saved (bookkeeping that is rebuilt); a dataclass with an
``on_load`` method gets it called once its saved fields are back.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections import deque
from functools import lru_cache
from typing import Any, Union

from ..stats import RollingMedian, TwoHalves

WINDOWS = (RollingMedian, TwoHalves)  # built as ``cls(size, values)``, saved as ``.dump()``
_SIZE = "size"  # field metadata: the setting that sizes the window(s) of the field
_SAVED = "saved"  # field metadata: False for a transient field


def window(size_setting: str) -> Any:
    """A field holding a window, or a dict of windows, sized by ``size_setting``."""
    return dataclasses.field(default=None, metadata={_SIZE: size_setting})


def windows(size_setting: str) -> Any:
    """A dict of windows (one per measure or eval set), each sized by ``size_setting``."""
    return dataclasses.field(default_factory=dict, metadata={_SIZE: size_setting})


def transient(**kw) -> Any:
    """A field that is not saved: it starts from its default again after a restore."""
    return dataclasses.field(metadata={_SAVED: False}, **kw)


@lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


@lru_cache(maxsize=None)
def _sized_windows(cls: type) -> tuple[tuple[str, type, str], ...]:
    """(field, window type, size setting) of each window field of ``cls``."""
    return tuple((f.name, _window_type(tp), f.metadata[_SIZE]) for f, tp in _fields(cls)
                 if _SIZE in f.metadata and _window_type(tp) is not None)


def new(cls: type, cfg) -> Any:
    """A fresh state, its windows sized by ``cfg``. (Once per rule and rank: 16,384 ranks
    make some 200,000 at their first step, or again when a resumed run starts over, so
    the fields' types are looked at once per class, not per state.)"""
    sized = _sized_windows(cls)
    if not sized:
        return cls()
    return cls(**{name: window_type(getattr(cfg, setting)) for name, window_type, setting in sized})


def dump(state: Any) -> Any:
    """``state`` as JSON-able values."""
    if dataclasses.is_dataclass(state):
        return {f.name: dump(getattr(state, f.name)) for f, _ in _fields(type(state))
                if f.metadata.get(_SAVED, True)}
    if isinstance(state, WINDOWS):
        return state.dump()
    if isinstance(state, dict):
        return {str(k): dump(v) for k, v in state.items()}
    if isinstance(state, set):
        return sorted(dump(v) for v in state)
    if isinstance(state, (list, tuple, deque)):
        return [dump(v) for v in state]
    return state


def load(cls: type, data: Any, cfg) -> Any:
    """The state ``dump`` saved, as a ``cls`` again; fields it lacks get their defaults."""
    kwargs = {}
    for f, tp in _fields(cls):
        if not f.metadata.get(_SAVED, True) or f.name not in data:
            if _SIZE in f.metadata and _window_type(tp) is not None:
                kwargs[f.name] = _window_type(tp)(getattr(cfg, f.metadata[_SIZE]))
            continue
        size = getattr(cfg, f.metadata[_SIZE]) if _SIZE in f.metadata else None
        kwargs[f.name] = _decode(tp, data[f.name], size, cfg)
    state = cls(**kwargs)
    on_load = getattr(state, "on_load", None)
    if on_load is not None:
        on_load()
    return state


def _window_type(tp) -> type | None:
    tp = _strip_optional(tp)
    return tp if isinstance(tp, type) and issubclass(tp, WINDOWS) else None


def _strip_optional(tp):
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _decode(tp, data: Any, size: int | None, cfg) -> Any:
    if data is None:
        return None
    tp = _strip_optional(tp)
    if tp is Any:
        return data
    if isinstance(tp, type) and issubclass(tp, WINDOWS):
        return tp(size, data)
    if dataclasses.is_dataclass(tp):
        return load(tp, data, cfg)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict:
        key, value = args
        return {key(k): _decode(value, v, size, cfg) for k, v in data.items()}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, size, cfg) for v in data)
        return tuple(_decode(a, v, size, cfg) for a, v in zip(args, data))
    if origin in (list, deque, set):
        (item,) = args
        return origin(_decode(item, v, size, cfg) for v in data)
    return data
