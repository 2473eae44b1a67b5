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

- Hashing, :meth:`ShardedState.hash_into` (collective): every chunk's hash on rank 0, and with a file
  every chunk's bytes in it (the snapshot rank 0 serves joiners). A chunk whose bytes all lie in one
  rank's shards (of a 70B model's DiLoCo state on 8 ranks, 98.4% of the chunks) is hashed by that rank, on
  threads, and written into rank 0's file by that rank itself where it can open it by its path (one
  machine, or a folder the machines share, as the site's checkpoints need); only a chunk split between
  ranks is assembled on rank 0 (:meth:`chunk`, 1 MiB from the ranks that hold its bytes). The bytes that
  cross to rank 0 are those of the split chunks, and a rank's own chunks where it cannot open rank 0's
  file: not every byte of the state, as when rank 0 assembled every chunk (at 70B that was 560 GB
  through one process at every change).
- Downloading, :meth:`ShardedState.place` (collective): rank 0 has checked a chunk against its hash on
  arrival (nothing unverified reaches a rank), then sends each rank its bytes, written straight into
  its shards.

Every rank holds its shards plus a few chunks' bytes: never the state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..state import chunks
from . import bounded
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
        self.received = 0  # state bytes this rank received from the others while hashing (rank 0's count)
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
                bounded.send(packed, dst=self._peer(0), group=self.group)
            return None
        out = bytearray(self.layout.chunk_size(i))
        view = memoryview(out)
        for r, theirs in sorted(parts.items()):
            if r == 0:
                for p in theirs:
                    view[p.offset : p.offset + p.hi - p.lo] = self._bytes(p).cpu().numpy().data
                continue
            buf = torch.empty(sum(p.hi - p.lo for p in theirs), dtype=torch.uint8, device=self.device)
            bounded.recv(buf, src=self._peer(r), group=self.group)
            self.received += buf.numel()
            data, at = buf.cpu().numpy().data, 0
            for p in theirs:
                view[p.offset : p.offset + p.hi - p.lo] = data[at : at + p.hi - p.lo]
                at += p.hi - p.lo
        return out

    def owner(self, i: int) -> int | None:
        """The rank whose shards hold every byte of chunk ``i``; None where it is split between ranks."""
        ranks = {p.rank for p in self.parts(i)}
        return ranks.pop() if len(ranks) == 1 else None

    def owners(self) -> list[int | None]:
        """Every chunk's :meth:`owner`, from the state's runs of one rank's bytes (each entry's rows by
        rank, adjacent runs of one rank merged) rather than chunk by chunk: O(entries x ranks + chunks)
        (at 70B, 538k chunks: chunk by chunk took 3.5 s of every hash on every rank)."""
        size, count, step = self.layout.size, self.layout.chunks, chunks.CHUNK
        runs: list[list[int]] = []  # [rank, begin, end) in the state's bytes
        for e, owned in zip(self.layout.entries, self._owned, strict=True):
            for r, lo, hi in owned:
                a, b = e.begin + lo, e.begin + hi
                if runs and runs[-1][0] == r and runs[-1][2] == a:
                    runs[-1][2] = b
                else:
                    runs.append([r, a, b])
        out: list[int | None] = [None] * count
        for r, a, b in runs:
            first = -(-a // step)  # the first chunk that starts in the run
            stop = count if b >= size else b // step  # (the last chunk may be short: it ends the state)
            if stop > first:
                out[first:stop] = [r] * (stop - first)
        return out

    def hashes(self) -> list[bytes] | None:
        """Collective: every chunk's hash, on rank 0 (:meth:`hash_into` without a file)."""
        return self.hash_into(None)

    def hash_into(self, path: str | None = None) -> list[bytes] | None:
        """Collective: every chunk's hash, on rank 0 (None on the others). ``path`` (rank 0's; the other
        ranks' is not read): an existing file rank 0 made, into which every chunk's bytes are written at
        ``i x CHUNK`` (a rank that can open it by that path writes its own chunks there: one machine, or a
        folder the machines share; the others send theirs to rank 0); None: hashed only. See the
        module's docstring for who hashes and writes what."""
        n = self.layout.chunks
        owners = self.owners()
        by_rank: dict[int | None, list[int]] = {}
        for i, r in enumerate(owners):
            by_rank.setdefault(r, []).append(i)
        name = self._broadcast((path or "").encode() if self.rank == 0 else b"").decode()
        mine = by_rank.get(self.rank, [])
        fd = -1
        if name and (mine or self.rank == 0):
            try:
                fd = os.open(name, os.O_WRONLY)
            except OSError:
                if self.rank == 0:
                    raise
        hashes: dict[int, bytes] = {}
        try:
            reach = self._all_gather(bytes([fd >= 0]))  # (which ranks write rank 0's file themselves)
            sends = [bool(name) and not r[0] for r in reach]
            # 1. the chunks split between ranks, assembled on rank 0 (the others send their bytes)
            split = by_rank.get(None, [])
            if self.rank == 0:

                def assembled(j: int) -> bytearray:
                    data = self.chunk(split[j])
                    assert data is not None  # (rank 0)
                    return data

                def written(j: int, data: bytes | bytearray) -> None:
                    if fd >= 0:
                        os.pwrite(fd, data, split[j] * chunks.CHUNK)

                hashes.update(zip(split, chunks.hash_each(len(split), assembled, written), strict=True))
            else:
                for i in split:
                    self.chunk(i)
            # 2. the chunks in one rank's shards, hashed by that rank, and written into rank 0's file by
            # it, or sent to rank 0 to write (one that cannot open it); rank 0 takes those afterwards
            hashes.update(self._hash_own(mine, fd, sends[self.rank]))
            if self.rank == 0:
                for r in range(1, self.world):
                    if not sends[r]:
                        continue
                    for i in by_rank.get(r, []):
                        buf = torch.empty(self.layout.chunk_size(i), dtype=torch.uint8, device=self.device)
                        bounded.recv(buf, src=self._peer(r), group=self.group)
                        self.received += buf.numel()
                        os.pwrite(fd, buf.cpu().numpy().data, i * chunks.CHUNK)
        finally:
            if fd >= 0:  # (closed before the hashes go: rank 0 reads the file once it has them all)
                os.close(fd)
        # 3. the hashes to rank 0 (32 bytes a chunk)
        if self.rank != 0:
            if mine:
                packed = torch.frombuffer(bytearray(b"".join(hashes[i] for i in mine)), dtype=torch.uint8)
                bounded.send(packed.to(self.device), dst=self._peer(0), group=self.group)
            return None
        for r in range(1, self.world):
            theirs = by_rank.get(r, [])
            if theirs:
                got = torch.empty(len(theirs) * chunks.HASH_BYTES, dtype=torch.uint8, device=self.device)
                bounded.recv(got, src=self._peer(r), group=self.group)
                raw = bytes(got.cpu().numpy())
                for k, i in enumerate(theirs):
                    hashes[i] = raw[k * chunks.HASH_BYTES : (k + 1) * chunks.HASH_BYTES]
        return [hashes[i] for i in range(n)]

    def _hash_own(self, mine: list[int], fd: int, send: bool) -> dict[int, bytes]:
        """The hashes of chunks ``mine`` (all in this rank's shards), on threads; each written at its
        place in the file open as ``fd`` (-1: none), or sent to rank 0 (``send``: this rank cannot open
        its file), one chunk at a time in order."""

        def pieces(i: int) -> list[memoryview]:
            return [self._bytes(p).cpu().numpy().data for p in self.parts(i)]

        def one(i: int) -> bytes:
            got = pieces(i)
            if fd >= 0:
                os.pwritev(fd, got, i * chunks.CHUNK)
            return chunks.hash_chunk(got)

        if send:  # (in order, on this thread: rank 0 receives them so)
            out = {}
            for i in mine:
                got = pieces(i)
                out[i] = chunks.hash_chunk(got)
                data = torch.frombuffer(bytearray().join(got), dtype=torch.uint8)  # (one copy)
                bounded.send(data.to(self.device), dst=self._peer(0), group=self.group)
            return out
        workers = chunks.hash_workers(len(mine))
        if workers == 1:
            return {i: one(i) for i in mine}
        with ThreadPoolExecutor(workers, thread_name_prefix="p2ptrain-hash") as pool:
            return dict(zip(mine, pool.map(one, mine), strict=True))

    def _all_gather(self, data: bytes) -> list[bytes]:
        """Collective: every rank's ``data`` (of one length on every rank), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [bytes(t.cpu().numpy()) for t in out]

    def _broadcast(self, data: bytes) -> bytes:
        """Collective: rank 0's ``data`` on every rank."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self._peer(0), group=self.group)
        if not int(size.item()):
            return b""
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=self._peer(0), group=self.group)
        return bytes(buf.cpu().numpy())

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
                bounded.recv(buf, src=self._peer(0), group=self.group)
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
            bounded.send(packed.to(self.device), dst=self._peer(r), group=self.group)
