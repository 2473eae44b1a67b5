"""State download, the donor's side: serve one consistent snapshot of the state, chunk by chunk.

Theory of operation: a peer that joins late, missed a step or diverged downloads the model and optimizer
state from peers that have it (:mod:`.download`). A state may be many gigabytes and a joiner's link slow, so
nothing here bounds a whole transfer; every piece is small and checked on arrival.

A donor serves the three methods of :mod:`.protocol`:

- ``train.state_info``: which state it offers (epoch, root digest, size, chunk count, header and
  metadata lengths). Asked for an epoch it still holds a snapshot of, it offers that one (so a joiner
  finishing a long download keeps its donors after they moved on); otherwise it offers its current state.
- ``train.state_manifest`` (stream): the layout header, the chunk hashes and the metadata (optimizer
  hyperparameters, ...) of a snapshot named by its root.
- ``train.state_chunks`` (stream): a range of chunks of a snapshot named by its root.

A snapshot is taken only when a joiner asks: the caller's ``prepare`` writes the live state to an
unnamed temporary file (deleted by the system when closed, even after a crash), in a worker thread, while
the training loop holds back anything that would change the state; the event loop keeps answering
meanwhile. One snapshot serves every concurrent joiner; it is released once no joiner has read it for
``LINGER`` seconds. Its bytes live in the page cache and on disk, not in the process's memory, and each
chunk is read from the file when it is sent (in a worker thread for a large state). At most
``MAX_SNAPSHOTS`` are held, and chunk streams take the node's bulk serving slots
(:class:`~p2ptrain.net.slots.ServingSlots`: at most 16 at once, 4 per joiner and 8 per origin, shared
with the results it serves to peers that replay), so that free ids from one origin cannot take them all.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch
import trio

from ...errors import CallRefused
from ...net.rpc import CallContext, RpcRegistry
from ...net.slots import BUSY, ServingSlots
from ...net.streams import RpcStream
from . import chunks as lay
from .chunks import Layout
from .codec import Source
from .protocol import (
    STATE_CHUNKS,
    STATE_INFO,
    STATE_MANIFEST,
    ChunksReq,
    ManifestReq,
    StateInfo,
    StateInfoReq,
    StreamDone,
)

log = logging.getLogger(__name__)

MAX_SNAPSHOTS = 2
LINGER = 60.0  # seconds a snapshot nobody reads is kept
THREAD_BYTES = 8 << 20
"""States at least this large are hashed and written in a worker thread; smaller ones inline (a few
milliseconds), which keeps tests on a virtual clock deterministic."""


@dataclass(frozen=True)
class LiveState:
    """The state as it is now: tensors in layout order (read in place), metadata, and the chunk hashes
    if they are already known for exactly these bytes."""

    epoch: int
    layout: Layout
    tensors: Sequence[torch.Tensor]
    metadata: dict[str, str]
    hashes: Sequence[bytes] | None = None
    source: Source | None = None  # reads the file-backed tensors among ``tensors``


@dataclass
class Snapshot:
    """One epoch's state in a file, served to any number of joiners."""

    epoch: int
    root: bytes
    layout: Layout
    hashes: list[bytes]
    meta: bytes
    fd: int
    last_used: float
    readers: int = 0

    def info(self) -> StateInfo:
        return StateInfo(
            self.epoch,
            self.root,
            self.layout.size,
            self.layout.chunks,
            len(self.layout.header),
            len(self.meta),
        )

    def read(self, i: int) -> bytes:
        size = self.layout.chunk_size(i)
        data = os.pread(self.fd, size, i * lay.CHUNK)
        if len(data) != size:
            raise OSError(f"snapshot file is short at chunk {i}")
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_snapshot(live: LiveState, folder: str | None = None) -> Snapshot:
    """Write ``live`` to an unnamed temporary file, hashing what is not hashed yet (blocking: call it in
    a worker thread for large states, with the state held still)."""
    fd, path = tempfile.mkstemp(prefix="p2ptrain-snapshot-", dir=folder)
    os.unlink(path)  # unnamed from now on: the system frees it when closed, even after a crash
    try:
        hashes = []
        offset = 0
        for i in range(live.layout.chunks):
            pieces = lay.chunk_pieces(live.layout, live.tensors, i, live.source)
            if live.hashes is None:
                hashes.append(lay.hash_chunk(pieces))
            for piece in pieces:
                offset += os.pwrite(fd, piece, offset)
        if offset != live.layout.size:
            raise OSError(f"wrote {offset} of {live.layout.size} snapshot bytes")
        final = list(live.hashes) if live.hashes is not None else hashes
        meta = json.dumps(live.metadata, separators=(",", ":"), sort_keys=True).encode()
        root = lay.root(live.epoch, live.layout, final)
        return Snapshot(live.epoch, root, live.layout, final, meta, fd, last_used=0.0)
    except BaseException:
        os.close(fd)
        raise


class StateServer:
    """Serves this peer's state. ``prepare`` returns a new snapshot of the current state (None if it
    has none to serve), or the current one's root if one was already taken of this very state."""

    def __init__(
        self,
        registry: RpcRegistry,
        prepare: Callable[[], Awaitable[Snapshot | None]],
        slots: ServingSlots | None = None,
    ) -> None:
        """``slots``: the node's bulk serving slots (shared with its other bulk services; None: its own)."""
        self._prepare = prepare
        self._snapshots: list[Snapshot] = []
        self._preparing = trio.Lock()
        self.slots = slots or ServingSlots()
        self._current: Snapshot | None = None  # the snapshot of the state as it is now, once taken
        self.served_bytes = 0
        self.served_chunks = 0
        registry.add_unary(STATE_INFO, self._on_info)
        registry.add_stream(STATE_MANIFEST, self._on_manifest)
        registry.add_stream(STATE_CHUNKS, self._on_chunks)

    async def run(self) -> None:
        """Release snapshots nobody has read for ``LINGER`` seconds (until cancelled)."""
        try:
            while True:
                await trio.sleep(LINGER / 4)
                self.sweep(trio.current_time())
        finally:
            for snap in self._snapshots:
                snap.close()
            self._snapshots.clear()

    def sweep(self, now: float) -> None:
        for snap in list(self._snapshots):
            if snap.readers == 0 and now - snap.last_used >= LINGER:
                log.info("released step %d's snapshot (%s)", snap.epoch, snap.layout.describe())
                self._drop(snap)

    def _drop(self, snap: Snapshot) -> None:
        self._snapshots.remove(snap)
        snap.close()

    def invalidate(self) -> None:
        """The state changed: a snapshot of it must be taken anew (older ones still serve their joiners)."""
        self._current = None

    async def _on_info(self, ctx: CallContext, req: StateInfoReq) -> StateInfo:
        for snap in self._snapshots:
            if snap.epoch == req.epoch and snap.fd >= 0:
                snap.last_used = trio.current_time()
                return snap.info()
        async with self._preparing:
            if self._current is None or self._current.fd < 0:
                self._make_room()
                taken = await self._prepare()
                if taken is None:
                    raise CallRefused("unavailable", "this peer has no state to serve yet")
                try:
                    self._make_room()
                except CallRefused:
                    taken.close()
                    raise
                taken.last_used = trio.current_time()
                self._snapshots.append(taken)
                self._current = taken
                log.info("took a snapshot of step %d to serve (%s)", taken.epoch, taken.layout.describe())
            self._current.last_used = trio.current_time()
            return self._current.info()

    def _make_room(self) -> None:
        """Release the least recently read idle snapshots until one more fits, or refuse."""
        while len(self._snapshots) >= MAX_SNAPSHOTS:
            idle = [s for s in self._snapshots if s.readers == 0]
            if not idle:
                raise CallRefused(BUSY, f"already serving {MAX_SNAPSHOTS} snapshots")
            self._drop(min(idle, key=lambda s: s.last_used))

    def _find(self, root: bytes) -> Snapshot:
        for snap in self._snapshots:
            if snap.root == root and snap.fd >= 0:
                return snap
        raise CallRefused("moved_on", "this peer no longer holds that state")

    async def _on_manifest(self, ctx: CallContext, req: ManifestReq, stream: RpcStream) -> StreamDone:
        snap = self._find(req.root)
        snap.last_used = trio.current_time()
        await stream.send(snap.layout.header)
        await stream.send(b"".join(snap.hashes))
        await stream.send(snap.meta)
        await stream.send_eof()
        return StreamDone(True)

    async def _on_chunks(self, ctx: CallContext, req: ChunksReq, stream: RpcStream) -> StreamDone:
        snap = self._find(req.root)
        if req.first + req.count > snap.layout.chunks:
            raise CallRefused("bad_request", f"chunks {req.first}+{req.count} beyond {snap.layout.chunks}")
        with self.slots.taken(ctx.peer, ctx.remote_host):
            snap.readers += 1
            try:
                for i in range(req.first, req.first + req.count):
                    if snap.layout.size < THREAD_BYTES:
                        data = snap.read(i)
                    else:  # a large state need not be in the page cache: a disk read may take a while
                        data = await trio.to_thread.run_sync(snap.read, i)
                    await stream.send(data, background=True)  # (catching up: control messages go first)
                    snap.last_used = trio.current_time()
                    self.served_bytes += len(data)
                    self.served_chunks += 1
                await stream.send_eof()
            finally:
                snap.readers -= 1
        return StreamDone(True)
