"""A site's state in the swarm's chunked format: served from its ranks' shards, downloaded into them.

Theory of operation. Peers publish the root of their state (``state.chunks``): the state's tensors,
sorted by name and laid back to back, cut into 1 MiB chunks, each hashed. A site must publish the root
an unsharded peer with the same state would, serve the same chunks, and take a download straight into
its ranks' shards, whatever N the donor or the joiner has. :class:`ShardedState` gives the chunk layout
of the full tensors (names, dtypes, full shapes: ``chunks.Layout`` of meta tensors, no data) and maps
each chunk's bytes to the ranks that hold them: a tensor sharded like the model (FSDP2's dim-0 rows) is
held by rank r as bytes ``[rows.start x row_bytes, rows.stop x row_bytes)``; a tensor of no rows (a
0-d value) by rank 0. Bytes, not elements, so chunk boundaries that cut a value in two and tensors of
any dtype need nothing special.

- Serving, :meth:`ShardedState.chunk` (collective): the ranks send their bytes of chunk i to rank 0,
  which assembles the chunk (1 MiB) to hash or send; :meth:`hashes` walks all chunks for the root.
- Downloading, :meth:`ShardedState.place` (collective): rank 0 has checked a chunk against its hash on
  arrival (nothing unverified reaches a rank), then sends each rank its bytes, written straight into
  its shards.

Every rank holds its shards plus one chunk's bytes: never the state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..state import chunks
from .layout import rows_of


@dataclass(frozen=True)
class Part:
    """Bytes ``[lo, hi)`` of entry ``index`` (of the full tensor): rank ``rank``'s local bytes from ``at``;
    ``offset``: where they sit in the chunk."""

    rank: int
    index: int
    lo: int
    hi: int
    at: int
    offset: int


class ShardedState:
    """This rank's shards of a state's tensors, and the site's chunks of the full state."""

    def __init__(
        self,
        shards: Mapping[str, torch.Tensor],
        shapes: Mapping[str, Sequence[int]],
        rank: int,
        world: int,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """``shards``: each tensor's local part (its dim-0 rows for this rank; a 0-d tensor whole, read on
        rank 0 only); ``shapes``: the full shapes."""
        if shards.keys() != shapes.keys():
            raise ValueError("one full shape per shard")
        self.rank, self.world, self.group = rank, world, group
        meta = {n: torch.empty(tuple(shapes[n]), dtype=shards[n].dtype, device="meta") for n in shards}
        self.layout = chunks.Layout.of(meta)
        self.local: list[torch.Tensor] = []
        self._owned: list[
            list[tuple[int, int, int]]
        ] = []  # per entry: (rank, lo, hi) bytes of the full tensor
        for e in self.layout.entries:
            t = shards[e.name].detach()
            if not t.is_contiguous():
                raise ValueError(f"the shard of {e.name} is not contiguous")
            elsize = t.element_size()
            if len(e.shape) == 0:
                self._owned.append([(0, 0, elsize)])
                expected: tuple[int, ...] = ()
            else:
                row = elsize * (torch.Size(e.shape).numel() // e.shape[0] if e.shape[0] else 0)
                owned = []
                for r in range(world):
                    rows = rows_of(e.shape[0], world, r)
                    if len(rows):
                        owned.append((r, rows.start * row, rows.stop * row))
                self._owned.append(owned)
                mine = rows_of(e.shape[0], world, rank)
                expected = (len(mine), *e.shape[1:])
            if tuple(t.shape) != expected and not (len(e.shape) == 0 and rank != 0):
                raise ValueError(f"rank {rank}'s shard of {e.name} is {tuple(t.shape)}, expected {expected}")
            self.local.append(t)
        # (what travels between ranks is on the shards' device: NCCL moves GPU tensors only)
        self.device = self.local[0].device if self.local else torch.device("cpu")

    def parts(self, i: int) -> list[Part]:
        """Chunk ``i``'s bytes by the ranks that hold them, in chunk order."""
        out: list[Part] = []
        for span in self.layout.spans(i):
            for r, lo, hi in self._owned[span.index]:
                a, b = max(span.lo, lo), min(span.hi, hi)
                if a < b:
                    out.append(Part(r, span.index, a, b, a - lo, span.offset + a - span.lo))
        return out

    def _bytes(self, part: Part) -> torch.Tensor:
        raw = self.local[part.index].reshape(-1).view(torch.uint8)
        return raw[part.at : part.at + part.hi - part.lo]

    def _by_rank(self, i: int) -> dict[int, list[Part]]:
        out: dict[int, list[Part]] = {}
        for p in self.parts(i):
            out.setdefault(p.rank, []).append(p)
        return out

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def chunk(self, i: int) -> bytearray | None:
        """Collective: chunk ``i`` of the full state, assembled on rank 0 (None on the other ranks)."""
        parts = self._by_rank(i)
        if self.rank != 0:
            mine = parts.get(self.rank, [])
            if mine:
                packed = torch.cat([self._bytes(p).to(self.device) for p in mine])
                dist.send(packed, dst=self._peer(0), group=self.group)
            return None
        out = bytearray(self.layout.chunk_size(i))
        view = memoryview(out)
        for r, theirs in sorted(parts.items()):
            if r == 0:
                for p in theirs:
                    view[p.offset : p.offset + p.hi - p.lo] = self._bytes(p).cpu().numpy().data
                continue
            buf = torch.empty(sum(p.hi - p.lo for p in theirs), dtype=torch.uint8, device=self.device)
            dist.recv(buf, src=self._peer(r), group=self.group)
            data, at = buf.cpu().numpy().data, 0
            for p in theirs:
                view[p.offset : p.offset + p.hi - p.lo] = data[at : at + p.hi - p.lo]
                at += p.hi - p.lo
        return out

    def hashes(self) -> list[bytes] | None:
        """Collective: every chunk's hash, on rank 0 (a chunk at a time)."""
        out = []
        for i in range(self.layout.chunks):
            data = self.chunk(i)
            if data is not None:
                out.append(chunks.hash_chunk([data]))
        return out if self.rank == 0 else None

    def root(self, epoch: int) -> bytes | None:
        """Collective: the root an unsharded peer with this state publishes at ``epoch`` (on rank 0)."""
        hashes = self.hashes()
        return chunks.root(epoch, self.layout, hashes) if hashes is not None else None

    def place(self, i: int, data: bytes | bytearray | memoryview | None) -> None:
        """Collective: chunk ``i``'s bytes, verified by rank 0 (``data``; None on the other ranks), into
        the shards of the ranks that hold them."""
        parts = self._by_rank(i)
        if self.rank != 0:
            mine = parts.get(self.rank, [])
            if mine:
                buf = torch.empty(sum(p.hi - p.lo for p in mine), dtype=torch.uint8, device=self.device)
                dist.recv(buf, src=self._peer(0), group=self.group)
                at = 0
                for p in mine:
                    self._bytes(p).copy_(buf[at : at + p.hi - p.lo])
                    at += p.hi - p.lo
            return
        if data is None or len(data) != self.layout.chunk_size(i):
            raise ValueError(f"chunk {i} is {self.layout.chunk_size(i)} bytes")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for r, theirs in sorted(parts.items()):
            if r == 0:
                for p in theirs:
                    self._bytes(p).copy_(raw[p.offset : p.offset + p.hi - p.lo])
                continue
            packed = torch.cat([raw[p.offset : p.offset + p.hi - p.lo] for p in theirs])
            dist.send(packed.to(self.device), dst=self._peer(r), group=self.group)
