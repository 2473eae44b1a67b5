"""What a training peer sends between rounds: progress records go out when something changed that the
others cannot extrapolate (and on a heartbeat), to the DHT and straight to the partners, reads of the
replicas are rare (the partners' records arrive by themselves), and a read carries only the records
that changed since the last one. The swarm still steps together."""

from __future__ import annotations

import itertools

import pytest
import trio

from p2ptrain.dht.peers import peers_key
from tests.harness.training import TARGET, check_identical_per_epoch, run_config, swarm

pytestmark = pytest.mark.timeout(300)
WINDOW = 30.0  # virtual seconds of steady training measured


async def test_between_rounds_a_peer_sends_little_and_the_swarm_still_steps_together(
    autojump_clock: object,
) -> None:
    # Outer rounds of about a minute (4 peers at 16 samples/s each): the background is all there is
    # between them. The run's defaults: a read per second, records valid for 10 s.
    config = (
        run_config("diloco")
        .replace("progress", interval=1.0, ttl=10.0)
        .replace("training", target_batch_size=80 * TARGET)
    )
    async with swarm(config) as s:
        peers = [await s.start(compute=0.5) for _ in range(4)]
        await s.until(lambda: all(p.opt.epoch >= 1 for p in peers), timeout=600)
        epoch = max(p.opt.epoch for p in peers)
        stores: dict[int, list[float]] = {id(p): [] for p in peers}  # when each stored its record
        reads = {id(p): 0 for p in peers}
        list_reads = {id(p): 0 for p in peers}
        ban_reads = {id(p): 0 for p in peers}
        for p in peers:
            store, get = p.node.dht.store, p.node.dht.get

            async def counted(*args, _p=p, _store=store, **kwargs):  # type: ignore[no-untyped-def]
                if kwargs.get("subkey") is not None and args[0] == _p.opt.key:
                    stores[id(_p)].append(trio.current_time())
                return await _store(*args, **kwargs)

            async def counted_get(key, _p=p, _get=get, **kwargs):  # type: ignore[no-untyped-def]
                reads[id(_p)] += key == _p.opt.key
                list_reads[id(_p)] += key == peers_key(_p.node.config.run_id)
                ban_reads[id(_p)] += key == _p.opt.bans_key
                return await _get(key, **kwargs)

            p.node.dht.store = counted  # type: ignore[method-assign]
            p.node.dht.get = counted_get  # type: ignore[method-assign]
        await trio.sleep(1.0)
        before = [p.node.host.traffic()[0] for p in peers]
        await trio.sleep(WINDOW)
        sent = [p.node.host.traffic()[0] - b for p, b in zip(peers, before, strict=True)]
        assert max(p.opt.epoch for p in peers) == epoch, "a round fell into the window: make rounds longer"
        per_second = [b / (WINDOW + 1.0) for b in sent]
        # Every record from three replicas and one's own stored, every second, came to about 12 KB/s;
        # reading the replicas on a heartbeat, 2.6 KB/s; offering records to the partners, 1.5 KB/s; a
        # steady peer list read once a minute, 1.3 KB/s; replicas it stored on asked without contacts,
        # 1.0 KB/s; its own contact told to each peer once a minute, not on every call, 0.9 KB/s; no
        # offer to a partner that is a replica (the store brings it), 0.5 KB/s.
        assert max(per_second) < 700, per_second
        # A steady peer's record goes out on its heartbeat, half its life (ttl / 2), not every second,
        # and on time: woken for reads only, it went out up to a read's wait late (ttl / 3 then, and
        # gaps of two heartbeats, 6.7 s) ...
        assert max(len(t) for t in stores.values()) <= (WINDOW + 1.0) / (10.0 / 2) + 2, stores
        gaps = [b - a for t in stores.values() for a, b in itertools.pairwise(t)]
        assert gaps and max(gaps) <= 10.0 / 2 + 1.0, gaps
        # ... to its partners as well, so that each reads the replicas once a record's life (10 s), not
        # every heartbeat: the records it holds are the partners' latest.
        assert max(reads.values()) <= (WINDOW + 1.0) / 10.0 + 1, reads
        # The peer list, steady since the start, is read every MEMBERS_BACKOFF x 5 s by now, not every 5 s.
        assert max(list_reads.values()) <= 2, list_reads
        # A run without audits convicts nobody: the ban records (none: a read of an empty key asks every
        # replica) are not read, where they were every 30 s.
        assert not any(ban_reads.values()), ban_reads
        await s.until(lambda: all(p.opt.epoch >= epoch + 2 for p in peers), timeout=600)
        check_identical_per_epoch(peers)


async def test_a_peer_whose_offers_are_lost_is_still_read_from_the_replicas(autojump_clock: object) -> None:
    """Offers are a shortcut: one peer's records reach the others through the DHT alone (its offers are
    lost on the way), and the swarm steps together as before."""
    config = run_config("sync").replace("progress", interval=1.0, ttl=10.0)
    async with swarm(config) as s:
        peers = [await s.start(compute=0.5) for _ in range(3)]

        async def lost(*args: object) -> None:
            return None

        peers[2].node.dht.client.offer = lost  # type: ignore[method-assign]
        await s.until(lambda: all(p.opt.epoch >= 6 for p in peers), timeout=600)
        check_identical_per_epoch(peers)
        assert all(p.opt.stats.solo == 0 for p in peers)


async def test_records_that_arrive_all_the_time_wake_reads_without_starving_the_replicas_reads(
    autojump_clock: object,
) -> None:
    """A record stored here or offered wakes the progress loop, which reads what it holds (asking
    nobody); the reads that may ask the replicas keep their own pace. Arrivals every 0.1 s (a busy
    swarm's records) took every read: none asked the replicas while they lasted."""
    config = run_config("diloco").replace("training", target_batch_size=80 * TARGET)  # (records valid 3 s)
    async with swarm(config) as s:
        peers = [await s.start(compute=0.5) for _ in range(2)]
        await s.until(lambda: all(p.opt.view is not None for p in peers), timeout=120)
        opt = peers[0].opt
        reads: list[bool] = []
        refresh = opt.board.refresh

        async def counted(*, network: bool = True) -> None:
            reads.append(network)
            await refresh(network=network)

        opt.board.refresh = counted  # type: ignore[method-assign]

        async def arrivals() -> None:
            while True:
                opt.board.note_arrival()
                await trio.sleep(0.1)

        s.nursery.start_soon(arrivals)
        await trio.sleep(10 * config.progress.ttl)
        assert reads.count(False) >= 4 * 10 * config.progress.ttl * 0.5, reads  # woken, about 4 a second
        assert reads.count(True) >= 5, reads  # (at least once a record's life: 10 here)
