"""State sync of a live site, both ways, with the real nodes and ``CollaborativeOptimizer`` (the in-memory
network, the virtual clock; the site's 2 ranks are real processes, FSDP2 over gloo):

1. An unsharded peer A trains alone to step 2; a 2-rank site then joins, finds itself behind and
   downloads A's state through its rank 0 (the real download protocol: offers, manifest, each chunk
   checked against the root A's records vouch for) straight into its ranks' shards. It then holds A's
   global parameters and outer momentum bit for bit, its local parameters restart from them, and it
   publishes A's digest (the root does not depend on how a peer shards).
2. The site and A take step 3 together (one round, two contributors) and hold identical parameters; A
   leaves; an unsharded peer C joins and downloads the site's state, which rank 0 serves from chunks it
   assembled from the ranks' shards: C holds the site's state.
3. The site takes step 4 alone; C, a step behind, catches up by replaying the result the site kept
   (the result protocol, checked against the site's digest of step 4), not by downloading the state
   again: C then holds the site's state of step 4.

The site's shards are gathered by the test only, from what each rank wrote."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.net import MemoryNetwork
from p2ptrain.training import CollaborativeOptimizer
from p2ptrain.training.optimizer.progress import PeerProgress
from p2ptrain.training.site import launch
from p2ptrain.training.site.commands import Commands, Op
from p2ptrain.training.site.outer import local_of
from p2ptrain.training.site.peer import SiteRank
from tests.harness.identities import identity
from tests.harness.training import BATCH, batch_of, loss_of, make_model, run_config
from tests.integration.test_catchup import view_behind

pytestmark = pytest.mark.timeout(240)  # (spawned ranks start slowly on a busy machine)


def shards(site: SiteRank) -> dict[str, torch.Tensor]:
    got = {n: t.clone() for n, t in site.state_shards()[0].items()}
    got.update({f"local.{n}": local_of(p).clone() for n, p in zip(site.names, site.params, strict=True)})
    return got


def site_main(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    cfg = run_config("diloco").replace("training", grad_clip=1.0)
    model = make_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    site = SiteRank(
        model, torch.optim.AdamW(model.parameters(), lr=cfg.training.lr), cfg, Commands(rank), world=world
    )
    batch = batch_of(10 + rank)

    def compute() -> None:
        loss_of(site.model, batch).backward()

    if rank != 0:
        kept: dict[str, Any] = {"landed": []}
        while (cmd := site.commands.receive()).op is not Op.STOP:
            site.handle(cmd, compute)
            if cmd.op is Op.ADOPT:
                kept["synced"] = shards(site)
            if cmd.op is Op.LAND and cmd.c:  # (a committed step)
                kept["landed"].append(shards(site))
        torch.save(kept, Path(out) / f"rank{rank}.pt")
        return

    record: dict[str, Any] = {}

    async def main() -> None:
        net = MemoryNetwork(seed=11)

        def make_node(name: str, join: Any) -> Node:
            nc = NodeConfig(
                run_id="site",
                listen=((name, 4000),),
                join=join,
                averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
            )
            return Node(identity(name), nc, transport=net.transport(name), clock=trio.current_time)

        async with trio.open_nursery() as nursery:
            a_left = trio.Event()
            a_paused = trio.Event()
            a_done = trio.Event()
            site_synced = trio.Event()

            async def peer_a(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
                async with trio.open_nursery() as inner:
                    node = await inner.start(make_node("a", ()).run)
                    task_status.started(node)
                    model_a = make_model()
                    opt = CollaborativeOptimizer(
                        node,
                        model_a,
                        torch.optim.AdamW(model_a.parameters(), lr=cfg.training.lr),
                        cfg,
                        clock=trio.current_time,
                    )
                    await inner.start(opt.run)
                    while opt.epoch < 2:  # alone
                        loss_of(model_a, batch_of(0)).backward()
                        await trio.sleep(0.1)
                        await opt.step(BATCH)
                    record["a"] = opt.capture()[0]
                    a_paused.set()
                    await site_synced.wait()
                    while opt.epoch < 3:  # with the site
                        loss_of(model_a, batch_of(0)).backward()
                        await trio.sleep(0.1)
                        await opt.step(BATCH)
                    record["a3"] = opt.capture()[0]
                    record["a_stats"] = dict(opt.stats.last)
                    a_done.set()
                    await a_left.wait()
                    inner.cancel_scope.cancel()

            node_a = await nursery.start(peer_a)
            await a_paused.wait()
            node_site = await nursery.start(make_node("site", (node_a.addresses[0],)).run)
            site_opt = CollaborativeOptimizer(
                node_site, site.model, site.optimizer, cfg, clock=trio.current_time, parts=site.parts()
            )
            await nursery.start(site_opt.run)
            with trio.fail_after(300):  # (virtual seconds)
                await site_opt.wait_for_peers(2, 60)
                while site_opt.epoch < 2:
                    site.train(compute, site_opt.inner_steps)
                    await trio.sleep(0.1)
                    await site_opt.step(world * BATCH)
                record["synced"] = {"shards": shards(site), "digest": site_opt.shared.digest}
                record["a_digest"] = site_opt.board.vouched_digest(2)
                site_synced.set()
                while site_opt.epoch < 3:  # with A
                    site.train(compute, site_opt.inner_steps)
                    await trio.sleep(0.1)
                    await site_opt.step(world * BATCH)
                record["end"] = shards(site)
                record["site_stats"] = dict(site_opt.stats.last)
                await a_done.wait()
                a_left.set()
                node_c = await nursery.start(make_node("c", (node_site.addresses[0],)).run)
                model_c = make_model()
                opt_c = CollaborativeOptimizer(
                    node_c,
                    model_c,
                    torch.optim.AdamW(model_c.parameters(), lr=cfg.training.lr),
                    cfg,
                    clock=trio.current_time,
                )
                await nursery.start(opt_c.run)
                await opt_c.wait_for_peers(2, 60)
                while opt_c.epoch < 3:
                    loss_of(model_c, batch_of(1)).backward()
                    await trio.sleep(0.1)
                    await opt_c.step(BATCH)
                record["c"] = opt_c.capture()[0]
                record["c_stats"] = dict(opt_c.stats.last)
                # 3. the site steps alone (no batch since: its pseudo-gradient is zero, and its outer
                # momentum still moves the state); C, a step behind, replays the site's kept result
                trusted = {3: site_opt.shared.digest}
                await site_opt.solo_step()
                trusted[4] = await site_opt.hashed_digest()
                record["end4"] = shards(site)
                donor = PeerProgress(
                    node_site.peer_id,
                    dataclasses.replace(site_opt.record(), addr=str(node_site.addresses[0])),
                )
                view = view_behind(opt_c.epoch, 4, (donor,))
                shared_c = opt_c.shared
                downloads = shared_c.downloads
                shared_c.start_download(view, lambda e: trusted.get(e, b""), lambda e: (donor,))
                assert shared_c.download is not None
                await shared_c.download.done.wait()
                assert await opt_c._land_download()
                record["c4"] = opt_c.capture()[0]
                record["c4_digest"] = opt_c.digest
                record["trusted"] = trusted
                record["c_replayed"] = (shared_c.replayed, shared_c.downloads - downloads)
            site.stop()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    torch.save(record, Path(out) / "rank0.pt")


def full(rank0: dict[str, torch.Tensor], rank1: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([rank0[n], rank1[n]]) for n in rank0}


def test_a_site_downloads_into_its_shards_and_serves_an_unsharded_joiner(tmp_path: Path) -> None:
    launch.spawn(site_main, 2, str(tmp_path), timeout=180)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    synced = full(rank0["synced"]["shards"], rank1["synced"])
    a = rank0["a"]
    state = {n: t for n, t in synced.items() if not n.startswith("local.")}
    assert state.keys() == a.keys()
    for n, t in state.items():
        assert torch.equal(t, a[n]), f"{n} differs from A's after the site's download"
    for n in synced:
        if n.startswith("local."):  # the local parameters restart from the downloaded global ones
            assert torch.equal(synced[n], synced["model." + n.removeprefix("local.")]), n
    assert rank0["synced"]["digest"] == rank0["a_digest"] != b""
    end = full(rank0["end"], rank1["landed"][0])
    for stats in (rank0["site_stats"], rank0["a_stats"]):
        assert stats["outcome"] == "averaged" and stats["contributors"] == 2, stats
    for n, t in rank0["a3"].items():
        assert torch.equal(end[n], t), f"{n} differs between the site and A after step 3"
    c = rank0["c"]
    assert rank0["c_stats"]["outcome"] == "synced", rank0["c_stats"]
    for n in c:
        assert torch.equal(c[n], end[n]), f"{n} differs between the site and C after C's download"
    assert not torch.equal(end["model.0.weight"], synced["model.0.weight"])  # (step 3 moved it)
    # 3. C replayed step 3's result from the site (one result, no second download): the site's state
    assert rank0["c_replayed"] == (1, 0), rank0["c_replayed"]
    assert rank0["c4_digest"] == rank0["trusted"][4] != rank0["trusted"][3]
    end4 = full(rank0["end4"], rank1["landed"][1])
    for n, t in rank0["c4"].items():
        assert torch.equal(t, end4[n]), f"{n} differs between the site and C after C's replay"
