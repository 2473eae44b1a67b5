"""Free identities cannot rewrite the honest peers' model (issue: open swarms, "one fresh key rewrites
every honest peer's model"). Collaborative peers over the in-memory network on the virtual clock.

What is proved here:

- sybil-epoch: a fresh key that publishes a progress record of step 1,000,000 and serves a state of that
  step whose every parameter is 1000 moves no honest peer; they train on together, identical. On the
  code before trust, every honest peer downloaded and restored that state.
- false accusation: fresh keys that publish bans of an honest peer without a proof ban nobody. Before,
  two such records made every peer ban it.
- sybil-majority: three fresh keys, outnumbering the two honest peers, publish records of the honest
  peers' own step with their (other) state's digest and serve that state. No honest peer "repairs" onto
  it. Before, the majority digest was theirs and both honest peers restored it.

The attackers are real nodes that joined through an honest peer (so their records, their state servers
and their connections are the real thing); only their state and step numbers are forged.
"""

from __future__ import annotations

import logging

import pytest
import torch
import trio

from p2ptrain.dht.records import owned_subkey
from p2ptrain.testing import sybils
from p2ptrain.training.optimizer.bans import BAN_READ_INTERVAL
from p2ptrain.wire.codec import pack
from tests.harness.training import Peer, Swarm, check_identical_per_epoch, run_config, swarm

FORGED = 1000.0


def forge(peer: Peer, epoch: int) -> None:
    """Make ``peer`` hold a state of ``epoch`` whose every parameter is FORGED, and publish it."""
    with torch.no_grad():
        for p in peer.model.parameters():
            p.fill_(FORGED)
    peer.opt.tally.set_epoch(epoch)
    peer.opt.state_changed()  # rehash, serve and publish the forged state


def untouched(peers: list[Peer]) -> None:
    for p in peers:
        assert p.opt.stats.syncs == 0, f"honest peer {p.index} downloaded a state"
        assert all(bool((q != FORGED).all()) for q in p.model.parameters())
        assert p.opt.epoch < 1000


async def honest_pair(s: Swarm) -> list[Peer]:
    peers = [await s.start(compute=0.1), await s.start(compute=0.1)]
    await s.until(lambda: all(p.opt.epoch >= 2 for p in peers), timeout=60)
    return peers


async def test_a_fresh_key_on_a_far_step_moves_no_honest_peer(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "p2ptrain.training")
    async with swarm(run_config("sync")) as s:
        peers = await honest_pair(s)
        attacker = await s.start(train=False)
        forge(attacker, 10**6)
        # the records travel within a progress interval; give the honest peers several steps to fall
        await s.until(lambda: attacker.opt.digest != b"", timeout=30)
        start = peers[0].opt.epoch
        await s.until(lambda: all(p.opt.epoch >= start + 3 for p in peers), timeout=120)
        untouched(peers)
        check_identical_per_epoch(peers)
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert any(attacker.node.peer_id.short() in m and "step 1000000" in m for m in refusals), refusals


async def test_fresh_keys_outnumbering_the_honest_on_their_step_move_no_honest_peer(
    autojump_clock: object,
) -> None:
    async with swarm(run_config("sync")) as s:
        peers = await honest_pair(s)
        attackers = [await s.start(train=False) for _ in range(3)]

        async def follow() -> None:  # every sybil claims the honest peers' current step, with its state
            while True:
                for a in attackers:
                    if a.opt.epoch != peers[0].opt.epoch:
                        forge(a, peers[0].opt.epoch)
                await trio.sleep(0.1)

        s.nursery.start_soon(follow)
        epoch = peers[0].opt.epoch
        # long enough for the forged majority to be read (records every 0.5 s) and acted on many times
        await trio.sleep(20)
        untouched(peers)
        assert all(p.opt.view is not None and not p.opt.view.diverged(p.opt.digest) for p in peers)
        check_identical_per_epoch(peers)
        print("honest steps while attacked:", [p.opt.epoch - epoch for p in peers])


@pytest.mark.timeout(300)  # (a swarm trains meanwhile: real CPU, slow on a busy machine)
async def test_fresh_keys_accusing_an_honest_peer_ban_nobody(autojump_clock: object) -> None:
    """Two fresh keys publish bans of an honest peer in the old form (a peer id and a reason: two distinct
    accusers used to make everyone adopt it), a third in the current one (naming a round and partition
    whose proof it cannot produce). No honest peer bans anyone; both train on together."""
    async with swarm(run_config("sync").replace("averaging", audit=True)) as s:
        peers = await honest_pair(s)
        victim = peers[1].node.peer_id
        for n in range(3):
            attacker = await s.start(train=False)
            accuser = attacker.node.peer_id  # (the last one: its record names a round)
            await attacker.node.dht.bootstrapped.wait()
            addr = str(attacker.node.dht.advertised_address())
            old_form = [[victim.digest, "lies"]]
            new_form = {"addr": addr, "bans": [[victim.digest, "lies", bytes(16), 0]]}
            await attacker.node.dht.store(
                peers[0].opt.bans_key,
                pack(old_form if n < 2 else new_form),
                ttl=3600.0,
                subkey=owned_subkey(attacker.node.peer_id),
                sign=True,
            )
        start = peers[0].opt.epoch
        await s.until(lambda: all(p.opt.epoch >= start + 3 for p in peers), timeout=120)
        # The other honest peer read the records and examined the one accusation that names a round (the
        # victim does not judge its own): no proof came, so it bans nobody, the accuser included.
        examined = peers[0].node.averager.auditor.examined
        await s.until(lambda: (accuser, victim, bytes(16), 0) in examined, timeout=2 * BAN_READ_INTERVAL)
        assert not any(p.node.averager.auditor.banned for p in peers)
        check_identical_per_epoch(peers)


async def test_fresh_keys_on_the_honest_step_that_never_average_do_not_stall_it(
    autojump_clock: object,
) -> None:
    """Three fresh keys publish records of the honest peers' own step (with their own, unforged state)
    and never join a group. Counted as peers, they made the group everyone waits for 5 strong, with a
    majority of 3: the honest pair could never form one again (no global step at all). Untrusted records
    now count toward the majority a group needs for at most as many as the trusted ones; the group the
    leader waits for still counts them (it gathers until its deadline, then goes with who came)."""
    async with swarm(run_config("sync")) as s:
        peers = await honest_pair(s)
        attackers = [await s.start(train=False) for _ in range(3)]

        async def follow() -> None:
            while True:
                for a in attackers:
                    if a.opt.epoch != peers[0].opt.epoch:
                        a.opt.tally.set_epoch(peers[0].opt.epoch)
                        a.opt.state_changed()
                await trio.sleep(0.1)

        s.nursery.start_soon(follow)
        await s.until(
            lambda: all(p.opt.view is not None and p.opt.view.peers == 5 for p in peers), timeout=30
        )
        start = max(p.opt.epoch for p in peers)
        await s.until(lambda: all(p.opt.epoch >= start + 3 for p in peers), timeout=120)
        assert all(p.opt.stats.syncs == 0 for p in peers)
        check_identical_per_epoch(peers)


async def test_the_swarms_first_peer_before_its_first_round_is_not_outvoted_by_fresh_keys(
    autojump_clock: object,
) -> None:
    """The swarm's first peer has no anchor until its first round: nobody to join through, nobody
    averaged with. It trusted every record then: an attacking peer that joined and wrote records of its
    sign-flipped state under eight fresh keys made that state its majority (the benchmark's first peer
    never took a step). It now trusts the peers connected to it; the fresh keys never connected."""
    async with swarm(run_config("sync")) as s:
        first = await s.start(train=False)
        other = await s.start(train=False)
        attacker = await s.start(compute=0.1)  # joins through the first peer, as the honest one did
        attack = sybils.install("sybil-majority", attacker.opt)
        await s.until(lambda: attacker.opt.digest not in (b"", first.opt.digest), timeout=60)
        forged = attacker.opt.digest

        def read_them() -> bool:
            forgers = {attacker.node.peer_id, *(who.peer_id for who in attack.ids)}
            records = {r.peer: r.record.digest for r in first.opt.records}
            return len(forgers) == 1 + sybils.SYBILS and all(records.get(f) == forged for f in forgers)

        await s.until(read_them, timeout=60)
        view = first.opt.view
        assert view is not None and first.node.averager.partners == set()
        assert view.majority == first.opt.digest == other.opt.digest != forged
        assert not view.diverged(first.opt.digest) and first.opt.stats.syncs == 0
