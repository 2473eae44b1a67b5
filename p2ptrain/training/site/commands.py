"""What rank 0 tells the other ranks of its site to do next.

Theory of operation. Rank 0 alone talks to the swarm, so it alone knows when a round formed, whether it
committed, when to checkpoint or stop. Every other rank waits for its next command and then enters the
collectives the command names, in the same order as rank 0 (FSDP2's all-gathers in a batch, the pieces
of a round, DCP's writes): a site's ranks are in lockstep per command, so every collective is bounded by
the group's timeout. A command is four int64 values broadcast over the site's process group (no pickled
objects: ``op`` and three integer arguments, checked on arrival).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist


class Op(enum.IntEnum):
    TRAIN = 1  # a: inner steps to take
    CONTRIBUTE = 2  # a, b: the parameters [a, b) (a fragment) into rank 0's wire buffer
    LAND = 3  # a, b: those parameters; c: 1 committed, 0 aborted
    STEP_ALONE = 4  # a, b: a step with no round
    SAVE = 5  # a: the step to checkpoint (the folder is the site's own)
    STOP = 6


@dataclass(frozen=True)
class Command:
    op: Op
    a: int = 0
    b: int = 0
    c: int = 0


class Commands:
    """Rank 0 :meth:`send` s commands; every other rank :meth:`receive` s them, in order."""

    def __init__(self, rank: int, *, group: dist.ProcessGroup | None = None, device: str = "cpu") -> None:
        self.rank, self.group, self.device = rank, group, device

    def send(self, cmd: Command) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends a site's commands")
        t = torch.tensor([int(cmd.op), cmd.a, cmd.b, cmd.c], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._src(), group=self.group)

    def receive(self) -> Command:
        if self.rank == 0:
            raise RuntimeError("rank 0 sends a site's commands")
        t = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=self._src(), group=self.group)
        op, a, b, c = (int(x) for x in t.tolist())
        try:
            return Command(Op(op), a, b, c)
        except ValueError:
            raise RuntimeError(f"rank 0 sent an unknown command {op}") from None

    def _src(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)
