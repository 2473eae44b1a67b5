"""Rank 0's wire buffer: the site's contribution as one flat float32 vector in a mapped file.

Why a file: an averaging round takes one contiguous float32 tensor and averages it in place (see
``averaging.averager``), and a site's rank 0 must not hold a model-sized tensor on its heap. Pieces of the
pseudo-gradient arrive from the ranks (``pieces``) and are written here, and each piece's pages leave the
resident set at once (``MADV_DONTNEED``): they stay in the page cache, as DiLoCo's file-backed outer
state does (``state.file_tensors``). The round then reads and writes the pages it needs, and the landing
scatters the averages back piece by piece, dropping pages as it goes. The file is unnamed: the system
frees it when the process ends, even after a crash.

While the round runs, the averager reads and writes the buffer where it pleases (it checks every value,
sends partitions, writes the averages), and each page it touches would stay in rank 0's resident set
until the landing: up to one fp32 copy of the model. :meth:`WireBuffer.keep_released` drops the pages
from the resident set every ``RELEASE_EVERY`` seconds meanwhile (a thread): the values stay in the
file's page cache, which the kernel writes back and evicts under pressure, and a page touched again is
mapped back on a minor fault. Rank 0 then holds no more of the wire vector than the round touches
between two releases.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PAGE = mmap.PAGESIZE
RELEASE_EVERY = 0.05  # seconds between two releases of the whole buffer while a round runs


class WireBuffer:
    """``numel`` float32 zeros in an unnamed mapped file (``flat``), released page by page."""

    def __init__(self, numel: int, folder: str | None = None) -> None:
        if numel < 0:
            raise ValueError("a wire buffer has at least zero elements")
        self.numel = numel
        self.size = max(-(-numel * 4 // PAGE) * PAGE, PAGE)
        fd, path = tempfile.mkstemp(prefix="p2ptrain-wire-", dir=folder)
        try:
            os.unlink(path)
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)  # (the mapping keeps the file)
        self._lock = threading.Lock()  # (madvise and close from two threads)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = raw.data_ptr()
        self.flat = raw[: numel * 4].view(torch.float32)

    def piece(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` (a view)."""
        return self.flat[lo:hi]

    def release(self, lo: int = 0, hi: int | None = None) -> None:
        """Elements ``[lo, hi)`` (default: all) leave this process's resident set; their values stay."""
        hi = self.numel if hi is None else hi
        begin = (lo * 4) // PAGE * PAGE
        end = min(-(-hi * 4 // PAGE) * PAGE, self.size)
        with self._lock:
            if end > begin and not self._map.closed:
                self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    @contextmanager
    def keep_released(self, every: float = RELEASE_EVERY) -> Iterator[None]:
        """Meanwhile, the whole buffer leaves the resident set every ``every`` seconds (see above)."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every):
                self.release()

        thread = threading.Thread(target=loop, name="wire-release", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.release()

    def close(self) -> None:
        """Unmap it (no view of ``flat`` may be used after)."""
        with self._lock:
            if not self._map.closed:
                del self.flat
                try:
                    self._map.close()
                except BufferError:  # a view is still alive somewhere: the mapping goes with it
                    pass
