"""RPC vocabulary: method specs and the explicit handler registry.

Theory of operation: a method is declared once as a :class:`Method` (name, request and response message
classes, unary or streaming) and shared by caller and callee, so both sides agree on the schema. A node
serves only the methods registered in its :class:`RpcRegistry`; an unknown method gets an
``unknown_method`` error reply and the connection stays up.

The frames a call travels in are ``frames``'. Streaming calls move bulk data as ``Data`` records of at
most ``MAX_CHUNK`` bytes each. Each direction of a stream has a credit window: a sender may have at most
``window`` unconsumed bytes in flight, and the receiver returns ``Credit`` as its application consumes
them. A slow consumer therefore stalls only its own stream, never the connection, and memory held per
stream is bounded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import LocalProtocolError
from ..wire.schema import Message
from .frames import MAX_METHOD_NAME, Req
from .streams import RpcStream

if TYPE_CHECKING:
    from ..identity import PeerID

Resp = TypeVar("Resp", bound=Message)


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
StreamHandler = Callable[[CallContext, Any, RpcStream], Awaitable[Any]]


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

    def replace(self, method: Method[Any, Any], handler: Callable[..., Awaitable[Any]]) -> None:
        """Serve ``method`` with another handler from now on (a hostile peer built for simulations
        answers some calls its own way: see ``p2ptrain.testing.adversary``)."""
        if method.name not in self._methods:
            raise LocalProtocolError(f"method {method.name!r} is not registered")
        self._methods[method.name] = _Registered(method, handler)

    def release(self, owner: object) -> list[str]:
        """Stop serving the methods whose handlers are bound methods of ``owner`` (a component that
        ended, so that one built in its place may serve them); returns their names."""
        names = [name for name, r in self._methods.items() if getattr(r.handler, "__self__", None) is owner]
        for name in names:
            del self._methods[name]
        return names

    def _add(self, method: Method[Any, Any], handler: Callable[..., Awaitable[Any]]) -> None:
        if method.name in self._methods:
            raise LocalProtocolError(f"method {method.name!r} is already registered")
        self._methods[method.name] = _Registered(method, handler)

    def get(self, name: str) -> _Registered | None:
        return self._methods.get(name)

    def names(self) -> list[str]:
        return sorted(self._methods)
