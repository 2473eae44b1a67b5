"""Float32 buffers reused from round to round.

Why: a round needs a flat copy of the caller's tensors and an accumulator per partition it reduces,
each tens or hundreds of megabytes. Allocated fresh, every one of them is a new mapping whose pages the
kernel must fault in and zero on first touch: measured here, that cost more per round than encrypting
the same bytes. Training averages tensors of the same sizes every round, so a few kept buffers make
those allocations free.

A buffer goes back to the pool only when nothing can read it any more (the round that used it retired
and no handler is still streaming from it); the pool keeps a bounded number and drops the rest.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class BufferPool:
    """Keeps up to ``keep`` released 1-D float32 buffers, by size, most recently released last."""

    def __init__(self, keep: int = 4) -> None:
        if keep < 0:
            raise ValueError("keep must not be negative")
        self.keep = keep
        self._free: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def take(self, numel: int) -> torch.Tensor:
        """A buffer of ``numel`` elements with arbitrary contents (a kept one when there is one)."""
        free = self._free.get(numel)
        if free:
            self._count -= 1
            t = free.pop()
            if not free:
                del self._free[numel]
            return t
        return torch.empty(numel, dtype=torch.float32)

    def give(self, t: torch.Tensor) -> None:
        """Release ``t``: the caller holds no view of it any more. Drops the oldest beyond ``keep``."""
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.numel() == 0:
            return
        self._free.setdefault(t.numel(), []).append(t)
        self._free.move_to_end(t.numel())
        self._count += 1
        while self._count > self.keep:
            size, free = next(iter(self._free.items()))
            free.pop(0)
            self._count -= 1
            if not free:
                del self._free[size]
