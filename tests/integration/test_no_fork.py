"""No silent forks (issue: home volunteers): a peer that has trained with a swarm and then hears from
no peer at all does not take global steps alone under the swarm's step numbers. It waits, its batches
accumulating, and is one swarm with the others again once it is back in touch. Collaborative peers over
the in-memory network, on the virtual clock.

On the code before, the peer cut off (a partition: its only public peer left, its router dropped the
mapping) stepped alone an averaging timeout later: two lineages under the same step numbers, and the
survivor of a crash did the same. A peer still in touch with the run (a bootstrap node that does not
train, say) steps on alone after one wait, as before: the partners it misses are gone, not cut off.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest
import trio

from p2ptrain.identity import Identity, PeerID
from p2ptrain.node import Node, NodeConfig
from p2ptrain.training.optimizer.progress import ProgressRecord, vouched_digest
from tests.harness.identities import identity
from tests.harness.training import TARGET, check_identical_per_epoch, run_config, swarm


async def test_a_peer_cut_off_from_everyone_waits_and_rejoins_the_swarms_lineage(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    # steps of a few seconds: the peer back in touch downloads the state before the others step again
    config = run_config("sync").replace("training", target_batch_size=16 * TARGET)
    async with swarm(config) as s:
        peers = [await s.start(compute=0.1) for _ in range(3)]
        await s.until(lambda: all(p.opt.stats.averaged >= 2 for p in peers), timeout=120)
        cut, others = peers[2], peers[:2]
        s.net.partition(["t2"], ["t0", "t1"])
        start = max(p.opt.epoch for p in others)
        await s.until(lambda: all(p.opt.epoch >= start + 5 for p in others), timeout=300)
        await trio.sleep(5 * config.averaging.timeout)  # ... and long past the averaging timeout
        assert cut.opt.stats.solo == 0, "the peer cut off stepped alone under the swarm's step numbers"
        assert "out of touch with the swarm" in caplog.text
        s.net.heal()
        top = max(p.opt.epoch for p in others)
        averaged = cut.opt.stats.averaged
        await s.until(lambda: cut.opt.epoch > top and cut.opt.stats.averaged > averaged, timeout=300)
        assert cut.opt.stats.solo == 0
        check_identical_per_epoch(peers)  # one lineage: every step any two peers took, the same bits


async def test_the_survivor_of_a_crash_waits_for_the_swarm_instead_of_stepping_alone(
    autojump_clock: object,
) -> None:
    config = run_config("sync")
    async with swarm(config) as s:
        peers = [await s.start(compute=0.1), await s.start(compute=0.1)]
        await s.until(lambda: all(p.opt.stats.averaged >= 1 for p in peers), timeout=60)
        s.crash(peers[1])
        survivor = peers[0]
        await trio.sleep(6 * config.averaging.timeout)
        assert survivor.opt.stats.solo == 0
        averaged, epoch = survivor.opt.stats.averaged, survivor.opt.epoch
        newcomer = await s.start(compute=0.1)  # (it joins through the survivor)
        await s.until(lambda: survivor.opt.stats.averaged >= averaged + 2, timeout=120)
        assert survivor.opt.stats.solo == 0 and survivor.opt.epoch > epoch
        check_identical_per_epoch([survivor, newcomer], since=epoch + 1)


async def test_a_peer_still_in_touch_with_the_run_steps_on_after_its_partner_died(
    autojump_clock: object,
) -> None:
    """The partner is gone, and the survivor knows it is not the one cut off: the run's bootstrap node
    (no training, no records) still answers it. It waits for the partner once, then steps alone."""
    config = run_config("sync")
    async with swarm(config) as s:
        peers = [await s.start(compute=0.1), await s.start(compute=0.1)]
        boot = Node(
            identity("boot"),
            NodeConfig(run_id="train", listen=(("boot", 4000),), join=(peers[0].node.addresses[0],)),
            transport=s.net.transport("boot"),
            clock=trio.current_time,
        )
        await s.nursery.start(boot.run)
        await s.until(lambda: all(p.opt.stats.averaged >= 1 for p in peers), timeout=60)
        s.crash(peers[1])
        survivor = peers[0]
        await s.until(lambda: survivor.opt.stats.solo >= 1, timeout=120)
        first_solo = trio.current_time()
        await s.until(lambda: survivor.opt.stats.solo >= 4, timeout=60)
        assert trio.current_time() - first_solo < config.averaging.timeout / 2


async def test_a_peer_behind_catches_up_from_peers_that_finished_instead_of_stepping_alone(
    autojump_clock: object,
) -> None:
    """The others reached their last step and said they leave, but still serve their state (a local
    simulate run: the fast nodes finish while a slow one catches up). The peer behind downloads their
    state; on the code before it saw nobody on its step once their records expired, stepped alone from
    its own step, and the run ended with two parameter sets under the same step numbers."""
    config = run_config("sync")
    async with swarm(config) as s:
        done = [await s.start(compute=0.1), await s.start(compute=0.1)]
        await s.until(lambda: all(p.opt.epoch >= 4 for p in done), timeout=120)
        for p in done:
            p.compute = 1e9  # they stop training (after the batch in hand) ...
        await s.until(lambda: all(p.opt.rounds.in_flight is None for p in done), timeout=60)
        await trio.sleep(1.0)
        for p in done:
            await p.opt.leave()  # ... and say they leave, still serving
        last = done[0].opt.epoch
        late = await s.start(compute=0.1)
        await s.until(lambda: late.opt.epoch >= last + 2, timeout=300)
        assert late.opt.stats.syncs >= 1
        check_identical_per_epoch([*done, late])


async def test_joiners_behind_nats_take_no_step_of_their_own_before_they_read_the_swarm(
    autojump_clock: object,
) -> None:
    """Three peers behind NATs join a public one. Their DHT bootstrap includes a dial-back that can only
    time out (seconds), and until it is done they read no record: they used to step alone meanwhile,
    each on its own lineage under the swarm's step numbers, then throw it away for the swarm's state.
    Now a joiner waits until it has read the swarm's records (an averaging timeout at most)."""
    async with swarm(run_config("sync")) as s:
        peers = [await s.start(compute=0.1)]
        for i in range(1, 4):
            s.net.nat(f"t{i}", symmetric=True)
            peers.append(await s.start(compute=0.1 + 0.05 * i))
        await s.until(lambda: all(p.opt.epoch >= 8 for p in peers), timeout=300)
        for p in peers[1:]:
            alone = [e for e, _, outcome, _ in p.steps if outcome == "alone"]
            assert not alone, f"peer {p.index} stepped alone on steps {alone}"
        check_identical_per_epoch(peers)


async def test_a_peer_resumed_from_a_checkpoint_waits_for_the_peers_it_trained_with(
    autojump_clock: object,
) -> None:
    """A node restarted with --resume (the swarm's first peer: no join address) remembers in its
    checkpoint the peers it averaged with. It waits for them instead of stepping alone at once (before:
    the NAT lab's public peer, back after 60 s, took steps 36 and 37 alone while the swarm was on 70)."""
    config = run_config("sync")
    async with swarm(config) as s:
        resumed = await s.start(compute=0.1)
        resumed.node.averager.remember_partners([Identity.from_seed(b"\x07" * 32).peer_id])  # (as restored)
        await trio.sleep(4 * config.averaging.timeout)
        assert resumed.opt.stats.solo == 0, "the resumed peer stepped alone under the swarm's step numbers"
        newcomer = await s.start(compute=0.1)  # the swarm comes back (here: a peer joins through it)
        await s.until(lambda: resumed.opt.stats.averaged >= 2, timeout=120)
        assert resumed.opt.stats.solo == 0
        check_identical_per_epoch([resumed, newcomer])
        fresh = await s.start(compute=0.1, config=config.replace("run", id="another"))
        await s.until(lambda: fresh.opt.stats.solo >= 1, timeout=120)  # (nothing remembered: no wait)


async def test_a_peer_back_in_touch_reads_the_swarm_before_it_would_step_alone(
    autojump_clock: object,
) -> None:
    """After a partition heals, a ping can be answered before the swarm's records reach the peer that
    was cut off (the DHT is slow to refill). It waits for them (before: the answer alone let it step
    alone once, under the swarm's step numbers, and only then did it see the swarm far ahead)."""
    config = run_config("sync").replace("training", target_batch_size=16 * TARGET)
    async with swarm(config) as s:
        peers = [await s.start(compute=0.1) for _ in range(3)]
        await s.until(lambda: all(p.opt.stats.averaged >= 2 for p in peers), timeout=120)
        cut, others = peers[2], peers[:2]
        s.net.partition(["t2"], ["t0", "t1"])
        await s.until(lambda: cut.opt.alone.cut_off, timeout=600)
        real = cut.opt.board.refresh
        blind = True

        async def refresh(**kwargs: bool) -> None:
            if blind:  # healed, but no record has reached it yet
                cut.opt.board.records = []
                cut.opt.board.update_view()
                return
            await real(**kwargs)

        cut.opt.board.refresh = refresh  # type: ignore[method-assign]
        s.net.heal()
        await s.until(lambda: cut.opt.alone.answered, timeout=600)  # its probe got an answer: in touch again
        await trio.sleep(2.0)  # (what it decides at its next batches)
        assert cut.opt.stats.solo == 0, "back in touch, it stepped alone before reading the swarm"
        blind = False
        top = max(p.opt.epoch for p in others)
        await s.until(lambda: cut.opt.epoch > top, timeout=300)
        assert cut.opt.stats.solo == 0
        check_identical_per_epoch(peers)


async def test_a_step_a_donor_offers_is_vouched_for_by_a_record_read_before_it_was_superseded() -> None:
    """A donor offers the step it holds when asked. In a swarm that steps faster than records travel,
    the records read by then name later steps: on the code before, the offer named a step that no
    record it held did ("no peer offered the swarm's state"), every retry alike, and a restarted peer
    chased a swarm of 3 steps a second for the rest of the run (the scenario test's kill and restart).
    The digest a trusted record gave for that step, superseded since, still vouches for it; a record of
    a peer it does not trust does not, nor one of another run, and such records are not kept: free ids
    that write many cannot push the trusted ones out."""
    from types import SimpleNamespace

    from p2ptrain.dht.records import owned_subkey
    from p2ptrain.wire.codec import pack

    async with swarm(run_config("sync")) as s:
        me = await s.start(train=False)
        friend, stranger = (Identity.from_seed(bytes([n]) * 32).peer_id for n in (8, 9))
        me.opt.board.trusted = lambda: frozenset({friend})  # type: ignore[method-assign]
        run = me.opt.fingerprint

        def read(*records: tuple[PeerID, ProgressRecord]) -> Any:
            held = {owned_subkey(p): SimpleNamespace(value=pack(r.to_obj())) for p, r in records}
            me.node.dht.held = lambda key: held  # type: ignore[method-assign]
            return me.opt.refresh(network=False)

        digests = {e: hashlib.blake2b(bytes([e]), digest_size=32).digest() for e in range(30, 34)}
        for epoch in (30, 31):
            rec = ProgressRecord(epoch=epoch, samples=0, rate=1.0, time=1.0, digest=digests[epoch], run=run)
            await read((friend, rec), (stranger, dataclasses.replace(rec, epoch=epoch + 2)))
        other_run = ProgressRecord(epoch=32, samples=0, rate=1.0, time=1.0, digest=digests[33], run=b"other")
        await read((friend, dataclasses.replace(rec, epoch=33, digest=digests[33])), (stranger, other_run))
        assert [r.record.epoch for r in me.opt.records if r.peer == friend] == [33]  # 30 and 31: superseded
        vouched = {e: vouched_digest(me.opt.said_on(e), e, me.opt.trusted()) for e in range(30, 34)}
        assert vouched == {30: digests[30], 31: digests[31], 32: b"", 33: digests[33]}
        assert me.opt.said_on(32) == []  # kept: only the trusted peers' records of this run
        # a hundred free ids writing records of every step push nothing out of the history
        flood = [(Identity.from_seed(i.to_bytes(32, "big")).peer_id, rec) for i in range(100, 400)]
        await read((friend, dataclasses.replace(rec, epoch=33, digest=digests[33])), *flood)
        assert vouched_digest(me.opt.said_on(30), 30, me.opt.trusted()) == digests[30]
