"""Pieces of the wire vector, moved between the ranks that hold them and rank 0, which faces the swarm.

Theory of operation. Rank 0 puts the site's contribution on the wire and takes the average back, piece
by piece: a piece is a span of the flat wire vector (``layout``), a few MiB. For each piece every rank
that holds elements of it packs them (its runs, in flat order) into one tensor and sends it to rank 0,
which unpacks them into the piece; the averaged piece goes back the same way. Both sides know every
run's size from the layout, so nothing but values travels, and a piece is exact bits (point-to-point
``send``/``recv``: no sum of zeros that could turn -0.0 into 0.0).

Memory: rank 0 holds one piece and one packed run list at a time, every other rank one packed run list:
O(piece), whatever the model's size. Every rank must call :meth:`PieceChannel.gather` and
:meth:`PieceChannel.scatter` with the same spans in the same order (they are collectives of the site).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .layout import Run, WireLayout

Provide = Callable[[Run], torch.Tensor]
"""A rank's values of a run (``run.size`` elements, float32, on its device)."""
Consume = Callable[[Run, torch.Tensor], None]
"""What a rank does with a run's values (``run.size`` elements, float32)."""


class PieceChannel:
    """Moves pieces of the wire vector between this rank and rank 0 over the site's process group."""

    def __init__(
        self,
        layout: WireLayout,
        rank: int,
        *,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layout, self.rank, self.group = layout, rank, group
        self.device = torch.device(device)

    def _by_rank(self, lo: int, hi: int) -> dict[int, list[Run]]:
        out: dict[int, list[Run]] = {}
        for run in self.layout.within(lo, hi):
            out.setdefault(run.rank, []).append(run)
        return out

    def gather(self, lo: int, hi: int, provide: Provide, out: torch.Tensor | None) -> None:
        """Elements ``[lo, hi)`` from the ranks that hold them into ``out`` on rank 0 (``hi - lo``
        float32 elements, CPU); ``out`` is None on the other ranks."""
        runs = self._by_rank(lo, hi)
        if self.rank != 0:
            mine = runs.get(self.rank, [])
            if mine:
                packed = torch.cat([provide(run).reshape(-1) for run in mine]).to(self.device, torch.float32)
                dist.send(packed.contiguous(), dst=self._global(0), group=self.group)
            return
        assert out is not None and out.numel() == hi - lo, "rank 0 gathers into a piece of the span's size"
        for run in runs.get(0, []):
            out[run.lo - lo : run.hi - lo].copy_(provide(run).reshape(-1))
        for r, theirs in sorted(runs.items()):
            if r == 0:
                continue
            buf = torch.empty(sum(run.size for run in theirs), dtype=torch.float32, device=self.device)
            dist.recv(buf, src=self._global(r), group=self.group)
            at = 0
            for run in theirs:
                out[run.lo - lo : run.hi - lo].copy_(buf[at : at + run.size])
                at += run.size

    def scatter(self, lo: int, hi: int, values: torch.Tensor | None, consume: Consume) -> None:
        """Rank 0's ``values`` of ``[lo, hi)`` to the ranks that hold them; each rank's ``consume`` gets
        its runs' values (rank 0's own too). ``values`` is None on the other ranks."""
        runs = self._by_rank(lo, hi)
        if self.rank != 0:
            mine = runs.get(self.rank, [])
            if mine:
                buf = torch.empty(sum(run.size for run in mine), dtype=torch.float32, device=self.device)
                dist.recv(buf, src=self._global(0), group=self.group)
                at = 0
                for run in mine:
                    consume(run, buf[at : at + run.size])
                    at += run.size
            return
        assert values is not None and values.numel() == hi - lo, "rank 0 scatters a piece of the span's size"
        for r, theirs in sorted(runs.items()):
            if r == 0:
                continue
            packed = torch.cat([values[run.lo - lo : run.hi - lo] for run in theirs]).to(self.device)
            dist.send(packed, dst=self._global(r), group=self.group)
        for run in runs.get(0, []):
            consume(run, values[run.lo - lo : run.hi - lo].to(self.device))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
