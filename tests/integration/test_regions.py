"""A step's swarm split into regions (``progress.regions``): collaborative peers over the in-memory
network on the virtual clock, their compute speeds drawn per seed.

The invariants a split swarm keeps, whatever the peers' speeds and the order their rounds commit in:

* every committed round's members are of one region of its step (a pure function of their ids);
* a region commits a step once: every member of its rounds of that step leaves with one state (no
  fork, counted per region);
* a round averages its members' states, not only their gradients: members that came to the step with
  different states (from different regions of the step before) leave it with one;
* the split is real: some steps are committed by more than one region's round;
* a peer keeps the swarm's step: one that holds the swarm's state (anchored, or it downloaded one)
  downloads only when its trusted peers are two or more steps on; one step behind, its region
  formed no group of its step with it, it steps alone (``CollaborativeOptimizer._keeps_pace``);
* a look for a region's group reads the matchmaking keys of its region's buckets alone (where every
  peer that may join it announces), not every bucket's;
* a newcomer's step is its own or its trusted peers', whatever free ids of its region write: their
  records only choose between the two (``ProgressBoard._region_waits``);
* between reads of the replicas a peer pulls only the keys it follows (its region's, its join
  peers'), not the sampled ones.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import trio

from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.dht.spread import bucket_of
from p2ptrain.identity import Identity, PeerID
from p2ptrain.training.optimizer.buckets import POOL, Regions, region_buckets
from p2ptrain.training.optimizer.progress import PeerProgress
from tests.harness.training import Peer, run_config, swarm

pytestmark = pytest.mark.timeout(600)  # (nine nodes train meanwhile: real CPU, a busy machine)

PEERS = 9  # (their ids fall in all four buckets)
STEPS = 6


def _record(p: Peer, rounds: list[tuple[Peer, int, frozenset[str], str]]) -> None:
    """Every round ``p`` applies: (peer, the step it left, its members' short ids, its parameters after)."""
    note = p.opt.stats.note_step

    def noting(last: dict[str, Any]) -> None:
        note(last)
        if last["outcome"] == "averaged":
            members = frozenset(last["shares"]) - frozenset(last["excluded"])
            rounds.append((p, int(last["epoch"]), members, p.params_hash()))

    p.opt.stats.note_step = noting  # type: ignore[method-assign]


def _record_looks(p: Peer, looks: list[tuple[Peer, str, list[bytes]]]) -> None:
    """Every set of matchmaking keys ``p``'s looks read: (peer, group key, keys)."""
    groups = p.node.averager.groups
    read_keys = groups.read_keys

    def reading(group_key: str) -> list[bytes]:
        keys = read_keys(group_key)
        looks.append((p, group_key, keys))
        return keys

    groups.read_keys = reading  # type: ignore[method-assign]


def _record_downloads(p: Peer, downloads: list[tuple[Peer, int, int, bool]]) -> None:
    """Every download ``p`` starts: (peer, its step, the newest step of its trusted peers, whether it
    held the swarm's state then: anchored, or a download landed before)."""
    shared, board = p.opt.shared, p.opt.board
    start = shared.start_download

    def starting(*args: Any, **kwargs: Any) -> None:
        held = board.anchored or shared.downloads > 0
        downloads.append((p, p.opt.epoch, board.swarm_newest, held))
        start(*args, **kwargs)

    shared.start_download = starting  # type: ignore[method-assign]


async def _newcomer(s: Any, regions: Regions) -> tuple[Peer, Peer]:
    """A swarm's first peer and a newcomer whose join peer it is, of another region at step 0."""
    first = await s.start(train=False)
    me = await s.start(train=False)
    while regions.together(me.node.peer_id, first.node.peer_id, 0):
        me = await s.start(train=False)
    assert not me.opt.board.anchored and me.opt.board.trusted() == {first.node.peer_id}
    return first, me


def _ids_of_region(regions: Regions, peer: PeerID, n: int) -> list[PeerID]:
    """``n`` fresh ids in ``peer``'s region at step 0 (free ids there)."""
    out: list[PeerID] = []
    while len(out) < n:
        pid = Identity.generate().peer_id
        if regions.together(pid, peer, 0):
            out.append(pid)
    return out


def _forged(rng: random.Random, mine: Any, strangers: list[PeerID], *, anchored: float) -> list[PeerProgress]:
    """Records of some of ``strangers`` (free ids of a peer's region), each claiming drawn samples, rate,
    readiness, anchoring (with probability ``anchored``) and a taken step, on ``mine``'s run."""
    return [
        PeerProgress(
            pid,
            dataclasses.replace(
                mine,
                epoch=rng.choice([0, 0, 0, 1]),
                samples=rng.choice([0, 10, 2**40]),
                rate=rng.choice([0.0, 1.0, 1e6]),
                ready=rng.random() < 0.5,
                anchored=rng.random() < anchored,
                averaged=rng.random() < 0.15,
            ),
        )
        for pid in rng.sample(strangers, rng.randint(0, len(strangers)))
    ]


async def _split(seed: int) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    rounds: list[tuple[Peer, int, frozenset[str], str]] = []
    looks: list[tuple[Peer, str, list[bytes]]] = []
    downloads: list[tuple[Peer, int, int, bool]] = []
    async with swarm(config) as s:
        peers = []
        for _ in range(PEERS):
            p = await s.start(compute=rng.choice([0.1, 0.15, 0.2, 0.3]))
            _record(p, rounds)
            _record_looks(p, looks)
            _record_downloads(p, downloads)
            peers.append(p)
        await s.until(lambda: sum(p.opt.epoch >= STEPS for p in peers) >= PEERS - 1, timeout=400)
    # a peer that held the swarm's state downloaded only when two or more steps behind
    late = [
        (p.node.peer_id.short(), e, newest) for p, e, newest, held in downloads if held and newest < e + 2
    ]
    assert not late, f"downloads one step behind (peer, its step, its trusted peers' newest): {late}"
    by_id: dict[str, PeerID] = {p.node.peer_id.short(): p.node.peer_id for p in peers}
    assert rounds
    states: dict[tuple[int, int], set[str]] = {}
    came_with: dict[tuple[int, int], set[str]] = {}
    for p, epoch, members, after in rounds:
        region = regions.of_peer(p.node.peer_id, epoch)
        # one region's members, all of them
        assert {regions.of_peer(by_id[m], epoch) for m in members} == {region}, (epoch, members)
        states.setdefault((epoch, region), set()).add(after)
        if epoch in p.params_at:  # (the state it came to the step with)
            came_with.setdefault((epoch, region), set()).add(p.params_at[epoch])
    forks = {k: v for k, v in states.items() if len(v) > 1}
    assert not forks, f"two states of one region and step: {sorted(forks)}"
    # members that came with different states left with one (the states were averaged)
    assert any(len(before) > 1 for before in came_with.values()), came_with
    # more than one region's round committed a step
    steps = {e for e, _ in states}
    assert any(len({r for e2, r in states if e2 == e}) > 1 for e in steps), sorted(states)
    # each look read its region's keys, and only those
    assert looks
    for p, group_key, keys in looks:
        epoch = int(group_key.split("-")[1].split("/")[0])  # ("sync-<step>/region-<index>")
        spread = p.node.averager.groups.keys(group_key)
        read = sorted(spread.keys.index(k) for k in keys)
        assert read == region_buckets(bucket_of(p.node.peer_id.digest, 2), 2, epoch, regions.span), group_key


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_split_swarm_commits_each_region_once_and_mixes_the_states(
    seed: int, autojump_clock: object
) -> None:
    await _split(seed)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_newcomers_step_is_its_trusted_peers_whatever_its_regions_records_say(
    autojump_clock: object, seed: int
) -> None:
    """A newcomer (it trusts its join peer alone, of another region) whose join peer took the step past
    its own reads its region's records only as a hint (``ProgressBoard._region_waits``): with random
    forged records of free ids in its region (any step, ``anchored``, ``averaged`` or not, leaving or
    not), the step its view says to be on is always its own or its join peer's, never another; it stays
    on its own where most of its region's records are not past it and one on it says it may lead, or
    none past it says it came there by a round (the region's newcomers lead then), and takes its join
    peer's otherwise. It leads a group of its step itself (``region_unled``) only where no record of its
    region on the step says anchored and none past it says averaged: records of free ids can keep it
    following, as every newcomer did before, and nothing else. Every outcome is drawn."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        first, me = await _newcomer(s, regions)
        board = me.opt.board
        mine = me.opt.record()
        ahead = PeerProgress(first.node.peer_id, dataclasses.replace(first.opt.record(), epoch=1))
        strangers = _ids_of_region(regions, me.node.peer_id, 12)
        outcomes: set[int] = set()
        leads: set[bool] = set()
        for _ in range(40):
            forged = [
                PeerProgress(
                    pid,
                    dataclasses.replace(
                        mine,
                        epoch=rng.choice([0, 0, 1, 2, 7]),
                        anchored=rng.random() < 0.2,
                        averaged=rng.random() < 0.2,
                        leaving=rng.random() < 0.1,
                    ),
                )
                for pid in rng.sample(strangers, rng.randint(0, len(strangers)))
            ]
            board.records = [ahead, *forged]
            newest = board.update_view().newest
            assert newest in (0, 1), (newest, forged)
            # nor do they move the step it keeps pace with (``_keeps_pace``): its join peer's
            assert board.swarm_newest == 1, (board.swarm_newest, forged)
            here = [r.record for r in forged if not r.record.leaving]
            past = sum(r.epoch > 0 for r in here)
            on = sum(r.epoch == 0 for r in here)
            led = any(r.anchored for r in here if r.epoch == 0)
            taken = any(r.averaged for r in here if r.epoch == 1)
            waits = (led or not taken) and past <= on
            assert newest == (0 if waits else 1), (newest, forged)
            unled = board.region_unled(0)
            assert unled == (not led and not taken), (unled, forged)
            outcomes.add(newest)
            leads.add(unled)
        assert outcomes == {0, 1} and leads == {False, True}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_only_a_trusted_peer_that_came_past_by_a_round_says_its_region_took_the_step(
    autojump_clock: object, seed: int
) -> None:
    """An anchored peer's region took its step when a peer it trusts, of its region at that step, says
    it came to the next by a round (``ProgressRecord.averaged``, ``ProgressBoard._region_taken``): its
    view then says the step is behind (it forms no second group of it, and keeps pace). Forged records
    of free ids in its region, any step, averaged or not, change nothing of its view's step; a trusted
    peer past the step alone (not averaged) does not say it either, while most are on it."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        await s.start(train=False)  # (its join peer)
        me = await s.start(train=False)
        board = me.opt.board

        partners, strangers = (
            _ids_of_region(regions, me.node.peer_id, 5),
            _ids_of_region(regions, me.node.peer_id, 10),
        )
        me.node.averager.remember_partners(partners)
        assert board.anchored and set(partners) <= set(board.trusted() or ())
        mine = me.opt.record()
        outcomes: set[bool] = set()
        for _ in range(40):
            past = rng.choice(partners) if rng.random() < 0.6 else None
            averaged = rng.random() < 0.5
            trusted = [
                PeerProgress(
                    pid, dataclasses.replace(mine, epoch=int(pid == past), averaged=pid == past and averaged)
                )
                for pid in partners
            ]
            forged = [
                PeerProgress(
                    pid,
                    dataclasses.replace(mine, epoch=rng.choice([0, 1, 1, 2]), averaged=rng.random() < 0.7),
                )
                for pid in rng.sample(strangers, rng.randint(0, len(strangers)))
            ]
            board.records = trusted
            alone = board.update_view().newest
            board.records = [*trusted, *forged]
            newest = board.update_view().newest
            assert newest == alone, (newest, alone, forged)  # free ids moved nothing
            taken = past is not None and averaged
            assert newest == (1 if taken else 0), (newest, past, averaged)
            outcomes.add(taken)
        assert outcomes == {True, False}
        # A peer's own record says so after any committed round, one it alone contributed to too: a
        # round of the first peer alone committed a region's step, and six peers that trusted it
        # committed it again 21 s later (64 simulated peers over 8 regions, seed 1), its record silent.
        me.opt.tally.advance(frozenset(), by_round=True)
        assert me.opt.record().averaged
        me.opt.tally.advance(frozenset(partners), by_round=False)  # (a step alone says nothing)
        assert not me.opt.record().averaged


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_round_lands_only_where_no_trusted_peer_of_another_group_took_its_regions_step(
    autojump_clock: object, seed: int
) -> None:
    """A member about to apply a committed round of its region's step ``e`` finds it taken elsewhere
    (``ProgressBoard.taken_elsewhere``) exactly when a peer it trusts, of its region at ``e``, no member
    of the round's group, says it came to ``e + 1`` by a round of this run: random records of its
    partners and of free ids, in and out of the group, on any step, averaged or not, of this run or
    another; partners of the other region never count. (Two groups of one region landed 4 s apart at a
    swarm's first step, one holding a join peer of a member of the other: 128 simulated peers.)"""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        await s.start(train=False)  # (its join peer)
        me = await s.start(train=False)
        board = me.opt.board
        partners = _ids_of_region(regions, me.node.peer_id, 6)
        strangers = _ids_of_region(regions, me.node.peer_id, 6)
        away: list[PeerID] = []  # partners of the other region at step 0
        while len(away) < 4:
            pid = Identity.generate().peer_id
            if not regions.together(pid, me.node.peer_id, 0):
                away.append(pid)
        me.node.averager.remember_partners([*partners, *away])
        trusted = board.trusted()
        assert trusted is not None and set(partners) | set(away) <= trusted
        mine = me.opt.record()
        seen: set[bool] = set()
        everyone = partners + strangers + away
        for _ in range(80):
            group = set(rng.sample(everyone, rng.randint(0, 8)))
            board.records = [
                PeerProgress(
                    pid,
                    dataclasses.replace(
                        mine,
                        epoch=rng.choice([0, 1, 1, 2]),
                        averaged=rng.random() < 0.6,
                        run=mine.run if rng.random() < 0.85 else b"another run",
                    ),
                )
                for pid in rng.sample(everyone, rng.randint(0, len(everyone)))
            ]
            could = {
                r.peer
                for r in board.records
                if r.peer in partners
                and r.peer not in group
                and r.record.epoch == 1
                and r.record.averaged
                and r.record.run == mine.run
            }
            took = board.taken_elsewhere(0, group)
            assert (took in could) if could else took is None, (took, could)
            seen.add(bool(could))
        assert seen == {True, False}


async def test_a_member_drops_its_copy_of_a_round_whose_regions_step_a_trusted_peer_took_elsewhere(
    autojump_clock: object,
) -> None:
    """Training peers of a split swarm: a peer whose board, as its round lands, holds a record of a peer
    it trusts (of its region at the round's step, outside the group) that came to the next step by a
    round does not apply the round (its parameters stay as they were, the abort says why); its other
    rounds are applied, and the swarm goes on with one state per region and step."""
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    rounds: list[tuple[Peer, int, frozenset[str], str]] = []
    async with swarm(config) as s:
        peers = [await s.start(compute=c) for c in (0.1, 0.15, 0.2, 0.1, 0.15)]
        for p in peers:
            _record(p, rounds)
        me = peers[1]
        opt, board = me.opt, me.opt.board
        real_land, real_trusted = opt.rounds.land_flight, board.trusted
        landed: list[tuple[int, bool, bool]] = []  # (step, taken elsewhere, applied)

        async def land(flight, outcome, tensors, weight):  # type: ignore[no-untyped-def]
            if not isinstance(outcome, RoundResult) or len(landed) >= 4:
                return await real_land(flight, outcome, tensors, weight)
            elsewhere = len(landed) % 2 == 0  # (every other one: drop, apply, drop, apply)
            before, kept = me.params_hash(), board.records
            if elsewhere:
                fake = next(
                    i
                    for i in iter(lambda: Identity.generate().peer_id, None)
                    if regions.together(i, me.node.peer_id, flight.epoch)
                )
                record = dataclasses.replace(opt.record(), epoch=flight.epoch + 1, averaged=True)
                board.records = [*kept, PeerProgress(fake, record)]
                board.trusted = lambda: (real_trusted() or frozenset()) | {fake}  # type: ignore[method-assign]
            try:
                applied = await real_land(flight, outcome, tensors, weight)
            finally:
                board.records, board.trusted = kept, real_trusted  # type: ignore[method-assign]
            landed.append((flight.epoch, elsewhere, applied is not None))
            if elsewhere:
                assert me.params_hash() == before  # nothing of the round applied
            return applied

        reasons: list[str] = []
        note_abort = opt.stats.note_abort

        def noting(epoch: int, reason: str) -> None:
            reasons.append(reason)
            note_abort(epoch, reason)

        opt.stats.note_abort = noting  # type: ignore[method-assign]
        opt.rounds.land_flight = land  # type: ignore[method-assign]
        await s.until(lambda: len(landed) >= 4, timeout=300)
        await s.until(lambda: all(p.opt.epoch >= landed[-1][0] + 2 for p in peers), timeout=300)
    assert [(taken, applied) for _, taken, applied in landed] == [(True, False), (False, True)] * 2, landed
    assert sum("a peer it trusts, took its region's step" in why for why in reasons) == 2, reasons
    states: dict[tuple[int, int], set[str]] = {}
    for p, epoch, _members, after in rounds:
        states.setdefault((epoch, regions.of_peer(p.node.peer_id, epoch)), set()).add(after)
    assert not {k: v for k, v in states.items() if len(v) > 1}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_newcomer_leads_its_region_by_every_record_only_at_its_trusted_peers_pace(
    autojump_clock: object, seed: int
) -> None:
    """A newcomer that trusts nobody of its region (its join peer is in another) leads its region's
    group by what every record says (``ProgressBoard.leads_by_heard``) exactly where nobody of its region
    may lead but newcomers (``region_unled``) and its join peer says its view of the step reached the
    target or is past it (``paced``). Records of free ids in its region, whatever samples, rates and
    readiness they claim, never make it so while its join peer is not done with the step; they can only
    keep it following (``anchored``, ``averaged``). Its record says ``ready`` only where its own view
    reached the target, or it leads so and every record read did. Every outcome is drawn."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        first, me = await _newcomer(s, regions)
        board = me.opt.board
        me.opt.tally.samples = 3
        mine = me.opt.record()
        strangers = _ids_of_region(regions, me.node.peer_id, 12)
        outcomes: set[tuple[bool, bool]] = set()
        said: set[bool] = set()
        for _ in range(60):
            joined = rng.choice([0, 0, 1])
            done = joined > 0 or rng.random() < 0.5
            theirs = dataclasses.replace(first.opt.record(), epoch=joined, ready=joined == 0 and done)
            forged = _forged(rng, mine, strangers, anchored=0.15)
            board.records = [PeerProgress(first.node.peer_id, theirs), *forged]
            view = board.update_view()
            here = [r.record for r in forged]
            unled = not any(r.anchored for r in here if r.epoch == 0) and not any(
                r.averaged for r in here if r.epoch == 1
            )
            leads = board.leads_by_heard(view)
            assert leads == (unled and done), (leads, unled, done, theirs, forged)
            ready = me.opt.record().ready
            assert ready == (view.ready or (leads and view.heard >= view.target)), (ready, view)
            assert not (ready and not done and not view.ready), (theirs, forged)
            outcomes.add((unled, done))
            said.add(ready)
        assert outcomes == {(a, b) for a in (False, True) for b in (False, True)} and said == {False, True}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_an_anchored_peer_leads_its_region_by_every_record_at_its_trusted_peers_pace(
    autojump_clock: object, seed: int
) -> None:
    """An anchored peer whose trusted peers are elsewhere (the regions are drawn anew each step) leads
    its region's group by what every record says (``ProgressBoard.leads_by_heard``) exactly where half
    or more of its trusted peers on the step or past it say their views reached the target or are past
    it (``paced``); its own view, capped by trust, may never reach the target there. Records of free ids
    in its region, whatever samples, rates, readiness and anchoring they claim, change nothing of it.
    Before, such a peer only followed, and a region of them formed no group until their capped views
    crept to the target (128 simulated peers with 48 slots: a region of 39, 31 anchored, led by nobody
    for 8 s). Its record says ``ready`` only where its own view reached the target, or it leads so and
    every record read did. Every outcome is drawn."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        first, me = await _newcomer(s, regions)
        partners = [
            p
            for p in (Identity.generate().peer_id for _ in range(40))
            if not regions.together(p, me.node.peer_id, 0)
        ][:3]
        me.node.averager.remember_partners(partners)
        board = me.opt.board
        assert board.anchored and board.trusted() == {first.node.peer_id, *partners}
        me.opt.tally.samples = 3
        mine = me.opt.record()
        strangers = _ids_of_region(regions, me.node.peer_id, 12)
        outcomes: set[tuple[bool, bool]] = set()
        said: set[bool] = set()
        for _ in range(60):
            trusted = []
            for pid in [first.node.peer_id, *rng.sample(partners, rng.randint(0, len(partners)))]:
                epoch = rng.choice([0, 0, 1])
                ready = epoch == 0 and rng.random() < 0.5
                trusted.append(PeerProgress(pid, dataclasses.replace(mine, epoch=epoch, ready=ready)))
            on = [r.record for r in trusted]
            done = sum(r.epoch > 0 or r.ready for r in on)
            paced = done > 0 and 2 * done >= len(on)
            forged = _forged(rng, mine, strangers, anchored=0.5)
            board.records = [*trusted, *forged]
            view = board.update_view()
            leads = board.leads_by_heard(view)
            assert leads == paced, (leads, paced, on, forged)
            ready = me.opt.record().ready
            assert ready == (view.ready or (leads and view.heard >= view.target)), (ready, view)
            assert not (ready and not paced and not view.ready), (on, forged)
            outcomes.add((paced, view.ready))
            said.add(ready)
        assert {(True, False), (False, False)} <= outcomes and said == {False, True}, (outcomes, said)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_regions_target_does_not_move_with_the_step_the_other_regions_are_on(
    autojump_clock: object, seed: int
) -> None:
    """A region's share of the target is its rate over the swarm's (``ProgressBoard._view``): the swarm's
    counts every live record read on any step (``note_read``), and the region's its peers on the step
    and arriving from the one before. So where the other regions are, a step on or three, changes
    nothing of a region's target: counted on the step alone, a region the swarm had left saw the swarm's
    rate shrink to its own and took its next step with twice its share of the target (64 simulated
    peers). The region's peers on the step or arriving count; those past it do not (they took it).
    Epochs and rates drawn."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        first = await s.start(train=False)
        me = await s.start(train=False)
        board = me.opt.board
        me.opt.tally.rate.rate = 10.0
        mine = dataclasses.replace(me.opt.record(), rate=10.0)
        ids = [Identity.generate().peer_id for _ in range(24)]
        ours = [p for p in ids if regions.together(p, me.node.peer_id, 0)]
        theirs = [p for p in ids if p not in ours]
        assert ours and theirs
        trusted = PeerProgress(first.node.peer_id, dataclasses.replace(first.opt.record(), rate=10.0))

        def read(epochs: dict[PeerID, int], rates: dict[PeerID, float]) -> int:
            records = [
                trusted,
                *(PeerProgress(p, dataclasses.replace(mine, epoch=epochs[p], rate=rates[p])) for p in ids),
            ]
            for _ in range(60):  # (the estimate of the swarm's rate settles over reads)
                board.note_read(records)
            return board.update_view().target

        moved: set[bool] = set()
        for _ in range(6):
            rates = {p: rng.choice([5.0, 10.0, 20.0]) for p in ids}
            base = {p: 0 for p in ids}
            target = read(base, rates)
            elsewhere = base | {p: rng.choice([0, 1, 2, 3]) for p in theirs}
            assert read(elsewhere, rates) == pytest.approx(target, abs=1), (target, elsewhere)
            gone = rng.choice(ours)  # (one of the region past the step: its rate no longer counts)
            past = read(base | {gone: 1}, rates)
            assert past <= target, (past, target)
            moved.add(past < target)
        assert True in moved


@pytest.mark.parametrize("seed", [1, 2])
async def test_between_reads_a_peer_pulls_only_the_keys_it_follows(autojump_clock: object, seed: int) -> None:
    """Between reads of the replicas, a split swarm's peer pulls from its partners its region's keys at
    its step and at the next, and its join peers' keys (``ProgressBoard.pulling``), never a sampled key
    that is none of those: the sampled keys stand for the swarm's rate, which only reads of the
    replicas update. A read of the replicas still names the sampled ones (``reading``). Steps drawn."""
    rng = random.Random(seed)
    buckets, regions = 16, Regions.of(16, 4)
    config = run_config("sync").replace("progress", buckets=buckets, regions=4)
    async with swarm(config) as s:
        await s.start(train=False)  # (its join peer)
        me = await s.start(train=False)
        board = me.opt.board
        pulled: list[bytes] = []

        async def pull(key: bytes, via: object) -> int:
            pulled.append(key)
            return 0

        me.node.dht.pull = pull  # type: ignore[method-assign]
        joins = {bucket_of(p.digest, regions.bits) for p in me.node.join_peers}
        assert joins
        sampled_left_out = 0
        for _ in range(30):
            epoch = rng.randrange(64)
            me.opt.tally.epoch = epoch
            followed = set(region_buckets(board.bucket, regions.bits, epoch, regions.span))
            followed |= set(region_buckets(board.bucket, regions.bits, epoch + 1, regions.span))
            followed |= joins
            pulled.clear()
            await board._pull([me.node.addresses[0]])
            assert sorted(pulled) == sorted(board.keys[b] for b in followed), epoch
            read = set(board.reading())
            assert {board.keys[b] for b in followed} <= read
            sampled_left_out += bool(read - set(pulled))
        assert sampled_left_out  # (the sampled keys were read, and not pulled)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_peer_reads_one_new_sampled_key_a_record_life(autojump_clock: object, seed: int) -> None:
    """Over ``t`` seconds of reads, however many, a split swarm's peer names at most ``POOL +
    ceil(t / ttl)`` keys besides those it follows (its region's and its join peers'): the keys it
    samples for the swarm's rate, each a node lookup of its replicas the first time, do not grow with
    the reads or the swarm (drawn anew each read, they were 4 new keys a read until every bucket had
    been read). And over a turn of the window every key is read. Reads' times and steps drawn."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=64, regions=16)
    async with swarm(config) as s:
        await s.start(train=False)  # (its join peer)
        me = await s.start(train=False)
        board, ttl = me.opt.board, config.progress.ttl
        reads: list[tuple[float, set[bytes]]] = []
        every: set[bytes] = set()
        start = trio.current_time()
        while trio.current_time() - start < 130 * ttl:  # (two turns of 63 periods)
            await trio.sleep(rng.choice([0.0, 0.1, 1.0, ttl, rng.uniform(0, 3 * ttl)]))
            me.opt.tally.epoch = epoch = rng.randrange(64)
            followed = {bucket_of(p.digest, board.bits) for p in me.node.join_peers}
            for e in (epoch, epoch + 1):
                followed |= set(region_buckets(board.bucket, board.bits, e, board.regions.span))
            read = set(board.reading())
            every |= read
            reads.append((trio.current_time(), read - {board.keys[b] for b in followed}))
        assert len(reads) > 100
        for _ in range(100):
            i = rng.randrange(len(reads))
            j = rng.randrange(i, len(reads))
            met = set().union(*(keys for _, keys in reads[i : j + 1]))
            assert len(met) <= POOL + math.ceil((reads[j][0] - reads[i][0]) / ttl), (i, j, len(met))
        assert every == set(board.keys)


@pytest.mark.parametrize("seed", [1, 2])
async def test_only_a_newcomer_follows_its_join_peers_buckets(autojump_clock: object, seed: int) -> None:
    """A split swarm's peer follows (pulls, and reads at every read) its join peers' buckets only while
    it has no partners: followed for good, a swarm's well-known join address made its bucket's key
    one that every peer read at every read (O(N) readers, the busiest node of every simulated run).
    With partners, it follows its region's buckets at its step and the next, whatever its join peers.
    Steps drawn; its join peer's bucket kept out of its regions' where the draw allows."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=64, regions=16)
    async with swarm(config) as s:
        await s.start(train=False)  # (its join peer)
        me = await s.start(train=False)
        board = me.opt.board
        joins = {bucket_of(p.digest, board.bits) for p in me.node.join_peers}
        assert joins
        pulled: list[bytes] = []

        async def pull(key: bytes, via: object) -> int:
            pulled.append(key)
            return 0

        me.node.dht.pull = pull  # type: ignore[method-assign]
        apart = 0
        for partners in (False, True):
            if partners:
                me.node.averager.remember_partners([Identity.generate().peer_id])
                assert me.node.averager.partners
            for _ in range(20):
                me.opt.tally.epoch = epoch = rng.randrange(64)
                region = set(region_buckets(board.bucket, board.bits, epoch, board.regions.span))
                region |= set(region_buckets(board.bucket, board.bits, epoch + 1, board.regions.span))
                pulled.clear()
                await board._pull([me.node.addresses[0]])
                expected = region if partners else region | joins
                assert sorted(pulled) == sorted(board.keys[b] for b in expected), (partners, epoch)
                apart += partners and not joins <= region
        assert apart  # (some steps' regions left the join peer's bucket out: it was not followed)
