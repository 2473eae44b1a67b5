"""Float32 buffers reused from round to round.

Why: a round needs a flat copy of the caller's tensors and an accumulator per partition it reduces,
each tens or hundreds of megabytes. Allocated fresh, every one of them is a new mapping whose pages the
kernel must fault in and zero on first touch: measured here, that cost more per round than encrypting
the same bytes. Training averages tensors of the same sizes every round, so a few kept buffers make
those allocations free.

Sizes are not quite the same every round, though: a partition follows its reducer's measured bandwidth,
which moves by a few percent. So a buffer is handed out as a view of the first ``numel`` elements of a
kept buffer at least that large (the best fit, at most twice the size), and a new buffer is allocated
with ``HEADROOM`` to spare: pages never touched cost no memory, and next round's slightly larger
partition still fits.

A buffer goes back to the pool only when nothing can read it any more (the round that used it retired
and no handler is still streaming from it); the pool keeps a bounded number and drops the rest.
"""

from __future__ import annotations

import torch

HEADROOM = 1.25
"""A new buffer has room for this many times the elements asked for."""


class BufferPool:
    """Keeps up to ``keep`` released 1-D float32 buffers, most recently released last."""

    def __init__(self, keep: int = 4) -> None:
        if keep < 0:
            raise ValueError("keep must not be negative")
        self.keep = keep
        self._free: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._free)

    @property
    def idle(self) -> list[torch.Tensor]:
        """The buffers waiting to be taken again (oldest first)."""
        return list(self._free)

    def take(self, numel: int) -> torch.Tensor:
        """``numel`` elements with arbitrary contents: the start of the smallest kept buffer that holds
        them and is at most twice their size, else of a new one."""
        fits = [i for i, t in enumerate(self._free) if numel <= t.numel() <= 2 * numel]
        if fits:
            base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            base = torch.empty(int(numel * HEADROOM) if numel else 0, dtype=torch.float32)
        return base[:numel]

    def give(self, t: torch.Tensor) -> None:
        """Release ``t`` (as :meth:`take` handed it out, or a whole buffer): the caller holds no view of
        it any more. Drops the oldest beyond ``keep``."""
        base = t if t._base is None else t._base
        if base.dtype != torch.float32 or base.dim() != 1 or not base.is_contiguous() or base.numel() == 0:
            return
        if not t.is_contiguous() or t.data_ptr() != base.data_ptr():  # not a view take() hands out
            return
        self._free.append(base)
        while len(self._free) > self.keep:
            self._free.pop(0)
