"""What rank 0 tells the other ranks of its site to do next.

Theory of operation. Rank 0 alone talks to the swarm, so it alone knows when a round formed, whether it
committed, when to checkpoint or stop. Every other rank waits for its next command and then enters the
collectives the command names, in the same order as rank 0 (FSDP2's all-gathers in a batch, the pieces
of a round, DCP's writes): a site's ranks are in lockstep per command, so every collective is bounded by
the group's timeout. A command is four integers (no pickled objects: ``op`` and three arguments, checked
on arrival). With the site's store (what ``group.SiteGroup`` hands out) they go through it, and an idle
rank waits for the next one as long as rank 0 takes (minutes in a round, an evaluation), in slices of
``IDLE_WAIT``; without one they are an int64 broadcast over the process group, and an idle rank waits
at most the group's timeout.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store  # torch.distributed.Store, where mypy sees its type

IDLE_WAIT = datetime.timedelta(minutes=10)
"""One wait on the store for the next command; running out only means: wait again."""


class Op(enum.IntEnum):
    TRAIN = 1  # a: inner steps to take (a node's site: a batch, then inner step number a)
    CONTRIBUTE = 2  # a, b: the parameters [a, b) (a fragment) into rank 0's wire buffer (c: 1 keep aside)
    LAND = 3  # a, b: those parameters; c: 1 committed, 0 aborted, 2 committed carrying local progress
    STEP_ALONE = 4  # a, b: a step with no round
    SAVE = 5  # a: the step to checkpoint (the folder is the site's own)
    STOP = 6
    ALONE = 7  # a, b: CONTRIBUTE for a step alone (the residual goes in whole, uncompressed)
    SEED = 8  # a, b: the site's data seed (its high and low 31 bits); rank r draws from seed + r
    EVAL = 9  # the validation batches' forward passes
    LOAD = 10  # a: the step whose checkpoint every rank reads
    HASH = 11  # every chunk of the site's state assembled on rank 0 (its digest, its snapshot)
    PLACE = 12  # a: a downloaded chunk, verified by rank 0, into the ranks' staging shards
    ADOPT = 13  # the staged (downloaded) state becomes the site's: global, momentum, local parameters


LAND_CARRY = 2
"""LAND's ``c`` for a replayed step's result that carries the local progress (see ``peer.SiteState``)."""

BULK = frozenset({Op.SAVE, Op.LOAD, Op.HASH, Op.ADOPT})
"""Commands whose collectives wait on work that grows with each rank's shards of the whole state: a
checkpoint written or read, every chunk hashed, a download adopted. Every other command's collectives
wait on one batch, one piece of a round or one chunk."""

BYTES_PER_ELEMENT = 24
"""What a rank holds per element of its shards: the parameter, AdamW's two moments, the global
parameter, the outer momentum, top-k's residual (float32 each)."""

BULK_RATE = 50e6
"""The slowest a rank may get through its share of a bulk command, in bytes a second (a disk that
writes a checkpoint at 50 MB/s; hashing is faster)."""


@dataclass(frozen=True)
class Deadlines:
    """How long rank 0 waits in a collective for the other ranks, by the command it is part of.

    A collective waits for its slowest rank, so a rank that hangs (stopped, swapping, a deadlock) holds
    rank 0 until the collective's timeout: that timeout is how soon a site finds a hung rank and
    restarts its group. One timeout for everything is either too short for a checkpoint at 70B or far
    too long for a batch. So rank 0 bounds each command's collectives by what the command waits on:
    ``local`` (``--local-timeout``) for a batch, a round's pieces, a chunk; ``local`` plus the rank's
    state bytes at :data:`BULK_RATE` for a :data:`BULK` one. The other ranks keep the group's long
    timeout (they wait for rank 0, which may be busy in a round for minutes); rank 0 restarts them."""

    local: float
    shard_elements: int  # the largest shard of any rank

    def timeout(self, op: Op) -> float:
        if op in BULK:
            return self.local + self.shard_elements * BYTES_PER_ELEMENT / BULK_RATE
        return self.local


@dataclass(frozen=True)
class Command:
    op: Op
    a: int = 0
    b: int = 0
    c: int = 0


class Commands:
    """Rank 0 :meth:`send` s commands; every other rank :meth:`receive` s them, in order."""

    def __init__(
        self,
        rank: int,
        *,
        group: dist.ProcessGroup | None = None,
        device: str = "cpu",
        store: Store | None = None,
    ) -> None:
        self.rank, self.group, self.device, self.store = rank, group, device, store
        self.seq = 0

    def send(self, cmd: Command) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends a site's commands")
        if self.store is not None:
            self.store.set(f"site/cmd/{self.seq}", f"{int(cmd.op)},{cmd.a},{cmd.b},{cmd.c}")
            self.seq += 1
            return
        t = torch.tensor([int(cmd.op), cmd.a, cmd.b, cmd.c], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._src(), group=self.group)

    def receive(self) -> Command:
        if self.rank == 0:
            raise RuntimeError("rank 0 sends a site's commands")
        if self.store is not None:
            key = f"site/cmd/{self.seq}"
            while True:
                try:
                    self.store.wait([key], IDLE_WAIT)
                    break
                except dist.DistStoreError:  # a timeout: rank 0 is busy (a lost store raises otherwise)
                    continue
            self.seq += 1
            fields = self.store.get(key).decode("ascii", "replace").split(",")
            try:
                op, a, b, c = (int(x) for x in fields)
            except ValueError:
                raise RuntimeError(f"rank 0 sent a malformed command {fields!r}") from None
            return self._command(op, a, b, c)
        t = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._src(), group=self.group)
        op, a, b, c = (int(x) for x in t.tolist())
        return self._command(op, a, b, c)

    @staticmethod
    def _command(op: int, a: int, b: int, c: int) -> Command:
        try:
            return Command(Op(op), a, b, c)
        except ValueError:
            raise RuntimeError(f"rank 0 sent an unknown command {op}") from None

    def _src(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)
