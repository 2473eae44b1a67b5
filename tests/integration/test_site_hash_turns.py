"""A site's hash and its steps run off rank 0's event loop, and every collective of its group stays in
one order.

A 2-rank site (real processes, FSDP2 over gloo) with the real node and ``CollaborativeOptimizer``
(one node on the in-memory network, the real clock: the hash runs in a worker thread), and a model of
8.6 MB (a state of 17 MB), large enough to be hashed and stepped in a thread (``serve.THREAD_BYTES``):

1. The event loop serves while the site hashes: rank 1 enters the hash's collectives only once a task
   on rank 0's event loop has run after the hash began. On the code that assembled the chunks on the
   loop, the loop was held in ``state_changed`` waiting for rank 1, rank 1 waited for the loop, and
   the test ended in rank 1's timeout. (A condition, not a clock: the loop either runs or it does not.)
2. Randomized interleavings (two seeds): the training loop's batches (TRAIN in a worker thread, the
   inner step's clip a collective) and steps alone (ALONE, LAND), changes said by hand (HASH, as tools
   and adversaries call ``state_changed`` at any time), and a download of one of the site's own
   snapshots, its chunks placed (PLACE) while the site trains and then adopted (ADOPT). Checks: rank 1
   received exactly the commands rank 0 sent, in the same order (no deadlock: every wait is bounded);
   every digest rank 0 published, and every snapshot it served, is the root of the state of some HASH
   (rank 0's and rank 1's shards as they were when it was sent); the last digest is the root of the
   state the site ends with. On the code that hashed on the loop, a HASH sent while a batch ran in its
   thread interleaved with the batch's collectives.
3. The event loop serves while the site steps alone (ALONE, then LAND: collectives as long as the
   slowest rank takes): rank 1 enters each only once a task on rank 0's event loop has run after it
   was sent. On the code that took the outer step on the loop, rank 1 waited for the loop and the loop
   for rank 1, until rank 1's gate timed out.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.config import RunConfig
from p2ptrain.net import MemoryNetwork
from p2ptrain.training import CollaborativeOptimizer
from p2ptrain.training.optimizer.shared_state import Download
from p2ptrain.training.site import launch
from p2ptrain.training.site.commands import Command, Commands, Op
from p2ptrain.training.site.peer import SiteRank
from p2ptrain.training.state import chunks, serve
from p2ptrain.training.state.download import Downloaded
from tests.harness.identities import identity
from tests.harness.training import BATCH, run_config

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)
WAIT = 120.0  # seconds any rank waits for the other at most (the model is 8.6 MB: slower on a busy machine)
GATE = 20.0  # seconds rank 1 waits for rank 0's event loop to run a task while the site hashes
SEEDS = (1, 2)


def big_model() -> torch.nn.Module:
    torch.manual_seed(0)  # (every rank the same weights, then sharded)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2100), torch.nn.Tanh(), torch.nn.Linear(2100, 1))


def config() -> RunConfig:
    return (
        run_config("diloco")
        .replace("training", grad_clip=1.0)  # (the clip's norm is a collective of the site)
        .replace("progress", interval=0.1, ttl=1.0)  # (a lone site steps alone soon)
    )


class Recorded(Commands):
    """Rank 0's commands, each recorded as it is sent; a HASH with rank 0's shards and epoch then."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.sent: list[int] = []
        self.hashed: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.site: SiteRank | None = None
        self.epoch = lambda: 0

    def send(self, cmd: Command) -> None:
        self.sent.append(int(cmd.op))
        if cmd.op is Op.HASH:
            assert self.site is not None
            self.hashed.append((self.epoch(), state_of(self.site)))
        super().send(cmd)


def state_of(site: SiteRank) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in site.state_shards()[0].items()}


def build(rank: int, world: int, commands: Commands) -> SiteRank:
    torch.set_num_threads(1)
    model = big_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    return SiteRank(model, inner, config(), commands, world=world)


def batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + k)
    x = torch.randn(BATCH, 1024, generator=g)
    return x, x.sum(1, keepdim=True) / 32


def computing(site: SiteRank, rank: int) -> Any:
    count = [0]

    def compute() -> None:
        count[0] += 1
        x, y = batch(rank, count[0])
        torch.nn.functional.mse_loss(site.model(x), y).backward()

    return compute


STEP_OPS = (Op.ALONE, Op.LAND)


def gate(out: Path, name: str) -> None:
    """Rank 1 waits for the file ``name``, which a task on rank 0's event loop writes."""
    deadline = time.monotonic() + GATE
    while not (out / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0's event loop ran no task in {GATE} s while the site waited ({name})")
        time.sleep(0.01)


def follow(site: SiteRank, rank: int, out: Path, *, gated: bool, steps_gated: bool = False) -> None:
    """Rank 1: rank 0's commands; each HASH's shards recorded (``gated``: from the second HASH on, its
    collectives entered only once rank 0's event loop said go; ``steps_gated``: every ALONE's and
    LAND's)."""
    received: list[int] = []
    hashed: list[dict[str, torch.Tensor]] = []
    compute = computing(site, rank)
    steps = 0
    while (cmd := site.commands.receive()).op is not Op.STOP:
        received.append(int(cmd.op))
        if steps_gated and cmd.op in STEP_OPS:
            gate(out, f"step{steps}")
            steps += 1
        if cmd.op is Op.HASH:
            go = out / f"go{len(hashed)}"
            deadline = time.monotonic() + GATE
            while gated and hashed and not go.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0's event loop ran no task while the site hashed")
                time.sleep(0.01)
            hashed.append(state_of(site))
        site.handle(cmd, compute)
    received.append(int(Op.STOP))
    torch.save({"received": received, "hashed": hashed, "end": state_of(site)}, out / f"rank{rank}.pt")


def make_node(net: MemoryNetwork, name: str) -> Node:
    nc = NodeConfig(
        run_id="site",
        listen=((name, 4000),),
        averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
    )
    return Node(identity(name), nc, transport=net.transport(name), clock=trio.current_time)


# ---- 1. the event loop serves while the site hashes ----


def loop_main(rank: int, world: int, out_dir: str) -> None:
    out = Path(out_dir)
    commands = Recorded(rank) if rank == 0 else Commands(rank)
    site = build(rank, world, commands)
    if rank != 0:
        follow(site, rank, out, gated=True)
        return
    assert isinstance(commands, Recorded)
    commands.site = site
    record: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node = await nursery.start(make_node(MemoryNetwork(seed=3), "site").run)
            opt = CollaborativeOptimizer(node, site.model, site.optimizer, config(), parts=site.parts())
            commands.epoch = lambda: opt.epoch
            assert site.live_state().layout.size >= serve.THREAD_BYTES  # (hashed in a thread)
            await nursery.start(opt.run)
            with trio.fail_after(WAIT):

                async def let_rank_1_hash() -> None:  # runs only if the loop is free during the hash
                    (out / "go1").write_text("")

                nursery.start_soon(let_rank_1_hash)
                opt.state_changed()  # the state's hash: HASH, every chunk assembled on rank 0
                record["pending"] = opt.shared.digest
                record["digest"] = await opt.hashed_digest()
                record["epoch"] = opt.epoch
            site.stop()
            nursery.cancel_scope.cancel()

    trio.run(main)
    record["sent"], record["hashed"] = commands.sent, commands.hashed
    record["end"] = state_of(site)
    torch.save(record, out / "rank0.pt")


def full(rank0: dict[str, torch.Tensor], rank1: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([rank0[n], rank1[n]]) for n in rank0}


def root_of(epoch: int, state: dict[str, torch.Tensor]) -> bytes:
    layout = chunks.Layout.of(state)
    return chunks.root(epoch, layout, chunks.hash_chunks(layout, [state[e.name] for e in layout.entries]))


def test_the_event_loop_serves_while_a_site_hashes(tmp_path: Path) -> None:
    launch.spawn(loop_main, 2, str(tmp_path), timeout=WAIT)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert rank0["pending"] == b""  # (state_changed returned with the hash under way)
    assert rank0["sent"] == rank1["received"] == [Op.HASH, Op.HASH, Op.STOP]
    assert len(rank0["hashed"]) == len(rank1["hashed"]) == 2
    epoch, mine = rank0["hashed"][1]
    assert (
        rank0["digest"]
        == root_of(epoch, full(mine, rank1["hashed"][1]))
        == root_of(rank0["epoch"], full(rank0["end"], rank1["end"]))
    )


# ---- 2. randomized interleavings: ranks in step, digests of the states hashed ----


def mixed_main(rank: int, world: int, out_dir: str) -> None:
    out = Path(out_dir)
    commands = Recorded(rank) if rank == 0 else Commands(rank)
    site = build(rank, world, commands)
    if rank != 0:
        follow(site, rank, out, gated=False)
        return
    assert isinstance(commands, Recorded)
    commands.site = site
    record: dict[str, Any] = {"published": [], "snapshots": [], "runs": []}
    for seed in SEEDS:
        trio.run(mixed, site, commands, seed, record)
    site.stop()
    record["sent"], record["hashed"] = commands.sent, commands.hashed
    record["end"] = state_of(site)
    torch.save(record, out / "rank0.pt")


async def mixed(site: SiteRank, commands: Recorded, seed: int, record: dict[str, Any]) -> None:
    rng = random.Random(seed)
    compute = computing(site, 0)
    stats = {"hash_pending_at_batch": 0, "adopted": 0}
    async with trio.open_nursery() as nursery:
        node = await nursery.start(make_node(MemoryNetwork(seed=seed), f"site{seed}").run)
        commands.epoch = lambda: 0  # (the HASH of a new optimizer's state: step 0)
        opt = CollaborativeOptimizer(node, site.model, site.optimizer, config(), parts=site.parts())
        commands.epoch = lambda: opt.epoch
        await nursery.start(opt.run)
        shared = opt.shared

        def published() -> None:
            record["published"].append((opt.epoch, shared.digest))

        async def pause() -> None:
            await trio.sleep(rng.random() * 0.05)

        downloaded = trio.Event()

        async def train() -> None:  # the training loop, as ``Trainer`` runs it
            batches = 0
            while batches < 14 or not downloaded.is_set():
                batches += 1
                stats["hash_pending_at_batch"] += shared.digest == b""
                await trio.to_thread.run_sync(site.train, compute, opt.inner_steps)
                await opt.step(site.world * BATCH)
                published()

        async def change() -> None:  # a change said by hand: hashed anew, whatever runs
            for _ in range(8):
                await pause()
                opt.state_changed()
                published()

        async def download() -> None:  # one of the site's own snapshots, downloaded into its shards
            for _ in range(2):
                await pause()
                snap = await shared.prepare_snapshot()
                assert snap is not None
                try:
                    got = [
                        os.pread(snap.fd, snap.layout.chunk_size(i), i * chunks.CHUNK)
                        for i in range(snap.layout.chunks)
                    ]
                finally:
                    os.close(snap.fd)
                hashes = [chunks.hash_chunk([data]) for data in got]
                assert hashes == snap.hashes  # (the triple is consistent: epoch, root, snapshot)
                record["snapshots"].append(
                    (snap.epoch, snap.root, chunks.root(snap.epoch, snap.layout, hashes))
                )
                order = list(range(len(got)))
                rng.shuffle(order)
                for i in order:
                    await shared.fetcher.sink.place(snap.layout, [], i, memoryview(got[i]))
                    await pause()
                done = trio.Event()
                done.set()
                outcome = Downloaded(snap.epoch, {}, {}, ())
                shared.download = Download(done, None, outcome=outcome)  # (adopted between two batches)
                while shared.download is not None:  # noqa: ASYNC110  (the training loop adopts it)
                    await trio.sleep(0.01)
                stats["adopted"] += 1
            downloaded.set()

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as work:
                work.start_soon(train)
                work.start_soon(change)
                work.start_soon(download)
            await opt.hashed_digest()
            published()
            record["runs"].append({"seed": seed, "epoch": opt.epoch, "digest": shared.digest, **stats})
        nursery.cancel_scope.cancel()


def test_hashes_interleaved_with_batches_downloads_and_steps_keep_the_ranks_in_step(tmp_path: Path) -> None:
    launch.spawn(mixed_main, 2, str(tmp_path), timeout=WAIT)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    sent, received = rank0["sent"], rank1["received"]
    assert sent == received, "rank 1 did not follow rank 0's commands in order"
    for op in (Op.TRAIN, Op.HASH, Op.PLACE, Op.ADOPT, Op.ALONE, Op.LAND):
        assert op in sent, f"no {op.name} in the mix"
    assert len(rank0["hashed"]) == len(rank1["hashed"]) == sent.count(Op.HASH)
    roots = {
        root_of(epoch, full(mine, theirs))
        for (epoch, mine), theirs in zip(rank0["hashed"], rank1["hashed"], strict=True)
    }
    for epoch, digest in rank0["published"]:
        assert digest == b"" or digest in roots, f"a digest published on step {epoch} is no hashed state's"
    for epoch, root, recomputed in rank0["snapshots"]:
        assert root == recomputed and root in roots, f"the snapshot of step {epoch} is no hashed state's"
    runs = rank0["runs"]
    assert [r["seed"] for r in runs] == list(SEEDS)
    assert all(r["adopted"] == 2 for r in runs), runs
    assert sum(r["hash_pending_at_batch"] for r in runs) > 0, "no batch started while a hash was under way"
    last = runs[-1]
    assert last["digest"] == root_of(last["epoch"], full(rank0["end"], rank1["end"]))


# ---- 3. the event loop serves while the site steps ----


def step_main(rank: int, world: int, out_dir: str) -> None:
    out = Path(out_dir)
    commands = Recorded(rank) if rank == 0 else Commands(rank)
    site = build(rank, world, commands)
    if rank != 0:
        follow(site, rank, out, gated=False, steps_gated=True)
        return
    assert isinstance(commands, Recorded)
    commands.site = site
    record: dict[str, Any] = {}
    compute = computing(site, 0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node = await nursery.start(make_node(MemoryNetwork(seed=5), "site").run)
            opt = CollaborativeOptimizer(node, site.model, site.optimizer, config(), parts=site.parts())
            commands.epoch = lambda: opt.epoch
            assert opt.shared.param_bytes >= serve.THREAD_BYTES  # (stepped in a thread)
            await nursery.start(opt.run)

            async def let_rank_1_step() -> None:  # runs only if the loop is free during the collectives
                said = 0
                while True:
                    sent = sum(op in STEP_OPS for op in list(commands.sent))
                    for k in range(said, sent):
                        (out / f"step{k}").write_text("")
                    said = sent
                    await trio.sleep(0.005)

            nursery.start_soon(let_rank_1_step)
            with trio.fail_after(WAIT):
                while opt.epoch < 2:  # (a lone site steps alone: ALONE, then LAND)
                    await trio.to_thread.run_sync(site.train, compute, opt.inner_steps)
                    await opt.step(site.world * BATCH)
                record["digest"] = await opt.hashed_digest()
                record["epoch"] = opt.epoch
            site.stop()
            nursery.cancel_scope.cancel()

    trio.run(main)
    record["sent"] = commands.sent
    record["end"] = state_of(site)
    torch.save(record, out / "rank0.pt")


def test_the_event_loop_serves_while_a_site_steps(tmp_path: Path) -> None:
    launch.spawn(step_main, 2, str(tmp_path), timeout=WAIT)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert rank0["sent"] == rank1["received"]
    assert sum(op in STEP_OPS for op in rank0["sent"]) >= 4  # (two steps alone, each ALONE and LAND)
    assert rank0["epoch"] >= 2
    assert rank0["digest"] == root_of(rank0["epoch"], full(rank0["end"], rank1["end"]))
