"""Spill files: bytes a round must keep but will most likely never read again.

Why: a reducer keeps every chunk its partition receives until the round's decision, in case the decision
leaves out a sender (it then sums again over the decided contributors, see ``reducer``). Held in memory,
that is (n - 1) / n of the model's bytes on every member, a round after round, for a recomputation that
almost never happens: at 124M parameters in a group of two, half a gigabyte of host RAM per peer. Written
to an unnamed temporary file instead, a chunk costs one copy into the page cache, which the kernel writes
out or drops when memory runs short (and simply discards when the file is closed first: the usual end of
a round); the rare recomputation reads it back.

The file lives in the temporary folder (``TMPDIR``): on a system whose ``/tmp`` is a RAM disk, point
``TMPDIR`` at a disk. It is unnamed from the moment it exists, so the system frees it when it is closed,
even after a crash.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
from dataclasses import dataclass

import trio

SPILL_BYTES = 8 * 1024 * 1024
"""Partitions of at least this many bytes keep what they receive in a spill file; smaller ones in memory."""
CLOSE_IN_THREAD = 64 * 1024 * 1024  # a spill file this large is closed by the closer thread (see close)

# Large files are closed by one long-lived thread, fed through a queue whose ``put`` may be called from a
# finalizer (``SimpleQueue`` is reentrant). A thread started in ``__del__`` instead could hang the process:
# the collector may run a finalizer inside threading's own locked sections (a benchmark's main thread
# waited forever in ``Thread.start`` from ``SpillFile.__del__``).
_to_close: queue.SimpleQueue[int | threading.Event] = queue.SimpleQueue()
_closer: threading.Thread | None = None
_closer_lock = threading.Lock()


def _close_forever() -> None:
    while True:
        item = _to_close.get()
        if isinstance(item, threading.Event):
            item.set()
        else:
            os.close(item)


def settle(timeout: float) -> bool:
    """Wait until every descriptor handed to the closer thread so far is closed (False if it took longer
    than ``timeout`` seconds)."""
    if _closer is None:
        return True
    done = threading.Event()
    _to_close.put(done)
    return done.wait(timeout)


def _start_closer() -> None:
    """Start the closer thread (from ordinary code, never a finalizer: see ``_to_close``)."""
    global _closer
    if _closer is None:
        with _closer_lock:
            if _closer is None:
                _closer = threading.Thread(target=_close_forever, name="spill-close", daemon=True)
                _closer.start()


@dataclass(frozen=True)
class Spilled:
    """Where a piece went: ``length`` bytes at ``offset`` of ``file``."""

    file: SpillFile
    offset: int
    length: int

    def read(self) -> bytearray:
        return self.file.read(self.offset, self.length)


class SpillFile:
    """An append-only unnamed temporary file, created on the first write."""

    def __init__(self, folder: str | None = None) -> None:
        self.folder = folder
        self.fd = -1
        self.size = 0
        self.closed = False

    def _open(self) -> None:
        if self.closed:
            raise ValueError("the spill file is closed")
        if self.fd < 0:
            fd, path = tempfile.mkstemp(prefix="p2ptrain-spill-", dir=self.folder)
            os.unlink(path)
            self.fd = fd

    def put(self, data: bytes | bytearray | memoryview) -> Spilled:
        """Append ``data``; the returned handle reads it back (the caller may reuse ``data`` at once)."""
        offset = self.reserve(len(memoryview(data).cast("B")))
        self.write_at(offset, data)
        return Spilled(self, offset, self.size - offset)

    def reserve(self, length: int) -> int:
        """Room for ``length`` bytes at the end, filled by :meth:`write_at` (what is never written reads
        as zeros and takes no disk); its offset."""
        self._open()
        offset = self.size
        self.size += length
        if self.size >= CLOSE_IN_THREAD:
            _start_closer()  # (here, not where it is closed: that may be a finalizer)
        return offset

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` at ``offset``, within room :meth:`reserve` made."""
        self._open()
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > self.size:
            raise ValueError(f"{len(view)} bytes at {offset} are past the {self.size} reserved")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read(self, offset: int, length: int) -> bytearray:
        if self.closed:
            raise ValueError("the spill file is closed")
        return read_exact(self.fd, offset, length, "the spill file")

    def __del__(self) -> None:  # (a round cancelled midway: its file goes when its last handle does)
        try:
            self.close()
        except Exception:  # (at the interpreter's exit the module's globals are gone: the system closes it)
            pass

    def close(self) -> None:
        """Close (and so free) the file. A large one is closed in a thread of its own: the kernel frees
        its pages as it closes, which for a model-sized file held the event loop for 0.1 s per 800 MB."""
        self.closed = True
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            if self.size >= CLOSE_IN_THREAD and _closer is not None:
                _to_close.put(fd)
            else:
                os.close(fd)


def read_exact(fd: int, offset: int, length: int, what: str) -> bytearray:
    """``length`` bytes of ``fd`` from ``offset`` (page cache or disk), read straight into the buffer
    returned; OSError naming ``what`` if the file ends first."""
    out = bytearray(length)
    view, done = memoryview(out), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{what} is short at byte {offset + done}")
        done += n
    return out


async def put(file: SpillFile, data: bytes | bytearray | memoryview) -> Spilled:
    """``file.put(data)``, in a worker thread when ``data`` is large (copying hundreds of megabytes into
    the page cache would hold the event loop). The caller must not change ``data`` meanwhile."""
    if len(memoryview(data).cast("B")) >= SPILL_BYTES:
        return await trio.to_thread.run_sync(file.put, data)
    return file.put(data)
