"""One bidirectional byte stream inside a streaming RPC call, with credit-based flow control.

The connection's reader task hands incoming ``Data`` bodies to :meth:`RpcStream.deliver` without ever
blocking (the sender may only send what we granted, so the buffer is bounded by the window); the
application consumes them with :meth:`receive_some`, which returns credit to the sender. Sending waits
for credit, which is the backpressure a slow receiver exerts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import trio

from ..errors import ConnectionClosed, LocalProtocolError, RemoteProtocolError
from .channel import MAX_CHUNK
from .frames import Credit, Data

if TYPE_CHECKING:
    from ..wire.schema import Message

DEFAULT_WINDOW = 8 * MAX_CHUNK
INITIAL_WINDOW = MAX_CHUNK
"""Protocol constant: each end of a stream may send this much before hearing any Credit. An end with a
larger window (its own choice, never assumed by the other end) grants the difference when its
application first reads, so peers with different windows interoperate, and a stream nobody reads yet
(a call waiting for its round to start, say) holds at most this much of the sender's data."""


class SendFn(Protocol):
    """How a stream sends a record on its connection; ``bulk``: background bulk (see ``send``)."""

    def __call__(
        self, header: Message, body: bytes | memoryview = b"", *, bulk: bool = False
    ) -> Awaitable[None]: ...


class RpcStream:
    """The byte stream of one streaming call, as seen from one end."""

    def __init__(
        self,
        call_id: int,
        send: SendFn,
        window: int = DEFAULT_WINDOW,
        background_piece: Callable[[], int] | None = None,
    ) -> None:
        """``background_piece``: the record size for ``send(..., background=True)`` (the connection's
        :meth:`~p2ptrain.net.channel.SecureChannel.bulk_piece`); MAX_CHUNK without one."""
        self.call_id = call_id
        self._send = send
        self._background_piece = background_piece
        if window < INITIAL_WINDOW:
            raise LocalProtocolError(f"a stream window must be at least {INITIAL_WINDOW} bytes")
        self._window = window
        self._chunk = MAX_CHUNK
        # receive side
        self._chunks: deque[memoryview] = deque()
        self._targets: deque[memoryview] = deque()  # where the next chunks are to land (land_in)
        self._delivered = 0  # data chunks that arrived so far (land_in's targets count from the first)
        self._targeted = 0  # targets land_in was given so far (the head of ``_targets``: chunk _delivered)
        self._arrived = trio.Event()
        self._eof = False
        self.buffered = 0
        self._received_window = INITIAL_WINDOW  # what the remote may send before our first Credit
        self._window_open = False
        self._consumed = 0
        # send side
        self._credit = INITIAL_WINDOW  # what we may send before the remote's first Credit
        self._credit_changed = trio.Event()
        self._sent_eof = False
        self._answered = False  # the remote answered the call and reads no more of our data
        self._error: BaseException | None = None

    async def _open_window(self) -> None:
        """Grant the remote our window beyond the protocol's initial one (once, at the first read)."""
        if self._window_open:
            return
        self._window_open = True
        extra = self._window - INITIAL_WINDOW
        if extra > 0 and not self._eof and self._error is None:
            self._received_window += extra
            await self._send(Credit(id=self.call_id, amount=extra), b"")

    # ---- application side ----

    async def send(self, data: bytes | memoryview, *, background: bool = False) -> None:
        """Send bytes, in chunks, waiting for the receiver's credit (backpressure).

        ``background``: bulk that must not hold control messages up (catching up: a state download, a
        replayed result): records of what the connection drains in a fraction of a second
        (:data:`~p2ptrain.net.channel.FRAME_SECONDS`), so a control message queued behind waits that
        long at most. The receiver must then read the bytes as a stream, not a record per ``send``.

        Once the remote has answered the call it reads nothing more, so the rest is discarded and the
        answer waits in ``response()`` (as an HTTP/2 server may answer before the request body ends).
        """
        if self._sent_eof:
            raise LocalProtocolError("send after send_eof")
        view = memoryview(data).cast("B")
        start = 0
        while start < len(view):
            size = self._chunk
            if background and self._background_piece is not None:
                size = max(1, min(self._chunk, self._background_piece()))
            piece = view[start : start + size]
            start += len(piece)
            while self._credit < len(piece) and not self._answered:
                self._raise_if_failed()
                await self._credit_changed.wait()
            self._raise_if_failed()
            if self._answered:
                await trio.lowlevel.checkpoint()
                return
            self._credit -= len(piece)
            await self._send(Data(id=self.call_id, end=False), piece, bulk=background)

    async def send_eof(self) -> None:
        """Tell the other end that nothing more will be sent."""
        if not self._sent_eof:
            self._sent_eof = True
            self._raise_if_failed()
            if not self._answered:
                await self._send(Data(id=self.call_id, end=True), b"")

    def land_in(self, targets: Iterable[memoryview]) -> None:
        """Have the stream's chunks, one per target and in order from its first chunk, decrypted straight
        into ``targets`` instead of fresh buffers: :meth:`receive_some` then returns the target itself,
        and the caller saves a copy. A chunk of another size than its target, or one that arrived
        before this call, is in a buffer of its own, as usual (compare the returned view's address with
        the target's): the targets of chunks already in are skipped, so no later chunk lands in another
        chunk's place. (They were not: a 25 MB partition's early averages, whose first chunks arrived
        while the member backed its own values up in a thread, each landed one target early and
        overwrote the chunk before, and the round committed misplaced chunks.) What a target held is
        lost once its chunk arrives, even if the chunk turns out forged (the connection then closes)."""
        for t in targets:
            index, self._targeted = self._targeted, self._targeted + 1  # (the chunk it is for)
            if index >= self._delivered:
                self._targets.append(memoryview(t).cast("B"))

    async def receive_some(self) -> memoryview:
        """Return the next chunk, or an empty view once the other end sent EOF."""
        if not self._window_open:
            await self._open_window()
        while not self._chunks:
            self._raise_if_failed()
            if self._eof:
                return memoryview(b"")
            self._arrived = trio.Event()
            await self._arrived.wait()
        chunk = self._chunks.popleft()
        self.buffered -= len(chunk)
        self._consumed += len(chunk)
        if self._consumed >= self._window // 4 and not self._eof:
            grant, self._consumed = self._consumed, 0
            self._received_window += grant
            await self._send(Credit(id=self.call_id, amount=grant), b"")
        return chunk

    async def receive_all(self, limit: int) -> bytes:
        """Read until EOF, refusing more than ``limit`` bytes."""
        parts: list[memoryview] = []
        total = 0
        async for chunk in self:
            total += len(chunk)
            if total > limit:
                raise RemoteProtocolError(f"stream exceeds the {limit}-byte limit")
            parts.append(chunk)
        return b"".join(parts)

    async def __aiter__(self) -> AsyncIterator[memoryview]:
        while True:
            chunk = await self.receive_some()
            if not chunk:
                return
            yield chunk

    # ---- connection side: what the connection carrying the stream calls ----

    def sink_for(self, size: int) -> memoryview | None:
        """Where the next chunk (``size`` bytes, about to be decrypted) may land: its target from
        :meth:`land_in`, if it has one of exactly that size and the chunk is not out of bounds."""
        if not self._targets or self._eof or self._error is not None or size > self._received_window:
            return None
        target = self._targets[0]
        return target if len(target) == size else None

    def deliver(self, data: Data, body: memoryview) -> None:
        if self._eof:
            raise RemoteProtocolError(f"data after end of stream on call {self.call_id}")
        if len(body):
            if len(body) > self._received_window:
                raise RemoteProtocolError(f"stream {self.call_id} sent beyond its credit window")
            self._delivered += 1
            if self._targets:
                self._targets.popleft()  # landed there, or (another size) in a buffer of its own
            self._received_window -= len(body)
            self._chunks.append(body)
            self.buffered += len(body)
        if data.end:
            self._eof = True
        self._arrived.set()

    def end_received(self) -> None:
        """The remote answered the call: no more data will arrive, and it reads none of ours."""
        self._eof = True
        self._arrived.set()
        self._answered = True
        self._credit_changed.set()  # a sender waiting for credit would otherwise wait forever

    def grant(self, amount: int) -> None:
        self._credit += amount
        if self._credit > 2**40:
            raise RemoteProtocolError("credit overflow")
        self._credit_changed.set()
        self._credit_changed = trio.Event()

    def fail(self, error: BaseException) -> None:
        """Wake everything waiting on this stream with ``error``; drop buffered data, and the targets
        chunks would have landed in (views of the caller's buffers: a finished call sits in a reference
        cycle with its stream until the cyclic collector runs, and a view would keep a model-sized
        buffer alive that long)."""
        if self._error is None:
            self._error = error
        self._chunks.clear()
        self._targets.clear()
        self.buffered = 0
        self._arrived.set()
        self._credit_changed.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, ConnectionClosed):
                raise ConnectionClosed(str(self._error))
            raise self._error
