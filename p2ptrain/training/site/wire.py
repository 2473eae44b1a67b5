"""Rank 0's wire buffer: the site's contribution as one flat float32 vector in a mapped file.

Why a file: an averaging round takes one contiguous float32 tensor and averages it in place (see
``averaging.averager``), and a site's rank 0 must not hold a model-sized tensor on its heap. Pieces of the
pseudo-gradient arrive from the ranks (``pieces``) and are written here, and each piece's pages leave the
resident set at once (``MADV_DONTNEED``): they stay in the page cache, as DiLoCo's file-backed outer
state does (``state.file_tensors``). The round then reads and writes the pages it needs, and the landing
scatters the averages back piece by piece, dropping pages as it goes. The file is unnamed: the system
frees it when the process ends, even after a crash.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import torch

PAGE = mmap.PAGESIZE


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
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = raw.data_ptr()
        self.flat = raw[: numel * 4].view(torch.float32)

    def piece(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` (a view)."""
        return self.flat[lo:hi]

    def release(self, lo: int = 0, hi: int | None = None) -> None:
        """Elements ``[lo, hi)`` (default: all) leave this process's resident set; their values stay."""
        if self._map.closed:
            return
        hi = self.numel if hi is None else hi
        begin = (lo * 4) // PAGE * PAGE
        end = min(-(-hi * 4 // PAGE) * PAGE, self.size)
        if end > begin:
            self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def close(self) -> None:
        """Unmap it (no view of ``flat`` may be used after)."""
        if not self._map.closed:
            del self.flat
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
