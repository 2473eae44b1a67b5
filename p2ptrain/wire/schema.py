"""Frozen message dataclasses validated from untrusted msgpack.

Theory of operation: every message that crosses the wire is a frozen dataclass subclassing
:class:`Message`. It encodes to a msgpack map of its fields, or, for a class declared
``positional=True``, to an array of its fields in declaration order with the trailing ones that hold
their defaults left out: the messages sent most often (frame headers, DHT requests and entries,
progress records) would otherwise spend a fifth of their bytes on field names. Decoding a positional
class accepts either form (a peer of an older version sends maps), and checks each field's type against
the annotation (``int``, ``float``, ``str``, ``bytes``, ``bool``, ``X | None``, ``tuple[X, ...]``,
nested messages) and its bounds (``bounded(max_len=...)`` or ``bounded(ge=..., le=...)``), so a handler
never sees a value of the wrong type or size. Unknown fields, and array items past the last known
field, are ignored (newer peers may add optional fields, at the end of a positional class); missing
fields without defaults are errors. Floats must be finite unless a field allows otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Self, TypeVar

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
    """Base class of wire messages. Subclasses are ``@dataclass(frozen=True)``; ``class X(Message,
    positional=True)`` encodes as an array (see the module's docstring). New fields of a positional
    class go at its end, with defaults."""

    _positional = False  # (not annotated: not a dataclass field)

    def __init_subclass__(cls, *, positional: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._positional = positional

    def to_obj(self) -> Any:
        """A map of the fields, or for a positional class their values in order (trailing defaults
        left out)."""
        names = _names_of(type(self))
        if not self._positional:
            return {name: _encode_value(getattr(self, name)) for name in names}
        values = [getattr(self, name) for name in names]
        defaults = _defaults_of(type(self))
        n = len(values)
        while n and values[n - 1] == defaults[n - 1]:
            n -= 1
        return [_encode_value(v) for v in values[:n]]

    @classmethod
    def from_obj(cls, obj: Any) -> Self:
        return decode_message(cls, obj)


def _encode_value(v: Any) -> Any:
    if isinstance(v, Message):
        return v.to_obj()
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    return v


Validator = Callable[[Any, str], Any]
_compiled: dict[type, list[tuple[str, bool, Validator, str, str]]] = {}
_NO_DEFAULT = object()
_default_values: dict[type, list[Any]] = {}


_field_names: dict[type, tuple[str, ...]] = {}


def _names_of(cls: type) -> tuple[str, ...]:
    """Per class, once: its fields' names in order (``dataclasses.fields`` builds them at every call)."""
    out = _field_names.get(cls)
    if out is None:
        out = _field_names[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return out


def _defaults_of(cls: type) -> list[Any]:
    """Per class, once: each field's default (a value no field holds where it has none)."""
    out = _default_values.get(cls)
    if out is None:
        out = _default_values[cls] = [
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else _NO_DEFAULT
            for f in dataclasses.fields(cls)
        ]
    return out


def _fields_of(cls: type) -> list[tuple[str, bool, Validator, str, str]]:
    """Per class, once: (name, required, validator, path, path within a parent) for each field."""
    fields = _compiled.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = [
            (
                f.name,
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                _validator(hints[f.name], f.metadata, f"{cls.__name__}.{f.name}"),
                f"{cls.__name__}.{f.name}",
                f".{f.name}",
            )
            for f in dataclasses.fields(cls)
        ]
        _compiled[cls] = fields
    return fields


def decode_message(cls: type[M], obj: Any, _path: str = "") -> M:
    """Validate ``obj`` (decoded msgpack) into an instance of ``cls``; RemoteProtocolError if invalid."""
    kwargs: dict[str, Any] = {}
    if isinstance(obj, list) and cls._positional:  # the fields in order (see Message)
        n = len(obj)
        for i, (name, required, check, path, inner) in enumerate(_fields_of(cls)):
            if i < n:
                kwargs[name] = check(obj[i], _path + inner if _path else path)
            elif required:
                raise RemoteProtocolError(f"{_path or cls.__name__}: missing field {name!r}")
    elif isinstance(obj, dict):
        for name, required, check, path, inner in _fields_of(cls):
            if name in obj:
                kwargs[name] = check(obj[name], _path + inner if _path else path)
            elif required:
                raise RemoteProtocolError(f"{_path or cls.__name__}: missing field {name!r}")
    else:
        form = "an array or a map" if cls._positional else "a map"
        raise RemoteProtocolError(f"{_path or cls.__name__}: expected {form}, got {type(obj).__name__}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise RemoteProtocolError(f"{_path or cls.__name__}: {e}") from None


def _validator(tp: Any, meta: Any, where: str) -> Validator:
    """Build the check for one annotated type (unsupported types fail here, at import of the schema)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or type(None) not in args:
            raise TypeError(f"unsupported union in schema at {where}")
        check_inner = _validator(inner[0], meta, where)
        return lambda v, w: None if v is None else check_inner(v, w)
    if origin is tuple:
        check_item = _validator(typing.get_args(tp)[0], {}, where)
        limit = _limit(meta, DEFAULT_MAX_ITEMS)

        def check_tuple(v: Any, w: str) -> Any:
            if not isinstance(v, list):
                raise RemoteProtocolError(f"{w}: expected a list")
            if len(v) > limit:
                raise RemoteProtocolError(f"{w}: length {len(v)} exceeds {limit}")
            try:
                return tuple([check_item(x, w) for x in v])
            except RemoteProtocolError:  # (the item's index in the error: built only when one fails)
                return tuple(check_item(x, f"{w}[{i}]") for i, x in enumerate(v))

        return check_tuple
    if isinstance(tp, type) and issubclass(tp, Message):
        return lambda v, w: decode_message(tp, v, w)
    if tp is bool:
        return _typed(bool, "a bool", meta)
    if tp is int:
        return _number(int, "an integer", meta)
    if tp is float:
        return _number(float, "a number", meta)
    if tp is str:
        return _sized(str, "a string", _limit(meta, DEFAULT_MAX_STR))
    if tp is bytes:
        return _sized(bytes, "bytes", _limit(meta, DEFAULT_MAX_BYTES))
    raise TypeError(f"unsupported type {tp!r} in schema at {where}")


def _limit(meta: Any, default: int) -> int:
    limit = meta.get("max_len") if meta else None
    return default if limit is None else int(limit)


def _typed(tp: Any, name: str, meta: Any) -> Validator:
    def check(v: Any, w: str) -> Any:
        if type(v) is not tp:
            raise RemoteProtocolError(f"{w}: expected {name}")
        return v

    return check


def _sized(tp: Any, name: str, limit: int) -> Validator:
    def check(v: Any, w: str) -> Any:
        if type(v) is not tp:
            raise RemoteProtocolError(f"{w}: expected {name}")
        if len(v) > limit:
            raise RemoteProtocolError(f"{w}: length {len(v)} exceeds {limit}")
        return v

    return check


def _number(tp: type, name: str, meta: Any) -> Validator:
    ge = meta.get("ge") if meta else None
    le = meta.get("le") if meta else None
    accepted = (int,) if tp is int else (int, float)

    def check(v: Any, w: str) -> Any:
        if isinstance(v, bool) or not isinstance(v, accepted):
            raise RemoteProtocolError(f"{w}: expected {name}")
        if tp is float and not math.isfinite(v):
            raise RemoteProtocolError(f"{w}: must be finite")
        if ge is not None and v < ge:
            raise RemoteProtocolError(f"{w}: {v} is below {ge}")
        if le is not None and v > le:
            raise RemoteProtocolError(f"{w}: {v} is above {le}")
        return float(v) if tp is float else v

    return check
