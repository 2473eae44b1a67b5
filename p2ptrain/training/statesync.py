"""State download: a joining or lagging peer fetches model and optimizer state from a peer that has it.

Theory of operation: a donor serves two methods. ``train.state_info`` answers which epoch it can serve,
the digest of that state's verified part (the parameters every peer must agree on; the same digest its
signed progress record carries), and its size in bytes. ``train.state`` then streams exactly that
snapshot (safetensors bytes, see ``state``), refusing if the donor has moved on meanwhile. A snapshot is
taken once per epoch and shared by every concurrent download; at most ``MAX_DOWNLOADS`` run at once, so
a crowd of joiners spreads over several donors (each joiner orders the donors differently) instead of
choking one.

The receiver trusts nothing: it refuses a size above what its own model could need, reads at most the
announced size, decodes strictly (never unpickling), recomputes the digest and compares it with the
announced one and with the digest most peers reported for that epoch. Only then is anything applied,
by the caller. A donor that fails any check is logged and the next one is tried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import trio

from ..errors import CallRefused, P2PError, PeerUnavailable, RemoteProtocolError
from ..net.host import Host
from ..net.rpc import CallContext, Method, RpcRegistry
from ..net.streams import RpcStream
from ..wire.schema import Message, bounded
from . import state
from .progress import DIGEST_BYTES, PeerProgress

log = logging.getLogger(__name__)

MAX_DOWNLOADS = 4  # concurrent downloads one donor serves
MAX_STATE_BYTES = 1 << 40


@dataclass(frozen=True)
class StateInfoReq(Message):
    pass


@dataclass(frozen=True)
class StateInfo(Message):
    epoch: int = bounded(ge=0, le=2**53)
    digest: bytes = bounded(max_len=DIGEST_BYTES)
    size: int = bounded(ge=0, le=MAX_STATE_BYTES)


@dataclass(frozen=True)
class StateReq(Message):
    epoch: int = bounded(ge=0, le=2**53)


@dataclass(frozen=True)
class StateDone(Message):
    ok: bool = True


STATE_INFO = Method("train.state_info", StateInfoReq, StateInfo)
STATE = Method("train.state", StateReq, StateDone, streaming=True)


@dataclass(frozen=True)
class Snapshot:
    """One epoch's state as the bytes a donor streams."""

    epoch: int
    digest: bytes
    pieces: list[bytes | memoryview]
    size: int


@dataclass(frozen=True)
class Downloaded:
    epoch: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    donor: PeerProgress


class StateServer:
    """Serves this peer's state; ``snapshot()`` returns the current epoch's (taken lazily, cached)."""

    def __init__(self, registry: RpcRegistry, snapshot: Callable[[], Snapshot | None]) -> None:
        self._snapshot = snapshot
        self._slots = trio.Semaphore(MAX_DOWNLOADS)
        self.served = 0
        registry.add_unary(STATE_INFO, self._on_info)
        registry.add_stream(STATE, self._on_state)

    def _current(self) -> Snapshot:
        snap = self._snapshot()
        if snap is None:
            raise CallRefused("unavailable", "this peer has no state to serve yet")
        return snap

    async def _on_info(self, ctx: CallContext, req: StateInfoReq) -> StateInfo:
        snap = self._current()
        return StateInfo(snap.epoch, snap.digest, snap.size)

    async def _on_state(self, ctx: CallContext, req: StateReq, stream: RpcStream) -> StateDone:
        snap = self._current()
        if snap.epoch != req.epoch:
            raise CallRefused("moved_on", f"this peer now serves step {snap.epoch}, not {req.epoch}")
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            raise CallRefused("busy", f"already serving {MAX_DOWNLOADS} downloads") from None
        try:
            log.info("serving step %d's state (%.1f MB) to %s", snap.epoch, snap.size / 1e6, ctx.peer.short())
            for piece in snap.pieces:
                await stream.send(piece)
            await stream.send_eof()
            self.served += 1
        finally:
            self._slots.release()
        return StateDone(True)


ProgressFn = Callable[[int, int], None]
"""Called with (bytes received, bytes expected) as a download proceeds."""


async def download(
    host: Host,
    donors: Sequence[PeerProgress],
    *,
    max_size: int,
    verified: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    expected_digest: Callable[[int], bytes],
    timeout: float,
    on_progress: ProgressFn | None = None,
) -> Downloaded:
    """Download state from the first donor that delivers a state that checks out.

    ``verified`` picks, from the decoded tensors, the part whose digest peers publish;
    ``expected_digest(epoch)`` is the digest most peers reported for that epoch (b"" if unknown).
    Raises :class:`PeerUnavailable` when no donor delivered.
    """
    failures = []
    for donor in donors:
        try:
            with trio.fail_after(timeout):
                return await _download_from(
                    host, donor, max_size, verified, expected_digest, on_progress or (lambda a, b: None)
                )
        except (P2PError, trio.TooSlowError) as e:
            why = str(e) or "timed out"
            log.warning("state download from %s failed: %s", donor.peer.short(), why)
            failures.append(f"{donor.peer.short()}: {why}")
    raise PeerUnavailable(
        "no peer delivered a valid state" + (f" ({'; '.join(failures[-4:])})" if failures else " (no donors)")
    )


async def _download_from(
    host: Host,
    donor: PeerProgress,
    max_size: int,
    verified: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    expected_digest: Callable[[int], bytes],
    on_progress: ProgressFn,
) -> Downloaded:
    conn = await host.connect(donor.record.addr)
    if conn.peer != donor.peer:
        raise RemoteProtocolError("the donor's address leads to another peer")
    info = await conn.call(STATE_INFO, StateInfoReq())
    if info.size > max_size:
        raise RemoteProtocolError(
            f"announced {info.size} bytes, more than this model could need ({max_size})"
        )
    expected = expected_digest(info.epoch)
    if expected and info.digest != expected:
        raise RemoteProtocolError(f"offers a state for step {info.epoch} that most peers did not start from")
    buf = bytearray(info.size)
    got = 0
    async with conn.open_stream(STATE, StateReq(info.epoch)) as stream:
        async for chunk in stream:
            if got + len(chunk) > info.size:
                raise RemoteProtocolError(f"sent more than the {info.size} bytes it announced")
            buf[got : got + len(chunk)] = chunk
            got += len(chunk)
            on_progress(got, info.size)
        await stream.response()
    if got != info.size:
        raise RemoteProtocolError(f"sent {got} of the {info.size} bytes it announced")
    tensors, metadata = state.decode(buf)
    if state.digest(verified(tensors)) != info.digest:
        raise RemoteProtocolError("the state's digest does not match the one announced")
    log.info("downloaded step %d's state (%.1f MB) from %s", info.epoch, got / 1e6, donor.peer.short())
    return Downloaded(info.epoch, tensors, metadata, donor)
