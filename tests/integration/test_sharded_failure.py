"""A rank of a 2-rank site dies (SIGKILL) or hangs (SIGSTOP: its process and its connections stay, it
answers nothing) in the middle of an outer round, while the site streams its contribution: rank 0's call
raises ``GroupRestarted`` (at once for the dead rank; for the hung one when the collective runs into the
group's timeout, an error the live node's ``SiteGroup.failure`` also takes for the group's), a new
generation of the group is up with a new process (the hung one killed), every rank reloads the site's
last checkpoint, so nothing of the failed round is anywhere, and the site goes on: the retried round
lands and the next checkpoint is written by the new group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2ptrain.averaging.compression import Compression
from p2ptrain.config import DilocoSection
from p2ptrain.training.site import checkpoint
from p2ptrain.training.site.commands import Command, Commands, Op
from p2ptrain.training.site.group import BACKEND_MARKS, GroupRestarted, SiteGroup
from p2ptrain.training.site.layout import WireLayout
from p2ptrain.training.site.outer import ShardedOuter, local_of
from p2ptrain.training.site.pieces import PieceChannel
from p2ptrain.training.site.wire import WireBuffer

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)
DIE, HANG = 1, 2  # CONTRIBUTE's c: the worker kills or stops itself (the test's own convention)
TIMEOUT = 15.0  # the group's collectives (a hung rank is found by it)


class State:
    def __init__(self, rank: int, world: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Linear(24, 8))
        fully_shard(self.model, mesh=init_device_mesh("cpu", (world,)))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        names = [n for n, _ in self.model.named_parameters()]
        self.layout = WireLayout(names, [p.shape for p in self.model.parameters()], world)
        channel = PieceChannel(self.layout, rank)
        self.outer = ShardedOuter(
            list(self.model.parameters()), self.layout, channel, DilocoSection(), Compression.NONE
        )
        self.every = range(len(names))
        self.rank = rank

    def resume(self, folder: Path) -> int:
        found = checkpoint.latest(folder)
        return checkpoint.load(found[1], self.model, self.opt, self.outer, self.layout) if found else 0

    def train(self, steps: int, seed: int) -> None:
        for k in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed * 100 + 10 * self.rank + k))
            (self.model(x) - x).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad()


def worker(rank: int, world: int, generation: int, commands: Commands, folder: str) -> None:
    st = State(rank, world)
    st.resume(Path(folder))
    while (cmd := commands.receive()).op is not Op.STOP:
        if cmd.op is Op.TRAIN:
            st.train(cmd.a, cmd.b)
        elif cmd.op is Op.CONTRIBUTE:
            if cmd.c and generation == 1:
                os.kill(os.getpid(), signal.SIGKILL if cmd.c == DIE else signal.SIGSTOP)
            st.outer.contribute(range(cmd.a, cmd.b), None)
        elif cmd.op is Op.LAND:
            st.outer.land(range(cmd.a, cmd.b), None, committed=bool(cmd.c))
        elif cmd.op is Op.SAVE:
            checkpoint.save(Path(folder), cmd.a, st.model, st.opt, st.outer, st.layout)


def rank0(folder: str, how: int) -> None:
    path = Path(folder)
    group = SiteGroup(2, worker, folder, timeout=TIMEOUT)
    group.start()
    st = State(0, 2)

    def round_(step: int, fail: int = 0) -> None:
        commands, n = group.commands, len(st.layout.names)  # (each generation has its own store)
        commands.send(Command(Op.TRAIN, 2, step))
        st.train(2, step)
        wire = WireBuffer(st.layout.total)
        commands.send(Command(Op.CONTRIBUTE, 0, n, fail))
        st.outer.contribute(st.every, wire)
        wire.flat.mul_(0.5)  # "the round's average"
        commands.send(Command(Op.LAND, 0, n, 1))
        st.outer.land(st.every, wire, committed=True)
        wire.close()
        commands.send(Command(Op.SAVE, step + 1))
        checkpoint.save(path, step + 1, st.model, st.opt, st.outer, st.layout)

    group.call(lambda: round_(0))
    kept = [local_of(g).clone() for g in st.outer.global_params]
    first = group.pids
    began = time.monotonic()
    with pytest.raises(GroupRestarted, match="generation 2 is up") as raised:
        group.call(lambda: round_(1, fail=how))
    assert group.generation == 2 and group.up and group.pids != first
    assert not process_exists(first[0])  # (the hung process too: killed, not left stopped)
    if how == HANG:  # found by the group's timeout, as a failure of the group (what a live node checks)
        assert time.monotonic() - began >= TIMEOUT * 0.9
        cause = raised.value.__cause__
        assert isinstance(cause, (RuntimeError, dist.DistError)), cause
        assert isinstance(cause, dist.DistError) or any(m in str(cause) for m in BACKEND_MARKS), cause
    st = State(0, 2)  # the old mesh belonged to the old group: shards rebuilt, the checkpoint reloaded
    assert group.call(lambda: st.resume(path)) == 1
    for g, k, p in zip(st.outer.global_params, kept, st.model.parameters(), strict=True):
        assert torch.equal(local_of(g), k)  # the failed round left nothing behind
        assert torch.equal(local_of(p), k)
    group.call(lambda: round_(1))  # the site goes on with the new group
    assert checkpoint.latest(path) is not None and checkpoint.latest(path)[0] == 2  # type: ignore[index]
    group.close(lambda: group.commands.send(Command(Op.STOP)))
    (path / "ok").write_text("ok")


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie that was reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("how", [DIE, HANG], ids=["killed", "hung"])
def test_a_rank_killed_or_hung_mid_round_restarts_the_group_and_nothing_of_the_round_is_left(
    tmp_path: Path, how: int
) -> None:
    p = mp.get_context("spawn").Process(target=rank0, args=(str(tmp_path), how))
    p.start()
    p.join(timeout=280)
    assert p.exitcode == 0, p.exitcode
    assert (tmp_path / "ok").read_text() == "ok"
