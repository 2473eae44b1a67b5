"""The wire layout of a model, and where each rank of a site holds its part of it.

Theory of operation. What a peer puts on the wire is one flat float32 vector: its trainable parameters
in ``named_parameters`` order, each flattened row-major (``optimizer.buffers.ParamBuffer``). Chunking,
digests, the round's partitions and top-k's block grid all count elements of that vector, so it must not
depend on how a peer holds its model. A site shards with FSDP2, which chunks every parameter on dim 0
across its N ranks (``torch.chunk``: ``ceil(rows / N)`` rows each, the last ranks fewer or none). Rows
are contiguous in row-major order, so each rank's part of a parameter is one contiguous run of the flat
vector, and all of a rank's parts are a sorted list of runs.

:class:`WireLayout` is that map, pure arithmetic on names, shapes and N (no process group): it says, for
any span of the flat vector (a *piece*), which rank holds which elements and where they are in that
rank's local shards. Every rank computes the same layout from the same model, so ranks agree on the
sizes of what they exchange without telling each other.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Run:
    """Elements ``[lo, hi)`` of the flat vector: parameter ``param``'s local elements ``[at, at + hi - lo)``
    on rank ``rank``."""

    rank: int
    param: int
    lo: int
    hi: int
    at: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def rows_of(rows: int, world: int, rank: int) -> range:
    """The dim-0 rows FSDP2 gives ``rank`` of ``world`` (``torch.chunk``'s split)."""
    per = -(-rows // world) if rows else 0
    lo = min(rank * per, rows)
    return range(lo, min(lo + per, rows))


class WireLayout:
    """The flat wire order of parameters of ``shapes``, and which of ``world`` ranks holds each element."""

    def __init__(
        self, names: Sequence[str], shapes: Sequence[torch.Size | tuple[int, ...]], world: int
    ) -> None:
        if world < 1:
            raise ValueError("a site has at least one rank")
        if len(names) != len(shapes):
            raise ValueError("one name per shape")
        self.names, self.world = list(names), world
        self.shapes = [torch.Size(s) for s in shapes]
        for name, shape in zip(self.names, self.shapes, strict=True):
            if len(shape) == 0:
                raise ValueError(f"parameter {name} is a scalar: FSDP2 shards parameters on dim 0")
        self.numels = [s.numel() for s in self.shapes]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        # every rank's runs, sorted by ``lo``; ``_all`` merges them (sorted, disjoint, covering)
        self.runs: list[list[Run]] = [[] for _ in range(world)]
        for i, s in enumerate(self.shapes):
            row = s.numel() // s[0] if s[0] else 0
            for r in range(world):
                rows = rows_of(s[0], world, r)
                if len(rows) and row:  # (no empty runs: they would tie with real ones in within())
                    lo = self.offsets[i] + rows.start * row
                    self.runs[r].append(Run(r, i, lo, lo + len(rows) * row, 0))
        self._all = sorted((run for rs in self.runs for run in rs), key=lambda x: x.lo)
        self._starts = [run.lo for run in self._all]

    def local_shape(self, param: int, rank: int) -> torch.Size:
        """The shape of ``rank``'s shard of parameter ``param`` (what ``DTensor.to_local`` returns)."""
        s = self.shapes[param]
        return torch.Size((len(rows_of(s[0], self.world, rank)), *s[1:]))

    def shard_numel(self, rank: int) -> int:
        """The elements ``rank`` holds of the whole flat vector."""
        return sum(run.size for run in self.runs[rank])

    def check_local(self, rank: int, locals_: Sequence[torch.Tensor]) -> None:
        """ValueError unless ``locals_`` (the rank's shards, one per parameter) fit this layout."""
        if len(locals_) != len(self.shapes):
            raise ValueError(f"{len(locals_)} shards for {len(self.shapes)} parameters")
        for i, t in enumerate(locals_):
            if t.shape != self.local_shape(i, rank):
                raise ValueError(
                    f"rank {rank}'s shard of {self.names[i]} is {tuple(t.shape)}, the layout says"
                    f" {tuple(self.local_shape(i, rank))}: not FSDP2's dim-0 chunks over {self.world} ranks"
                )

    def within(self, lo: int, hi: int) -> list[Run]:
        """The runs of all ranks that cover ``[lo, hi)``, cut to it (``at`` moved along), in flat order."""
        if not 0 <= lo <= hi <= self.total:
            raise ValueError(f"[{lo}, {hi}) is not within the {self.total} elements of the layout")
        out: list[Run] = []
        k = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while k < len(self._all) and self._all[k].lo < hi:
            run = self._all[k]
            a, b = max(run.lo, lo), min(run.hi, hi)
            if a < b:
                out.append(Run(run.rank, run.param, a, b, run.at + a - run.lo))
            k += 1
        return out

    def pieces(self, lo: int, hi: int, size: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` in consecutive spans of ``size`` elements counted from ``lo`` (the last shorter)."""
        if size < 1:
            raise ValueError("a piece has at least one element")
        return [(a, min(a + size, hi)) for a in range(lo, hi, size)]
