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

On a GPU (``stage``, the default for a CUDA device) rank 0 assembles each piece on its device and moves
it between the device and the host in one copy through a piece-sized buffer in pinned (page-locked)
host memory, kept from piece to piece: one DMA transfer per piece instead of one pageable copy per run,
and no host memory of the model's size beyond the wire buffer the piece comes from or goes to (a mapped
file, see ``wire``). The pinned and device buffers are the piece's size: a few MiB, whatever the model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import bounded
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
        stage: bool | None = None,
    ) -> None:
        """``stage``: rank 0 moves each piece between the device and the host in one copy through a
        pinned buffer (default: on a CUDA device; on the CPU it is a plain buffer, for tests)."""
        self.layout, self.rank, self.group = layout, rank, group
        self.device = torch.device(device)
        self.stage = self.device.type == "cuda" if stage is None else stage
        self._host: torch.Tensor | None = None  # rank 0, staged: the pinned piece buffer
        self._dev: torch.Tensor | None = None  # rank 0, staged: the piece on the device
        self._copied: Any = None  # the last host-to-device copy from ``_host`` (a CUDA event)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory this channel holds (0 unless staged on a GPU)."""
        host = self._host
        return host.numel() * 4 if host is not None and host.is_pinned() else 0

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0, staged: the pinned host buffer and the device buffer, ``n`` elements of each (kept
        and grown to the largest piece seen)."""
        if self._host is None or self._host.numel() < n:
            self._wait_copied()
            pin = self.device.type == "cuda"
            self._host = torch.empty(n, dtype=torch.float32, pin_memory=pin)
            self._dev = torch.empty(n, dtype=torch.float32, device=self.device)
        assert self._dev is not None
        return self._host[:n], self._dev[:n]

    def _wait_copied(self) -> None:
        """The host buffer may be written again: the last copy out of it has finished."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _to_host(self, dev: torch.Tensor, out: torch.Tensor) -> None:
        host, _ = self._buffers(dev.numel())
        self._wait_copied()
        host.copy_(dev, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        out.copy_(host)

    def _to_device(self, values: torch.Tensor) -> torch.Tensor:
        host, dev = self._buffers(values.numel())
        self._wait_copied()
        host.copy_(values)
        dev.copy_(host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record(torch.cuda.current_stream(self.device))
        return dev

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
                bounded.send(packed.contiguous(), dst=self._global(0), group=self.group)
            return
        assert out is not None and out.numel() == hi - lo, "rank 0 gathers into a piece of the span's size"
        into = self._buffers(hi - lo)[1] if self.stage else out  # (staged: the piece on the device)
        for run in runs.get(0, []):
            into[run.lo - lo : run.hi - lo].copy_(provide(run).reshape(-1))
        for r, theirs in sorted(runs.items()):
            if r == 0:
                continue
            buf = torch.empty(sum(run.size for run in theirs), dtype=torch.float32, device=self.device)
            bounded.recv(buf, src=self._global(r), group=self.group)
            at = 0
            for run in theirs:
                into[run.lo - lo : run.hi - lo].copy_(buf[at : at + run.size])
                at += run.size
        if self.stage:
            self._to_host(into, out)

    def scatter(self, lo: int, hi: int, values: torch.Tensor | None, consume: Consume) -> None:
        """Rank 0's ``values`` of ``[lo, hi)`` to the ranks that hold them; each rank's ``consume`` gets
        its runs' values (rank 0's own too), valid during the call only. ``values`` is None on the other
        ranks."""
        runs = self._by_rank(lo, hi)
        if self.rank != 0:
            mine = runs.get(self.rank, [])
            if mine:
                buf = torch.empty(sum(run.size for run in mine), dtype=torch.float32, device=self.device)
                bounded.recv(buf, src=self._global(0), group=self.group)
                at = 0
                for run in mine:
                    consume(run, buf[at : at + run.size])
                    at += run.size
            return
        assert values is not None and values.numel() == hi - lo, "rank 0 scatters a piece of the span's size"
        if self.stage:  # (the piece on the device in one copy; then every move is the device's)
            values = self._to_device(values)
        for r, theirs in sorted(runs.items()):
            if r == 0:
                continue
            packed = torch.cat([values[run.lo - lo : run.hi - lo] for run in theirs]).to(self.device)
            bounded.send(packed, dst=self._global(r), group=self.group)
        for run in runs.get(0, []):
            consume(run, values[run.lo - lo : run.hi - lo].to(self.device))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)
