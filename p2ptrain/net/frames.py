"""The frame headers of the RPC protocol on a channel: calls, replies, stream data and credit, keepalive.

Theory of operation: frames on an encrypted channel are records whose header is one of the small
messages below (an array: its kind, then its fields in order) and whose body is raw bytes. Call ids are
chosen by the caller: odd for the side that dialed the connection, even for the side that accepted it,
so both can call at once without collisions. Streaming calls move bulk data as ``Data`` records of at
most ``MAX_CHUNK`` bytes each, paced by ``Credit`` (see ``streams``). These are the wire's words only:
what a connection does with them is ``connection``'s, which methods a node serves is ``rpc``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import RemoteProtocolError
from ..wire.codec import MAX_HEADER_BYTES, pack, unpack
from ..wire.schema import Message, bounded

Req = TypeVar("Req", bound=Message)

MAX_METHOD_NAME = 64
MAX_CALL_ID = 2**62


@dataclass(frozen=True)
class Request(Message, positional=True):
    id: int = bounded(ge=1, le=MAX_CALL_ID)
    method: str = bounded(max_len=MAX_METHOD_NAME)
    timeout: float = bounded(ge=0.0, le=7 * 86400.0)
    streaming: bool = False
    args: bytes = bounded(b"", max_len=MAX_HEADER_BYTES - 512)


@dataclass(frozen=True)
class Response(Message, positional=True):
    id: int = bounded(ge=1, le=MAX_CALL_ID)
    result: bytes = bounded(b"", max_len=MAX_HEADER_BYTES - 512)


@dataclass(frozen=True)
class Error(Message, positional=True):
    id: int = bounded(ge=1, le=MAX_CALL_ID)
    code: str = bounded(max_len=32)
    message: str = bounded(max_len=2048)


@dataclass(frozen=True)
class Cancel(Message, positional=True):
    id: int = bounded(ge=1, le=MAX_CALL_ID)


@dataclass(frozen=True)
class Data(Message, positional=True):
    id: int = bounded(ge=1, le=MAX_CALL_ID)
    end: bool = False


@dataclass(frozen=True)
class Credit(Message, positional=True):
    id: int = bounded(ge=1, le=MAX_CALL_ID)
    amount: int = bounded(ge=1, le=2**31)


@dataclass(frozen=True)
class Ping(Message, positional=True):
    nonce: int = bounded(ge=0, le=2**62)


@dataclass(frozen=True)
class Pong(Message, positional=True):
    nonce: int = bounded(ge=0, le=2**62)


@dataclass(frozen=True)
class GoAway(Message, positional=True):
    reason: str = bounded(max_len=256)


FRAME_KINDS: dict[int, type[Message]] = {
    1: Request,
    2: Response,
    3: Error,
    4: Cancel,
    5: Data,
    6: Credit,
    7: Ping,
    8: Pong,
    9: GoAway,
}
_KIND_OF = {cls: k for k, cls in FRAME_KINDS.items()}


def encode_header(msg: Message) -> bytes:
    """The kind, then the header's fields in order: ``[kind, *fields]``."""
    return pack([_KIND_OF[type(msg)], *msg.to_obj()])


def decode_header(data: bytes | memoryview) -> Message:
    """Decode and validate a frame header; RemoteProtocolError if malformed."""
    obj = unpack(data)
    fields: list[Any] | dict[str, Any]
    if isinstance(obj, list) and obj:
        kind, fields = obj[0], obj[1:]
    elif isinstance(obj, dict):  # (how peers of an older version send it: a map with its kind at "k")
        kind, fields = obj.get("k"), obj
    else:
        raise RemoteProtocolError("frame header is not a non-empty array")
    cls = FRAME_KINDS.get(kind) if type(kind) is int else None
    if cls is None:
        raise RemoteProtocolError(f"unknown frame kind {kind!r}")
    return cls.from_obj(fields)


def encode_args(msg: Message) -> bytes:
    return pack(msg.to_obj())


def decode_args(cls: type[Req], data: bytes) -> Req:
    return cls.from_obj(unpack(data))
