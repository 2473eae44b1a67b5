"""The butterfly round's member-side decisions (round_machine), synchronous: messages and ``now`` in,
decisions and their reasons out. No event loop, no network, no tensors."""

from __future__ import annotations

import pytest

from p2ptrain.averaging.protocol import Decision, Manifest, MemberMsg, TensorSpec
from p2ptrain.averaging.round_machine import GONE_AFTER, STALLED_AFTER, Deadlines, RoundMachine
from p2ptrain.identity import Identity

IDS = [Identity.generate() for _ in range(4)]
PEERS = [i.peer_id for i in IDS]
DIGEST = b"d" * 16


def machine(
    me: int, *, sizes: tuple[int, ...] = (3, 3, 3, 3), caps: dict[int, float] | None = None
) -> RoundMachine:
    m = Manifest(
        round_id=bytes(16),
        group_key="t",
        members=tuple(MemberMsg(p.digest, f"a{i}" if sizes[i] else "", 1.0) for i, p in enumerate(PEERS)),
        sizes=sizes,
        schema=(TensorSpec((sum(sizes),), "float32"),),
        timeout=10.0,
    )
    return RoundMachine(m, DIGEST, me, 2.0, Deadlines.of(100.0, m.timeout), caps)


def test_deadlines_are_fractions_of_the_round() -> None:
    at = Deadlines.of(100.0, 10.0)
    assert (at.scatter, at.decide, at.await_decision, at.gather, at.end) == (
        104.0,
        105.0,
        106.0,
        109.0,
        110.0,
    )


@pytest.mark.parametrize(
    ("me", "decision", "resend", "take_over", "drop_own", "void"),
    [
        (1, Decision(DIGEST, (0, 1, 2, 3), (1, 1, 1, 1)), (), (), False, ()),
        # reducer 3 failed, 1 replaces it: the others send their slice of 3 to 1, 1 reduces it with its own
        (0, Decision(DIGEST, (0, 1, 2), (1, 1, 1), (3,), (1,)), ((3, 1),), (), False, (3,)),
        (1, Decision(DIGEST, (0, 1, 2), (1, 1, 1), (3,), (1,)), (), ((3, 2.0),), False, (3,)),
        # a replacement that is no contributor reduces without a slice of its own
        (1, Decision(DIGEST, (0, 2), (1, 1), (3,), (1,)), (), ((3, None),), False, (3,)),
        # a member left out sends nothing again; the failed reducer itself drops its own partition
        (3, Decision(DIGEST, (0, 1, 2), (1, 1, 1), (3,), (1,)), (), (), True, (3,)),
    ],
)
def test_the_decision_becomes_the_members_plan(me, decision, resend, take_over, drop_own, void) -> None:
    m = machine(me)
    plan = m.settle(decision, b"signed")
    assert plan is not None and not plan.abort
    assert (plan.resend, plan.take_over, plan.drop_own, plan.void_early) == (
        resend,
        take_over,
        drop_own,
        void,
    )
    assert m.decision_bytes == b"signed"
    assert m.settle(Decision(DIGEST, abort="late"), b"x") is None  # (settled once)


def test_an_aborted_decision_says_why() -> None:
    plan = machine(2).settle(Decision(DIGEST, abort="no reducer reported"), b"")
    assert plan is not None and plan.abort and "no reducer reported" in plan.reason


def test_a_replacement_takes_slices_of_the_failed_partition_only_once_decided() -> None:
    m = machine(1)
    assert m.takes_over(3) == "this member does not reduce partition 3"
    m.settle(Decision(DIGEST, (0, 1, 2), (1, 1, 1), (3,), (1,)), b"")
    assert m.takes_over(3) == ""
    assert m.holder(3) == 1 and m.holder(2) == 2


@pytest.mark.parametrize(
    ("p", "weight", "why"),
    [
        (1, 3.0, ""),
        (1, 100.0, "weight 100 is over 2 x the 4 its records make plausible"),
        (9, 1.0, ""),  # (misplaced, not distrusted)
    ],
)
def test_a_slice_claiming_implausible_weight_is_distrusted(p, weight, why) -> None:
    m = machine(1, caps={2: 4.0})
    assert m.distrust(2, p, weight, "", False, "") == why
    assert (2 in m.failed_senders.get(1, set())) == bool(why)  # our reducer need not wait for it


def test_misplaced_and_late_slices() -> None:
    m = machine(1, sizes=(3, 3, 0, 3))
    assert m.bad_weight(float("nan")) and m.bad_weight(0.0) and not m.bad_weight(1.0)
    assert m.misplaced(2) == "partition 2 does not exist"
    assert m.misplaced(7) == "partition 7 does not exist"
    assert m.misplaced(1) == ""
    m.close_scatter()
    assert m.misplaced(1) == "too late: this reducer already reported"


def test_a_reducer_stops_waiting_once_every_sender_delivered_or_failed() -> None:
    m = machine(0)
    assert not m.slices_settled({0, 1, 2})
    m.sender_failed(0, 3)
    assert m.slices_settled({0, 1, 2})


def test_a_member_whose_connections_stay_closed_is_gone_after_the_grace() -> None:
    m = machine(0)
    assert m.watch(set(PEERS), 100.0, {0}) == []  # everyone seen
    live = set(PEERS) - {PEERS[2]}
    assert m.watch(live, 101.0, {0}) == []
    assert m.watch(live, 101.0 + GONE_AFTER - 0.01, {0}) == []
    lines = m.watch(live, 101.0 + GONE_AFTER, {0})
    assert len(lines) == 1 and "is gone" in lines[0]
    assert 2 in m.gone and 2 in m.failed_senders[0]
    assert m.coordinator is not None and 2 in m.coordinator.unreachable


def test_a_member_never_reached_is_not_counted_gone() -> None:
    m = machine(1)
    assert m.watch(set(), 100.0, None) == [] and m.watch(set(), 200.0, None) == []
    assert not m.gone


def test_a_member_that_left_the_round_is_gone_at_once() -> None:
    m = machine(1)
    assert m.unreachable_reducer(3, False, {1}) == "" and m.unreachable == {3} and not m.gone
    assert "left the round" in m.unreachable_reducer(2, True, {1})
    assert 2 in m.gone and 2 in m.failed_senders[1]


def test_the_coordinator_decides_once_every_reducer_reported() -> None:
    m = machine(0, caps={3: 1.0})
    m.report_own({0: 2.0, 1: 1.0, 2: 1.0, 3: 5.0})
    assert not m.ready_to_decide(100.0)
    for r in (1, 2, 3):
        req = machine(r).report({0: 2.0, 1: 1.0, 2: 1.0, 3: 5.0})
        assert m.take_report(r, req) == ""
    assert m.ready_to_decide(100.0)
    decision, capped = m.decide()
    assert decision.contributors == (0, 1, 2, 3) and decision.weights == (2.0, 1.0, 1.0, 1.0)
    assert capped == [(3, 5.0, 1.0)]
    assert m.take_report(1, machine(1).report({0: 2.0})) == "the round is already decided"


def test_without_every_report_the_coordinator_decides_at_its_deadline() -> None:
    m = machine(0)
    assert not m.ready_to_decide(104.99) and m.ready_to_decide(105.0)


def test_outcome_and_blame_name_the_missing_partitions_holders() -> None:
    m = machine(2)
    assert m.blame() == {PEERS[0]: "its decision never came"}
    m.settle(Decision(DIGEST, (0, 1, 2), (1, 1, 1), (3,), (1,)), b"")
    m.finalized(2)
    assert m.owed == {(2, 0), (2, 1), (2, 3)}
    m.held.update({0})
    out = m.outcome()
    assert not out.committed and out.missing == [1, 3]
    assert m.blame() == {PEERS[1]: "partition 3 never came from it"}  # (it holds both: the last one named)
    m.held.update({1, 3})
    assert m.outcome().committed


def test_a_fetch_counts_as_stalled_after_a_quiet_while() -> None:
    m = machine(1)
    m.fetched(2, 103.0)
    assert m.stalled_at(2) == 103.0 + STALLED_AFTER


def test_the_round_is_done_once_its_member_finished_and_everyone_fetched() -> None:
    m = machine(1)
    m.finalized(1)
    assert not m.served(1, 0) and not m.finish()
    assert not m.served(1, 2)
    assert not m.served(1, 0)  # (member 0 again: member 3 has yet to fetch)
    assert m.served(1, 3)


@pytest.mark.parametrize("seed", range(20))
def test_a_reducer_serves_until_every_other_member_fetched_its_partition_however_often_some_fetch(
    seed: int,
) -> None:
    """A reducer stops serving (its round is done here, and later calls hear "the round is over") only
    once every other member fetched each partition it reduced, counting members, not fetches: a member
    served twice (its early chunks voided by the decision, then the result; a fetch again after a
    stall) is not another member served. Counted by fetches, at 128 simulated peers in groups of 112, a
    holder stopped serving while members still lacked its partition; they aborted the round that the
    others committed, and formed a second group of the same step: two lineages (forks at 2 steps)."""
    import random

    rng = random.Random(seed)
    me = rng.randrange(4)
    m = machine(me)
    mine = [me] + ([rng.choice([p for p in range(4) if p != me])] if rng.random() < 0.5 else [])
    for p in mine:
        m.finalized(p)
    owed = {(p, i) for p in mine for i in range(4) if i != me}
    served: list[tuple[int, int]] = []
    while owed:
        p, i = rng.choice(sorted(owed)) if rng.random() < 0.6 or not served else rng.choice(served)
        finished = not m.finished and rng.random() < 0.3
        done = m.finish() if finished else False
        done = m.served(p, i) or done
        served.append((p, i))
        owed.discard((p, i))
        assert done == (m.finished and not owed), (served, owed)
    assert m.finish()
