"""A site that is a few steps behind replays the missed steps' results into its ranks' shards, each
checked against the trusted digest of the step it leads to; a result that digest refutes blames its
sender, and the site downloads the state instead (the real nodes and ``CollaborativeOptimizer`` on the
in-memory network and the virtual clock; the site's 2 ranks are real processes, FSDP2 over gloo).

The invariant (``peer.SiteState._replay``, the unsharded replay's, shard by shard): *a site k <= K steps
behind reaches the swarm's step by applying the missed results, each verified by the trusted digest of
the step it leads to before the next is applied, with bytes proportional to k results; a result that
digest refutes is never built on, and its sender is blamed*. Drawn from the seed: k (1 to 3; 1 where 2
results would hold as many bytes as the state, which the site then downloads), the
model's width (small: every pass inline on the event loop; 8.6 MB: the landing, the hash and the kept
copy in worker threads), and how the liar forges its result (one value moved, two swapped, all scaled).

1. An unsharded peer A and the site start from the same weights (the same digest). The site computes a
   batch; A steps alone k times. The site catches up: it replays A's k kept results, fetched into mapped
   buffers and landed shard by shard. It then holds A's global parameters and outer momentum bit for
   bit and publishes A's digest; with k = 1 its local progress is carried onto the new global
   parameters (as an unsharded peer's is), with k > 1 its local parameters restart from them. It keeps
   the replayed results (their digests chained) to serve them on.
2. A steps alone once more; a liar L serves that step's result under A's digests, forged. The site
   replays it from L: the digest refutes it, L is blamed, and the site's next catch-up downloads A's
   state into its shards: it holds A's state again.

The site's shards are gathered by the test only, from what each rank wrote."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
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
from p2ptrain.training.state.replay import ResultStore
from tests.harness.clock import process_clock
from tests.harness.identities import identity
from tests.harness.training import BATCH, run_config
from tests.integration.test_catchup import view_behind

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)
WAIT = 240  # seconds a rank may take


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # (every peer starts from the same weights)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.Tanh(), torch.nn.Linear(2 * width, 1)
    )


def batch_of(i: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(BATCH, width, generator=g)
    return x, x.sum(1, keepdim=True) * (i + 1)


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def draw(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    plan = {
        "k": rng.randint(1, 3),
        "width": rng.choice([4, 1024]),  # (1024: 2.1M parameters, 8.4 MB, past serve.THREAD_BYTES)
        "forgery": rng.choice(["moved", "swapped", "scaled"]),
        "at": rng.random(),
    }
    if plan["width"] == 1024:  # (2 results of 8.4 MB hold as many bytes as the state: downloaded)
        plan["k"] = 1
    return plan


def shards(site: SiteRank) -> dict[str, torch.Tensor]:
    got = {n: t.clone() for n, t in site.state_shards()[0].items()}
    got.update({f"local.{n}": local_of(p).clone() for n, p in zip(site.names, site.params, strict=True)})
    return got


def forge(values: torch.Tensor, how: str, at: float) -> torch.Tensor:
    """``values`` changed so that the bounds on a result still hold and the state they lead to is another."""
    out = values.clone()
    i = int(at * (out.numel() - 1))
    if how == "moved":
        out[i] += 0.5 * float(out.abs().max()) + 1e-3
    elif how == "swapped":
        j = (i + 1) % out.numel()
        out[i], out[j] = values[j] + 1e-3, values[i]
    else:
        out.mul_(1.5).add_(1e-3)
    return out


def site_main(rank: int, world: int, out: str, seed: int) -> None:
    torch.set_num_threads(1)
    plan = draw(seed)
    k, width = plan["k"], plan["width"]
    cfg = run_config("diloco")
    model = make_model(width)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    site = SiteRank(
        model, torch.optim.AdamW(model.parameters(), lr=cfg.training.lr), cfg, Commands(rank), world=world
    )
    batch = batch_of(10 + rank, width)

    def compute() -> None:
        loss_of(site.model, batch).backward()

    if rank != 0:
        kept: dict[str, Any] = {"lands": [], "adopted": None}
        while (cmd := site.commands.receive()).op is not Op.STOP:
            before = shards(site) if cmd.op is Op.LAND else None
            site.handle(cmd, compute)
            if cmd.op is Op.LAND:
                kept["lands"].append((cmd.c, before, shards(site)))
            if cmd.op is Op.ADOPT:
                kept["adopted"] = shards(site)
        torch.save(kept, Path(out) / f"rank{rank}.pt")
        return

    record: dict[str, Any] = {"plan": plan}
    lands: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    land = site.outer.land

    def recorded_land(*args: Any, **kwargs: Any) -> None:
        before = shards(site)
        land(*args, **kwargs)
        lands.append((before, shards(site)))

    site.outer.land = recorded_land  # type: ignore[method-assign]

    async def main() -> None:
        net = MemoryNetwork(seed=seed)

        def make_node(name: str) -> Node:
            nc = NodeConfig(
                run_id="site",
                listen=((name, 4000),),
                averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
            )
            return Node(identity(name), nc, transport=net.transport(name), clock=trio.current_time)

        async with trio.open_nursery() as nursery:
            # (three nodes that join nobody: A steps alone, the site reaches A only through the donors
            # the test names, as the swarm's records would name them)
            node_a = await nursery.start(make_node("a").run)
            model_a = make_model(width)
            opt_a = CollaborativeOptimizer(
                node_a,
                model_a,
                torch.optim.AdamW(model_a.parameters(), lr=cfg.training.lr),
                cfg,
                clock=trio.current_time,
            )
            await nursery.start(opt_a.run)
            node_site = await nursery.start(make_node("site").run)
            site_opt = CollaborativeOptimizer(
                node_site, site.model, site.optimizer, cfg, clock=trio.current_time, parts=site.parts()
            )
            await nursery.start(site_opt.run)
            node_l = await nursery.start(make_node("liar").run)
            trusted = {0: await opt_a.hashed_digest()}
            shared = site_opt.shared
            with trio.fail_after(600):  # (virtual seconds)
                assert await site_opt.hashed_digest() == trusted[0]  # (the same weights)
                site.train(compute, site_opt.inner_steps)  # one batch: below the target, no step
                await site_opt.step(world * BATCH)
                for _ in range(k):  # A alone
                    loss_of(model_a, batch_of(0, width)).backward()
                    await opt_a.step(BATCH)
                    await opt_a.solo_step()
                    trusted[opt_a.epoch] = await opt_a.hashed_digest()
                await opt_a.shared.kept()  # (a large step's result is kept in the background)
                record["a_k"] = opt_a.capture()[0]

                def donor(node: Node) -> PeerProgress:
                    return PeerProgress(
                        node.peer_id, dataclasses.replace(opt_a.record(), addr=str(node.addresses[0]))
                    )

                a, liar = donor(node_a), donor(node_l)
                # 1. k steps behind: a replay of A's k results (fewer bytes than A's state, the site's)
                record["state_bytes"] = (shared.state_bytes(), opt_a.shared.state_bytes())
                shared.start_download(view_behind(0, k, (a,)), lambda e: trusted.get(e, b""), lambda e: (a,))
                assert shared.download is not None and shared.download.replaying
                await shared.download.done.wait()
                assert await site_opt._land_download()
                record["replayed"] = (shared.replayed, shared.downloads, site_opt.epoch)
                record["site_k"] = shards(site)
                record["digest_k"] = await site_opt.hashed_digest()
                record["entries"] = [(e.epoch, e.before, e.after) for e in shared.results.entries(0)]
                record["lands"] = list(lands)
                # 2. A steps once more; the liar serves that step's result forged, under A's digests
                loss_of(model_a, batch_of(0, width)).backward()
                await opt_a.step(BATCH)
                await opt_a.solo_step()
                trusted[k + 1] = await opt_a.hashed_digest()
                await opt_a.shared.kept()
                record["a_k1"] = opt_a.capture()[0]
                kept_a = opt_a.shared.results.get(k)
                assert kept_a is not None and kept_a.kind == "float32"
                values = torch.frombuffer(bytearray(kept_a.read()), dtype=torch.float32)
                forged = forge(values, plan["forgery"], plan["at"])
                store = ResultStore(node_l.host.registry, 4, lambda e: b"")
                store.keep(k, kept_a.slots, [forged], [], digests=(trusted[k], trusted[k + 1]))
                shared.start_download(
                    view_behind(k, k + 1, (liar,)), lambda e: trusted.get(e, b""), lambda e: (liar,)
                )
                assert shared.download is not None and shared.download.replaying
                await shared.download.done.wait()
                assert await site_opt._land_download()
                record["refuted"] = (
                    node_l.peer_id in shared.replayer.blamed,
                    node_l.peer_id in shared.fetcher.blamed,
                    shared.replayed,
                    site_opt.epoch,
                    await site_opt.hashed_digest() != trusted[k + 1],
                )
                # the site is on step k + 1 with a state nobody vouches for: it downloads A's
                shared.start_download(view_behind(k + 1, k + 1, (a,)), lambda e: trusted.get(e, b""))
                assert shared.download is not None and not shared.download.replaying
                await shared.download.done.wait()
                assert await site_opt._land_download()
                record["downloaded"] = (shared.downloads, site_opt.epoch, await site_opt.hashed_digest())
                record["site_k1"] = shards(site)
                record["trusted"] = trusted
            site.stop()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=process_clock())
    torch.save(record, Path(out) / "rank0.pt")


def full(rank0: dict[str, torch.Tensor], rank1: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([rank0[n], rank1[n]]) for n in rank0}


def state_of(shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in shards.items() if not n.startswith("local.")}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for n, t in want.items():
        assert torch.equal(got[n], t), f"{n} differs {what}"


@pytest.mark.parametrize("seed", [4, 5, 7])  # (k = 1, 1, 2; 8.4 MB, 8.4 MB, 49 parameters)
def test_a_site_behind_replays_the_missed_results_and_a_forged_one_is_refuted(
    tmp_path: Path, seed: int
) -> None:
    launch.spawn(site_main, 2, str(tmp_path), seed, timeout=WAIT)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    k = rank0["plan"]["k"]
    trusted = rank0["trusted"]
    # 1. k results replayed, no download; A's state bit for bit, A's digest
    site_bytes, a_bytes = rank0["state_bytes"]
    assert site_bytes == a_bytes > 0  # (what the replay's bytes are weighed against: the same state)
    assert rank0["replayed"] == (k, 0, k), rank0["replayed"]
    assert rank0["digest_k"] == trusted[k] != trusted[0]
    site_k = full(rank0["site_k"], rank1["lands"][k - 1][2])
    assert_same(state_of(site_k), rank0["a_k"], "between the site and A after the replay")
    # each landing, on both ranks: the local parameters restart from the new global ones, or (k = 1)
    # carry their progress since the old ones
    assert [c for c, _, _ in rank1["lands"][:k]] == [2 if k == 1 else 1] * k
    for i in range(k):
        before = full(rank0["lands"][i][0], rank1["lands"][i][1])
        after = full(rank0["lands"][i][1], rank1["lands"][i][2])
        for n in after:
            if not n.startswith("local."):
                continue
            g_old, g_new = before["model." + n[6:]], after["model." + n[6:]]
            want = (before[n] - g_old) + g_new if k == 1 else g_new
            assert torch.equal(after[n], want), f"{n} after landing step {i}"
            if k == 1:  # (the site computed a batch: there was progress to carry)
                assert not torch.equal(after[n], g_new) or torch.equal(before[n], g_old), n
    # the replayed results are kept, chained by the trusted digests, to serve peers further behind
    assert rank0["entries"] == [(e, trusted[e], trusted[e + 1]) for e in range(k)]
    # 2. the forged result: refuted by the digest, its sender blamed, nothing more replayed from it
    blamed_replay, blamed_download, replayed, epoch, off = rank0["refuted"]
    assert blamed_replay and blamed_download and off, rank0["refuted"]
    assert (replayed, epoch) == (k, k + 1)
    # ... and the download that follows gives A's state
    assert rank0["downloaded"] == (1, k + 1, trusted[k + 1]), rank0["downloaded"]
    site_k1 = full(rank0["site_k1"], rank1["adopted"])
    assert_same(state_of(site_k1), rank0["a_k1"], "between the site and A after the download")
