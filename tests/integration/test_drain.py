"""Draining a training node (what ``p2ptrain node`` does on SIGTERM), among in-process peers.

What is proved here: a Trainer told to stop while its group forms, or the moment it formed (whether it
coordinates the round or not; in sync mode and in DiLoCo with and without overlap), first finishes that
round: every member commits it with both contributions and holds the same bits, the stopping peer's
last checkpoint holds the state after the round, and only then does it say it leaves and exit. A drain
whose group hangs ends within ``Trainer.drain_timeout``, with nothing applied.

Each peer runs as ``p2ptrain node`` does (see ``cli.train._train``): a stop request with a deadline on
the training, then serving the round's last fetches, then the process is gone (its connections reset).
The peers compute inline on the virtual clock (``COMPUTE`` seconds a batch) rather than in threads, so
that time only moves when every peer waits on the network or a timer; links have a little latency, so
that forming a group and running a round take longer than a batch.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.allreduce import AllReduceRound
from p2ptrain.averaging.protocol import SignedManifest
from p2ptrain.config import RunConfig
from p2ptrain.net import MemoryNetwork
from p2ptrain.net.memory import LinkProfile
from p2ptrain.tasks import Task
from p2ptrain.training.loop.trainer import Trainer, TrainerOptions
from p2ptrain.training.state import checkpoint, serve
from tests.harness.identities import identity

pytestmark = pytest.mark.timeout(60)

RUN = "drain"
PORT = 4000
BATCH = 8
TARGET = 48
COMPUTE = 0.05  # virtual seconds a batch takes
LATENCY = 0.1  # one way, on every link
DEADLINE = 120.0  # virtual seconds any one test may take


def run_config(mode: str, overlap: bool = False) -> RunConfig:
    return (
        RunConfig()
        .replace("run", id=RUN)
        .replace(
            "training",
            mode=mode,
            batch_size=BATCH,
            target_batch_size=TARGET,
            warmup_steps=0,
            lr=0.01,
            grad_clip=0.0,
        )
        .replace("diloco", overlap=overlap)
        .replace("averaging", timeout=10.0, matchmaking_time=2.0)
        .replace("progress", interval=0.5, ttl=3.0)
        .replace("checkpoint", every_steps=0)
    )


def make_task() -> Task:
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def batches(seed: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, 4, generator=gen)
            yield x, x.sum(1, keepdim=True)

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    return Task("drain-test", model, batches, loss)


@pytest.fixture(autouse=True)
def compute_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's worker-thread calls run in the event loop and take ``COMPUTE`` virtual seconds: a
    thread would let the autojumping clock run while it computes."""

    async def run_sync(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        result = fn(*args)
        await trio.sleep(COMPUTE)
        return result

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


@dataclass
class Member:
    name: str
    node: Node
    trainer: Trainer
    folder: Path
    training: trio.CancelScope = field(default_factory=trio.CancelScope)
    exited: trio.Event = field(default_factory=trio.Event)
    stop_at: float | None = None
    returned_at: float | None = None

    def stop(self) -> None:
        """As ``p2ptrain node`` on SIGTERM: drain, cut short after a grace."""
        self.stop_at = trio.current_time()
        self.trainer.request_stop()
        self.training.deadline = self.stop_at + self.trainer.drain_timeout + 30.0

    def last_checkpoint(self) -> int:
        """The newest checkpoint's step, once checked to hold exactly the state this peer holds now."""
        found = checkpoint.latest(self.folder)
        assert found is not None, f"{self.name} wrote no checkpoint"
        step, tensors, _, _ = found
        live, _ = self.trainer.opt.capture()
        assert tensors.keys() == live.keys(), self.name
        assert all(torch.equal(tensors[k], live[k]) for k in live), f"{self.name}: not the state it holds"
        return step


class Swarm:
    def __init__(self, nursery: trio.Nursery, config: RunConfig, tmp: Path) -> None:
        self.nursery, self.config, self.tmp = nursery, config, tmp
        self.net = MemoryNetwork(default=LinkProfile(latency=LATENCY), seed=7)
        self.members: list[Member] = []

    async def start(self, *, max_steps: int | None = None, metrics: bool = False) -> Member:
        name = f"d{len(self.members)}"
        node_config = NodeConfig(
            run_id=RUN,
            listen=((name, PORT),),
            join=(self.members[0].node.addresses[0],) if self.members else (),
            averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
        )
        node = Node(identity(name), node_config, transport=self.net.transport(name), clock=trio.current_time)
        options = TrainerOptions(
            data_dir=self.tmp / name,
            max_steps=max_steps,
            wait_peers=2,
            wait_timeout=30,
            metrics_file=self.tmp / f"{name}.jsonl" if metrics else None,
        )
        trainer = Trainer(node, self.config, make_task(), options, clock=trio.current_time)
        m = Member(name, node, trainer, self.tmp / name / "checkpoints")
        self.members.append(m)
        await self.nursery.start(self._process, m)
        return m

    async def _process(
        self, m: Member, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """One ``p2ptrain node`` process (see ``cli.train._train``)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(m.node.run)
            task_status.started()
            with m.training:
                await m.trainer.run()
            m.returned_at = trio.current_time()
            if not m.training.cancelled_caught:
                with trio.move_on_after(self.config.averaging.timeout):
                    await m.node.averager.wait_idle()  # slower members may still fetch from us
            nursery.cancel_scope.cancel()
        self.net.kill(m.name)  # the process is gone
        m.exited.set()

    def on_groups(self, react: Callable[[Member, SignedManifest | None], None]) -> None:
        """Call ``react(member, None)`` when a member starts forming a group, and ``react(member,
        manifest)`` the moment its group formed (before the optimizer sees it)."""
        for m in self.members:
            real = m.node.averager.form_group

            async def form_group(
                *args: Any, _m: Member = m, _real: Any = real, **kwargs: Any
            ) -> SignedManifest:
                react(_m, None)
                manifest: SignedManifest = await _real(*args, **kwargs)
                react(_m, manifest)
                return manifest

            m.node.averager.form_group = form_group  # type: ignore[method-assign]

    def member(self, peer: object) -> Member:
        return next(m for m in self.members if m.node.peer_id == peer)


@asynccontextmanager
async def swarm(config: RunConfig, tmp: Path) -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        s = Swarm(nursery, config, tmp)
        yield s
        nursery.cancel_scope.cancel()


MODES = [("sync", False), ("diloco", False), ("diloco", True)]
MODE_IDS = ["sync", "diloco", "diloco-overlap"]


@pytest.mark.parametrize(("mode", "overlap"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("when", ["forming", "formed-coordinator", "formed-member"])
async def test_a_stopping_peer_finishes_its_round_on_every_member_then_checkpoints(
    autojump_clock: object, tmp_path: Path, mode: str, overlap: bool, when: str
) -> None:
    async with swarm(run_config(mode, overlap), tmp_path) as s:
        peers = [await s.start(max_steps=1) for _ in range(2)]  # both stop at step 1 at the latest
        stopped: list[Member] = []

        def react(m: Member, manifest: SignedManifest | None) -> None:
            if stopped or (manifest is None) != (when == "forming"):
                return
            if manifest is not None:  # the round's coordinator is the manifest's first member
                coordinator = s.member(manifest.manifest.peers()[0])
                other = next(p for p in peers if p is not coordinator)
                m = coordinator if when == "formed-coordinator" else other
            stopped.append(m)
            m.stop()

        s.on_groups(react)
        with trio.fail_after(DEADLINE):
            for p in peers:
                await p.exited.wait()

        assert len(stopped) == 1
        stopper = stopped[0]
        for p in peers:  # every member took the step, averaged with both contributions
            stats = p.trainer.opt.stats
            got = (p.trainer.opt.epoch, stats.averaged, stats.solo, stats.aborted)
            assert got == (1, 1, 0, 0), (p.name, "epoch, averaged, solo, aborted", got, stats.last)
            assert stats.last["contributors"] == 2, (p.name, stats.last)
            assert p.trainer.finished
        assert peers[0].trainer.opt.digest == peers[1].trainer.opt.digest
        # The stopping peer checkpointed the state after the round, then said it leaves; no cut needed.
        assert [p.last_checkpoint() for p in peers] == [1, 1]
        assert stopper.trainer.opt.leaving and not stopper.training.cancelled_caught
        assert stopper.stop_at is not None and stopper.returned_at is not None
        assert stopper.returned_at - stopper.stop_at <= stopper.trainer.drain_timeout


@pytest.mark.parametrize(("mode", "overlap"), MODES, ids=MODE_IDS)
async def test_a_drain_whose_group_hangs_ends_within_the_drain_timeout(
    autojump_clock: object, tmp_path: Path, mode: str, overlap: bool
) -> None:
    async with swarm(run_config(mode, overlap), tmp_path) as s:
        peers = [await s.start() for _ in range(2)]
        roles: list[Member] = []  # the stopper, then the hung coordinator
        chosen = trio.Event()

        async def freeze(rnd: AllReduceRound, point: str) -> None:
            await trio.sleep_forever()  # its connections stay open; it answers nothing of the round

        def react(m: Member, manifest: SignedManifest | None) -> None:
            # The coordinator hangs (a hung member would be left out and the round would commit without
            # it): whichever peer led, it freezes before its round starts, and the other one stops.
            if manifest is not None and not roles:
                hung = s.member(manifest.manifest.peers()[0])
                hung.node.averager.fault = freeze
                roles.extend([next(p for p in peers if p is not hung), hung])
                roles[0].stop()
                chosen.set()

        s.on_groups(react)
        with trio.fail_after(DEADLINE):
            await chosen.wait()
            stopper = roles[0]
            await stopper.exited.wait()

        assert stopper.stop_at is not None and stopper.returned_at is not None
        leave = 5.0  # CollaborativeOptimizer.leave's own bound
        assert stopper.returned_at - stopper.stop_at <= stopper.trainer.drain_timeout + leave
        assert not stopper.training.cancelled_caught  # the drain ended by itself, before the grace
        stats = stopper.trainer.opt.stats
        assert (stopper.trainer.opt.epoch, stats.averaged, stats.aborted) == (0, 0, 1)
        assert stopper.last_checkpoint() == 0  # nothing half applied


async def test_a_restarted_peer_trusts_the_partners_its_checkpoint_remembers(
    autojump_clock: object, tmp_path: Path
) -> None:
    """The swarm's first peer has no join address: after a restart, the partners its checkpoint names
    are whom it may follow to a later state (a fresh key's far-ahead record moves it nowhere)."""
    async with swarm(run_config("sync"), tmp_path) as s:
        first, second = [await s.start(max_steps=1) for _ in range(2)]
        with trio.fail_after(DEADLINE):
            for p in (first, second):
                await p.exited.wait()
        assert first.trainer.opt.stats.averaged == 1
        node = Node(identity(first.name), first.node.config, transport=s.net.transport("again"))
        options = TrainerOptions(data_dir=tmp_path / first.name)
        again = Trainer(node, s.config, make_task(), options, clock=trio.current_time)
        assert again.opt.trusted() == frozenset()  # nothing resumed, nobody connected: no anchor at all
        assert again.resume()
        assert again.opt.trusted() == {second.node.peer_id}


async def test_a_stopping_peer_names_the_digest_of_a_state_hashed_in_a_thread(
    autojump_clock: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large state is hashed in a worker thread after each step, its digest "" meanwhile: the final
    metrics line, written as the peer stops right after its last step, named "" (and ``simulate`` took
    such peers for diverged: "parameters identical: False" in about one run of the README's in two)."""
    monkeypatch.setattr(serve, "THREAD_BYTES", 1)  # every state is large ...
    async with swarm(run_config("sync"), tmp_path) as s:
        peers = [await s.start(max_steps=2, metrics=True) for _ in range(2)]
        for p in peers:  # ... and takes a while to hash (about 3 s for the built-in GPT on 2 cores)
            real = p.trainer.opt.shared.hash_in_thread

            async def slowly(*args: Any, _real: Any = real) -> None:
                await trio.sleep(3.0)
                await _real(*args)

            p.trainer.opt.shared.hash_in_thread = slowly  # type: ignore[method-assign]
        with trio.fail_after(DEADLINE):
            for p in peers:
                await p.exited.wait()
    finals = [json.loads((tmp_path / f"{p.name}.jsonl").read_text().splitlines()[-1]) for p in peers]
    assert [f["event"] for f in finals] == ["stopped", "stopped"]
    assert [f["step"] for f in finals] == [2, 2]
    assert finals[0]["digest"] and finals[0]["digest"] == finals[1]["digest"], finals
    assert finals[0]["digest"] == peers[0].trainer.opt.digest.hex()[:16]
