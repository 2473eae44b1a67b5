"""RPC vocabulary: method specs, the explicit handler registry, and the frame headers on a channel.

Theory of operation: a method is declared once as a :class:`Method` (name, request and response message
classes, unary or streaming) and shared by caller and callee, so both sides agree on the schema. A node
serves only the methods registered in its :class:`RpcRegistry`; an unknown method gets an
``unknown_method`` error reply and the connection stays up.

Frames on an encrypted channel are records whose header is one of the small messages below (an array:
its kind, then its fields in order) and whose body is raw bytes. Call ids are chosen by the caller: odd
for the side that dialed the connection, even for the side that accepted it, so both can call at once
without collisions.

Streaming calls move bulk data as ``Data`` records of at most ``MAX_CHUNK`` bytes each. Each direction of
a stream has a credit window: a sender may have at most ``window`` unconsumed bytes in flight, and the
receiver returns ``Credit`` as its application consumes them. A slow consumer therefore stalls only its
own stream, never the connection, and memory held per stream is bounded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import LocalProtocolError
from ..wire.codec import MAX_HEADER_BYTES, pack, unpack
from ..wire.schema import Message, bounded

if TYPE_CHECKING:
    from ..identity import PeerID
    from .streams import RpcStream

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

MAX_METHOD_NAME = 64
MAX_CALL_ID = 2**62


@dataclass(frozen=True)
class Method(Generic[Req, Resp]):
    """An RPC method: its registry name, request and response message types, and its kind."""

    name: str
    request: type[Req]
    response: type[Resp]
    streaming: bool = False

    def __post_init__(self) -> None:
        if not 0 < len(self.name) <= MAX_METHOD_NAME:
            raise ValueError(f"method name must be 1-{MAX_METHOD_NAME} characters")


@dataclass(frozen=True)
class Reply(Generic[Resp]):
    """A unary response message with an optional raw body (up to one chunk)."""

    message: Resp
    body: bytes | memoryview = b""


@dataclass
class CallContext:
    """What a handler knows about the call it serves."""

    peer: PeerID
    remote_host: str
    method: str
    body: memoryview
    deadline: float
    relayed: bool = False  # the call came through a relay: ``remote_host`` is the relay's address
    # A call on a circuit that came in through a relay this node holds a reservation with (one it
    # chose): where that relay said the caller dialed from. "" when not relayed, or not known.
    seen_at: str = ""


UnaryHandler = Callable[[CallContext, Any], Awaitable[Any]]
StreamHandler = Callable[[CallContext, Any, "RpcStream"], Awaitable[Any]]


@dataclass(frozen=True)
class _Registered:
    method: Method[Any, Any]
    handler: Callable[..., Awaitable[Any]]


class RpcRegistry:
    """The explicit set of methods a node serves."""

    def __init__(self) -> None:
        self._methods: dict[str, _Registered] = {}

    def add_unary(
        self, method: Method[Req, Resp], handler: Callable[[CallContext, Req], Awaitable[Resp | Reply[Resp]]]
    ) -> None:
        """Serve ``method``; the handler returns the response message (or a :class:`Reply`)."""
        if method.streaming:
            raise LocalProtocolError(f"{method.name} is a streaming method; use add_stream")
        self._add(method, handler)

    def add_stream(
        self, method: Method[Req, Resp], handler: Callable[[CallContext, Req, RpcStream], Awaitable[Resp]]
    ) -> None:
        """Serve a streaming ``method``; the handler gets the stream and returns the final response."""
        if not method.streaming:
            raise LocalProtocolError(f"{method.name} is a unary method; use add_unary")
        self._add(method, handler)

    def _add(self, method: Method[Any, Any], handler: Callable[..., Awaitable[Any]]) -> None:
        if method.name in self._methods:
            raise LocalProtocolError(f"method {method.name!r} is already registered")
        self._methods[method.name] = _Registered(method, handler)

    def get(self, name: str) -> _Registered | None:
        return self._methods.get(name)

    def names(self) -> list[str]:
        return sorted(self._methods)


# ---- frame headers ---------------------------------------------------------------------------


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
    from ..errors import RemoteProtocolError

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
