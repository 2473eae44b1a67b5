"""File-backed tensors: model-sized state that is touched once per round lives in the page cache.

Why: DiLoCo keeps two model-sized tensors besides the ones it trains with, the global parameters and the
outer optimizer's momentum. They are read and written once per outer round (the handoff computes the
pseudo-gradient from the global parameters; the landing takes the outer step), a few minutes apart,
and never during the inner steps where a peer's memory peaks (parameters, gradients, AdamW moments and
the pseudo-gradient in flight). Held on the heap they cost 2x the fp32 parameter bytes of host RAM for
good; that was what kept a DiLoCo peer above 7x its parameter bytes.

How: :class:`FileTensors` lays the tensors out in one unnamed temporary file (each tensor page-aligned)
and maps it shared into memory, so they are ordinary torch tensors that every code path (the outer
optimizer, ``copy_``, capture and restore) uses unchanged. A page that is touched joins the process's
resident set until :meth:`release` drops the mapping's hold on it (``MADV_DONTNEED``): its bytes stay in
the page cache (dirty ones are written back by the kernel), where the next access finds them again, or
the kernel writes them out when memory runs short. Code that walks the state without changing it
(hashing, snapshots for joiners) reads such tensors with :meth:`read` (``pread`` from the page cache),
which never maps a page in. Callers release what they touched as soon as they are done with it,
tensor by tensor.

The file lives in the temporary folder (``TMPDIR``) like the averaging spill files: on a system whose
``/tmp`` is a RAM disk, point ``TMPDIR`` at a disk, or this saves nothing. It is unnamed from the moment
it exists, so the system frees it when the process ends, even after a crash.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Sequence

import torch

from ...averaging.spill import read_exact

PAGE = mmap.PAGESIZE


class FileTensors:
    """Zero-initialized tensors shaped like ``like`` (same dtypes, on the CPU), in one mapped file."""

    def __init__(self, like: Sequence[torch.Tensor], folder: str | None = None) -> None:
        self._spans: list[tuple[int, int]] = []
        offset = 0
        for t in like:
            nbytes = t.numel() * t.element_size()
            self._spans.append((offset, nbytes))
            offset += -(-nbytes // PAGE) * PAGE  # every tensor starts on a page: released exactly
        self.size = max(offset, PAGE)
        fd, path = tempfile.mkstemp(prefix="p2ptrain-outer-", dir=folder)
        try:
            os.unlink(path)
            os.ftruncate(fd, self.size)  # a sparse file of zeros: no disk block until written
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = raw.data_ptr()
        self.tensors: list[torch.Tensor] = [
            raw[off : off + nbytes].view(t.dtype).view(t.shape)
            for (off, nbytes), t in zip(self._spans, like, strict=True)
        ]

    def _span_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The file bytes [begin, end) that ``t`` views, if it is one of ours (or a view into one)."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        begin = t.data_ptr() - self._base
        end = begin + t.numel() * t.element_size()
        if begin >= 0 and end <= self.size:
            return begin, end
        return None

    def owns(self, t: torch.Tensor) -> bool:
        return self._span_of(t) is not None

    def read(self, t: torch.Tensor, lo: int, hi: int) -> bytearray:
        """Bytes ``[lo, hi)`` of ``t`` (one of ours) from the page cache, without mapping a page in."""
        span = self._span_of(t)
        if span is None or not 0 <= lo <= hi <= span[1] - span[0]:
            raise ValueError("not bytes of a file-backed tensor")
        return read_exact(self._fd, span[0] + lo, hi - lo, "the outer-state file")

    def release(self, which: Sequence[torch.Tensor] | None = None) -> None:
        """Drop this process's hold on the pages of ``which`` (default: all): they leave the resident set
        and stay in the page cache (or on disk), unchanged."""
        if self._map.closed:
            return
        if which is None:
            self._map.madvise(mmap.MADV_DONTNEED, 0, self.size)
            return
        for t in which:
            span = self._span_of(t)
            if span is None:
                continue
            begin = span[0] - span[0] % PAGE
            if span[1] > begin:
                self._map.madvise(mmap.MADV_DONTNEED, begin, span[1] - begin)
