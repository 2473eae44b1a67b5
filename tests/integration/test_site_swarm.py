"""A 2-rank site (real processes, FSDP2 over gloo) and an unsharded peer train one model in one DiLoCo
swarm, each with the real node and ``CollaborativeOptimizer`` (progress records, matchmaking, the
averager's rounds over the in-memory network, on the virtual clock): after every outer step both hold
the same global parameters, and the same local ones, bit for bit. With ``diloco.overlap`` (each round
runs while the next batches compute) both hold the same global parameters after every outer step, and
each its own local ones: the new global ones with the progress made during the round on top. The site's
shards are gathered by the test only, from what each rank wrote after each landing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2ptrain import Node, NodeConfig
from p2ptrain.authority import authority_key_text
from p2ptrain.averaging import AveragerConfig
from p2ptrain.config import RunConfig
from p2ptrain.errors import ConfigError
from p2ptrain.net import MemoryNetwork
from p2ptrain.training import CollaborativeOptimizer
from p2ptrain.training.site import launch
from p2ptrain.training.site.commands import Commands, Op
from p2ptrain.training.site.outer import local_of
from p2ptrain.training.site.peer import SiteRank, check_run
from tests.harness.identities import identity
from tests.harness.training import BATCH, batch_of, loss_of, make_model, run_config

pytestmark = pytest.mark.timeout(240)  # (spawned ranks start slowly on a busy machine)
STEPS = 3


PRIVATE = authority_key_text(bytes(range(32)))  # top-k is for private swarms
# each: the averaging's compression, and whether rounds overlap compute
VARIANTS = (("int8", False), ("topk3-q4", False), ("int8", True), ("topk3-q4", True))


def name(compression: str, overlap: bool) -> str:
    return compression + ("-overlap" if overlap else "")


def config(compression: str, overlap: bool = False) -> RunConfig:
    return (
        run_config("diloco", overlap=overlap)
        .replace("training", grad_clip=1.0)  # (the clip's norm is a collective of the site)
        .replace("run", authority=PRIVATE if compression.startswith("topk") else "")
        .replace("averaging", compression=compression)
    )


def shards(site: SiteRank) -> list[torch.Tensor]:
    return [t.clone() for t in site.global_shards()] + [local_of(p).clone() for p in site.params]


def build(rank: int, world: int, cfg: RunConfig) -> SiteRank:
    torch.set_num_threads(1)
    model = make_model()  # the same initial weights as the unsharded peer, then sharded
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    inner = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr)
    return SiteRank(model, inner, cfg, Commands(rank), world=world)


def site_main(rank: int, world: int, out: str) -> None:
    for compression, overlap in VARIANTS:  # (one spawn: starting ranks is the slow part)
        swarm(rank, world, Path(out) / name(compression, overlap), compression, overlap)


def swarm(rank: int, world: int, out: Path, compression: str, overlap: bool) -> None:
    out.mkdir(exist_ok=True)
    cfg = config(compression, overlap)
    site = build(rank, world, cfg)
    batch = batch_of(10 + rank)  # every rank its own data

    def compute() -> None:
        loss_of(site.model, batch).backward()

    if rank != 0:
        landed: list[list[torch.Tensor]] = []
        while (cmd := site.commands.receive()).op is not Op.STOP:
            site.handle(cmd, compute)
            if cmd.op is Op.LAND and cmd.c:
                landed.append(shards(site))
        torch.save(landed, Path(out) / f"rank{rank}.pt")
        return

    record: dict[str, Any] = {"site": {}, "peer": {}, "outcomes": []}

    async def main() -> None:
        net = MemoryNetwork(seed=7)
        nodes = []
        async with trio.open_nursery() as nursery:
            for name in ("site", "peer"):
                nc = NodeConfig(
                    run_id="site",
                    listen=((name, 4000),),
                    join=(nodes[0].addresses[0],) if nodes else (),
                    averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
                )
                node = Node(identity(name), nc, transport=net.transport(name), clock=trio.current_time)
                nodes.append(await nursery.start(node.run))
            site_opt = CollaborativeOptimizer(
                nodes[0], site.model, site.optimizer, cfg, clock=trio.current_time, parts=site.parts()
            )
            peer_model = make_model()
            peer_opt = CollaborativeOptimizer(
                nodes[1],
                peer_model,
                torch.optim.AdamW(peer_model.parameters(), lr=cfg.training.lr),
                cfg,
                clock=trio.current_time,
            )
            await nursery.start(site_opt.run)
            await nursery.start(peer_opt.run)
            done = {"site": trio.Event(), "peer": trio.Event()}

            async def train_site() -> None:
                await site_opt.wait_for_peers(2, 60)
                while site_opt.epoch < STEPS:
                    site.train(compute, site_opt.inner_steps)
                    await trio.sleep(0.1)
                    if await site_opt.step(world * BATCH):
                        record["outcomes"].append(("site", site_opt.epoch, dict(site_opt.stats.last)))
                        record["site"][site_opt.epoch] = shards(site)
                done["site"].set()

            async def train_peer() -> None:
                await peer_opt.wait_for_peers(2, 60)
                while peer_opt.epoch < STEPS:
                    loss_of(peer_model, batch_of(0)).backward()
                    await trio.sleep(0.1)
                    if await peer_opt.step(BATCH):
                        record["outcomes"].append(("peer", peer_opt.epoch, dict(peer_opt.stats.last)))
                        record["peer"][peer_opt.epoch] = [
                            g.detach().clone() for g in peer_opt.global_params
                        ] + [p.detach().clone() for p in peer_model.parameters()]
                done["peer"].set()

            with trio.fail_after(600):  # (virtual seconds)
                nursery.start_soon(train_site)
                nursery.start_soon(train_peer)
                await done["site"].wait()
                await done["peer"].wait()
            site.stop()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    record["rank0"] = record.pop("site")
    torch.save(record, Path(out) / "rank0.pt")


def test_a_site_and_an_unsharded_peer_train_in_one_swarm_with_identical_parameters_after_every_outer_step(
    tmp_path: Path,
) -> None:
    launch.spawn(site_main, 2, str(tmp_path), timeout=180)
    for compression, overlap in VARIANTS:
        check(tmp_path / name(compression, overlap), overlap)


def check(out: Path, overlap: bool) -> None:
    rank0 = torch.load(out / "rank0.pt", weights_only=False)
    rank1 = torch.load(out / "rank1.pt", weights_only=False)
    outcomes = rank0["outcomes"]
    assert all(o["outcome"] == "averaged" and o["contributors"] == 2 for _, _, o in outcomes), outcomes
    epochs = sorted(rank0["rank0"])
    assert epochs == list(range(1, STEPS + 1)) == sorted(rank0["peer"])
    assert len(rank1) == STEPS  # rank 1 landed every committed round
    before = None
    for k, epoch in enumerate(epochs):
        mine, theirs = rank0["rank0"][epoch], rank1[k]
        site_full = [torch.cat([a, b]) for a, b in zip(mine, theirs, strict=True)]
        peer = rank0["peer"][epoch]
        n = len(site_full) // 2  # (the global parameters, then the local ones)
        # with overlap, each its own local progress since its handoff, on the same global parameters
        same = site_full[:n] if overlap else site_full
        for s, p in zip(same, peer[: len(same)], strict=True):
            assert torch.equal(s, p), f"the site and the peer differ after outer step {epoch}"
        for state in (site_full, peer):
            carried = not all(torch.equal(g, p) for g, p in zip(state[:n], state[n:], strict=True))
            assert carried == overlap, f"after outer step {epoch}: progress carried {carried}"
        if before is not None:
            assert not all(torch.equal(a, b) for a, b in zip(site_full, before, strict=True))
        before = site_full


def test_a_site_refuses_sync_mode_with_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="DiLoCo only"):
        check_run(run_config("sync"))
    check_run(run_config("diloco"))
    check_run(run_config("diloco", overlap=True))
