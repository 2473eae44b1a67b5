"""Frozen message dataclasses validated from untrusted msgpack.

Theory of operation: every message that crosses the wire is a frozen dataclass subclassing
:class:`Message`. It encodes to a msgpack map of its fields; decoding checks each field's type against
the annotation (``int``, ``float``, ``str``, ``bytes``, ``bool``, ``X | None``, ``tuple[X, ...]``,
nested messages) and its bounds (``bounded(max_len=...)`` or ``bounded(ge=..., le=...)``), so a handler
never sees a value of the wrong type or size. Unknown fields are ignored (newer peers may add optional
fields); missing fields without defaults are errors. Floats must be finite unless a field allows
otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, ClassVar, Self, TypeVar

from ..errors import RemoteProtocolError

DEFAULT_MAX_STR = 1024
DEFAULT_MAX_BYTES = 64 * 1024
DEFAULT_MAX_ITEMS = 1024

M = TypeVar("M", bound="Message")


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    max_len: int | None = None,
    ge: float | None = None,
    le: float | None = None,
) -> Any:
    """A dataclass field with bounds checked on decode (lengths of str/bytes/tuple, numeric range)."""
    meta = {"max_len": max_len, "ge": ge, "le": le}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Message:
    """Base class of wire messages. Subclasses are ``@dataclass(frozen=True)``."""

    _hints: ClassVar[dict[type, dict[str, Any]]] = {}

    def to_obj(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out[f.name] = _encode_value(getattr(self, f.name))
        return out

    @classmethod
    def from_obj(cls, obj: Any) -> Self:
        return decode_message(cls, obj)


def _encode_value(v: Any) -> Any:
    if isinstance(v, Message):
        return v.to_obj()
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    return v


def _hints_of(cls: type) -> dict[str, Any]:
    cache = Message._hints
    if cls not in cache:
        cache[cls] = typing.get_type_hints(cls)
    return cache[cls]


def decode_message(cls: type[M], obj: Any, _path: str = "") -> M:
    """Validate ``obj`` (decoded msgpack) into an instance of ``cls``; RemoteProtocolError if invalid."""
    where = _path or cls.__name__
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"{where}: expected a map, got {type(obj).__name__}")
    hints = _hints_of(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RemoteProtocolError(f"{where}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _check(hints[f.name], obj[f.name], f.metadata, f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise RemoteProtocolError(f"{where}: {e}") from None


def _check(tp: Any, v: Any, meta: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union in schema at {where}")
        return _check(inner[0], v, meta, where)
    if origin is tuple:
        item_tp = typing.get_args(tp)[0]
        if not isinstance(v, list):
            raise RemoteProtocolError(f"{where}: expected a list")
        _check_len(v, meta, DEFAULT_MAX_ITEMS, where)
        return tuple(_check(item_tp, x, {}, f"{where}[{i}]") for i, x in enumerate(v))
    if isinstance(tp, type) and issubclass(tp, Message):
        return decode_message(tp, v, where)
    if tp is bool:
        if not isinstance(v, bool):
            raise RemoteProtocolError(f"{where}: expected a bool")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise RemoteProtocolError(f"{where}: expected an integer")
        _check_range(v, meta, where)
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RemoteProtocolError(f"{where}: expected a number")
        if not math.isfinite(v):
            raise RemoteProtocolError(f"{where}: must be finite")
        _check_range(v, meta, where)
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise RemoteProtocolError(f"{where}: expected a string")
        _check_len(v, meta, DEFAULT_MAX_STR, where)
        return v
    if tp is bytes:
        if not isinstance(v, bytes):
            raise RemoteProtocolError(f"{where}: expected bytes")
        _check_len(v, meta, DEFAULT_MAX_BYTES, where)
        return v
    raise TypeError(f"unsupported type {tp!r} in schema at {where}")


def _check_len(v: Any, meta: Any, default: int, where: str) -> None:
    limit = meta.get("max_len") if meta else None
    limit = default if limit is None else limit
    if len(v) > limit:
        raise RemoteProtocolError(f"{where}: length {len(v)} exceeds {limit}")


def _check_range(v: float, meta: Any, where: str) -> None:
    if not meta:
        return
    ge, le = meta.get("ge"), meta.get("le")
    if ge is not None and v < ge:
        raise RemoteProtocolError(f"{where}: {v} is below {ge}")
    if le is not None and v > le:
        raise RemoteProtocolError(f"{where}: {v} is above {le}")
