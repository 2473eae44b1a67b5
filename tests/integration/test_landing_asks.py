"""A split swarm's round lands only where no peer its member trusts, of its region and outside its group,
took the step by another round, whether or not a record of that has been read yet (``taken``): peers
over the in-memory network on the virtual clock, asked directly as the round lands.

(256 simulated peers, the first step: a member of a group that landed 1.9 s after another group of its
region trusted one of that group's members, its join peer; the records it held still put that peer on
the step, and it applied its round: two states of one step.)
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import trio

from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.protocol import MemberMsg
from p2ptrain.errors import ConnectionClosed, HandshakeRefused, PeerUnavailable
from p2ptrain.identity import PeerID
from p2ptrain.net.address import PeerAddress
from p2ptrain.training.optimizer.buckets import Regions
from p2ptrain.training.optimizer.progress import PeerProgress, with_author
from p2ptrain.training.optimizer.taken import ASKED, WAIT
from tests.harness.training import Peer, run_config, swarm

pytestmark = pytest.mark.timeout(300)

OTHERS = 11  # peers besides the asking one (about half of them in its region at each step)


def _stale(p: Peer, epoch: int) -> PeerProgress:
    """``p``'s record as the asker read it a while ago: on ``epoch``, no round landed yet."""
    rec = with_author(p.opt.record(), p.node.peer_id)
    return PeerProgress(p.node.peer_id, dataclasses.replace(rec, epoch=epoch, averaged=False, leaving=False))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_a_landing_member_hears_of_a_step_a_trusted_peer_of_its_region_took_before_any_record_says_so(
    autojump_clock: object, seed: int
) -> None:
    """Random swarms of answering peers: each took the step by a round of its own or not (committed,
    applied or still landing; some took only other steps), is trusted by the asker or not, in its region
    at the step or not, in the landing round's group or not, and the asker read its record on the step,
    one before, three before, two past, or not at all, none saying the step was taken; and each
    answers, or its slots are full ("busy", as a node's inbound admission says to a newcomer), or it is
    gone, or its connection closes under the ask 1 to 3 times (evicted as the ask left; then it
    answers). The asker asks the peers it trusts, of its region, outside the group, whatever their
    records say (the witnesses; one whose record it did not read over a connection it holds, if any).
    It finds the step taken, naming one, when a witness that answers took it; else it drops its copy,
    naming one, when a witness stayed busy (alive on the step: it could have taken it); else it finds
    nothing. It never asks more than ``ASKED`` nor waits past ``WAIT``; peers it does not trust, that
    took the step or not, change nothing. On the code before: "busy" was a "no"; a connection closed
    under the ask was silence; and only peers read on the step or the one before were asked, so a
    peer that had taken the step and moved on went unheard (a fork at 128 simulated peers)."""
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        first = await s.start(train=False)
        me = await s.start(train=False)
        others = [first] + [await s.start(train=False) for _ in range(OTHERS - 1)]
        board, taken = me.opt.board, me.opt.rounds.taken
        host, real_connect = me.node.host, me.node.host.connect
        state: dict[PeerID, str] = {}  # "busy", "gone" or "closes" (else it answers)
        closes: dict[PeerID, int] = {}  # "closes": the tries whose connection closes under the ask

        async def connect(address, **kw):  # type: ignore[no-untyped-def]
            pid = address.peer_id if isinstance(address, PeerAddress) else None
            how = state.get(pid) if pid is not None else None
            if how == "busy":
                raise HandshakeRefused("busy", "too many connections; try later", by_remote=True)
            if how == "gone":
                raise PeerUnavailable("cannot reach it: the peer is gone")
            if (
                how == "closes" and closes[pid] > 0
            ):  # (as a node over its slots evicts it, the ask on its way)
                closes[pid] -= 1
                raise ConnectionClosed(
                    "connection closed: remote closed: evicted: over 48 inbound connections"
                )
            return await real_connect(address, **kw)

        host.connect = connect  # type: ignore[method-assign]
        seen: set[str] = set()
        for _ in range(40):
            epoch = rng.randint(0, 4)
            trusted = {p.node.peer_id for p in others if rng.random() < 0.6}
            group = {p.node.peer_id for p in others if rng.random() < 0.3} | {me.node.peer_id}
            records, witnesses, took = [], set(), set()
            state.clear()
            for p in others:
                pid = p.node.peer_id
                p.opt.rounds.taken.dropped(epoch)
                if rng.random() < 0.4:
                    took.add(pid)
                    p.opt.rounds.taken.committed(epoch)
                for other in rng.sample(range(6), 2):  # (rounds of other steps say nothing of this one)
                    if other != epoch:
                        p.opt.rounds.taken.committed(other)
                read = rng.choice([epoch, epoch, max(0, epoch - 1), max(0, epoch - 3), epoch + 2, None])
                # (a peer whose record was not read is asked over a connection held with it, if any,
                # which no dial's failure touches here)
                how = rng.choice(["answers", "answers", "answers", "busy", "gone", "closes"])
                if how != "answers" and read is not None:
                    state[pid] = how
                    closes[pid] = rng.randint(1, 3)
                if read is not None:
                    records.append(_stale(p, read))
                if (
                    pid in trusted
                    and pid not in group
                    and regions.together(pid, me.node.peer_id, epoch)
                    and (read is not None or host.connection(pid) is not None)
                ):
                    witnesses.add(pid)
            board.records = records
            board.trusted = lambda t=frozenset(trusted): t  # type: ignore[method-assign,misc]
            asked_before, busy_before, began = taken.asked, taken.busy, trio.current_time()
            found = await taken.elsewhere(epoch, frozenset(group))
            assert trio.current_time() - began <= WAIT + 0.01
            assert taken.asked - asked_before <= ASKED
            answered = {w for w in witnesses & took if state.get(w, "closes") == "closes"}
            busy = {w for w in witnesses if state.get(w) == "busy"}
            if answered:
                assert any(
                    found == f"a group of {w.short()}, a peer it trusts, took its region's step {epoch}"
                    for w in answered
                ), (epoch, found)
                seen.add("took")
            elif busy:
                assert any(
                    found.startswith(f"{w.short()}, a peer it trusts,") and "stayed busy" in found
                    for w in busy
                ), (epoch, found)
                assert taken.busy == busy_before + 1
                seen.add("busy")
            else:
                assert found == "", (epoch, found, witnesses, took, state)
                seen.add("none")
        assert seen == {"took", "busy", "none"}


@pytest.mark.parametrize("listed", [False, True])
async def test_a_member_drops_its_copy_of_a_round_whose_step_a_trusted_peer_took_unread(
    autojump_clock: object, listed: bool
) -> None:
    """Training peers of a split swarm: as a member's round lands, a peer it trusts, of its region and
    outside its group, whose record it read on the step (no round landed yet), is asked. Where that peer
    took the step by a round of its own, the member's copy is not applied (its parameters stay as they
    were, the abort says why); where it did not, the round is applied; the swarm goes on with one state
    per region and step. (On the code before, the record read was all it went by: applied each time.)

    ``listed``: that peer is also listed in the landing round's manifest, signed out (it declined the
    group, and took the step in another): outside the group all the same, as it contributed nothing to
    this round. (On the code before, every peer the manifest listed counted as the group's, so such a
    peer was never asked, and the copy was applied: a fork at 128 simulated peers with 48 slots.)"""
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    async with swarm(config) as s:
        peers = [await s.start(compute=c) for c in (0.1, 0.15, 0.2, 0.1, 0.15)]
        me = peers[1]
        witnesses = [await s.start(train=False) for _ in range(8)]
        opt, board = me.opt, me.opt.board
        real_land, real_trusted = opt.rounds.land_flight, board.trusted
        landed: list[tuple[int, bool, bool]] = []  # (step, taken elsewhere, applied)

        async def land(flight, outcome, tensors, weight):  # type: ignore[no-untyped-def]
            if not isinstance(outcome, RoundResult) or len(landed) >= 4:
                return await real_land(flight, outcome, tensors, weight)
            elsewhere = len(landed) % 2 == 0  # (every other one: drop, apply, drop, apply)
            there = [w for w in witnesses if regions.together(w.node.peer_id, me.node.peer_id, flight.epoch)]
            assert there, "no witness in the member's region"
            w = there[0]
            w.opt.rounds.taken.dropped(flight.epoch)
            if elsewhere:
                w.opt.rounds.taken.committed(flight.epoch)
            if listed:  # (the manifest lists it, signed out: as a leader signs one that declines)
                signed = flight.manifest
                m = signed.manifest
                out = len(m.members)
                m = dataclasses.replace(
                    m,
                    members=(*m.members, MemberMsg(w.node.peer_id.digest, "", 1.0)),
                    sizes=(*m.sizes, 0),
                    needs=(*m.needs, 0),
                    counts=(*m.counts, b""),
                    out=(*m.out, out),
                )
                m.check()
                flight = dataclasses.replace(flight, manifest=dataclasses.replace(signed, manifest=m))
            before, kept = me.params_hash(), board.records
            board.records = [*kept, _stale(w, flight.epoch)]
            trusted: frozenset[PeerID] = (real_trusted() or frozenset()) | {w.node.peer_id}
            board.trusted = lambda: trusted  # type: ignore[method-assign]
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
        await s.until(lambda: len(landed) >= 4, timeout=200)
        await s.until(lambda: all(p.opt.epoch >= landed[-1][0] + 2 for p in peers), timeout=200)
    assert [(taken, applied) for _, taken, applied in landed] == [(True, False), (False, True)] * 2, landed
    assert sum("a peer it trusts, took its region's step" in why for why in reasons) == 2, reasons
