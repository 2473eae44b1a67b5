"""A record's ``toward`` (the step a replay in flight lands its peer on) moves only who a group waits for.

The invariant (``progress.swarm_view``): a peer further behind than one step whose record says it is
catching up to a step ``at`` or the one before is *arriving* in the view of ``at`` (a leader of ``at``'s
group waits for it until its deadline), and ``toward`` changes nothing else in any view: not the peers
on the step, the quorum, the samples, the rate, the newest step, the majority digest, the donors. So a
free identity that writes any ``toward`` it likes can delay a group by its leader's deadline, as a
record one step behind can, and can neither form nor block one.

Checked over random swarms of honest and hostile records (any epoch, any ``toward``, trusted or not,
leaving or not), every view of every step they name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.progress import PeerProgress, ProgressRecord, SwarmView, swarm_view

NOW = 1000.0
RUN = b"run-fingerprint!"
ME = PeerID(bytes([0]) * 32)
DIGESTS = (b"\xaa" * 32, b"\xbb" * 32)


def pid(n: int) -> PeerID:
    return PeerID(bytes([n]) * 32)


records = st.builds(
    lambda epoch, toward, samples, rate, digest, landing, leaving: ProgressRecord(
        epoch=epoch,
        samples=samples,
        rate=rate,
        time=NOW,
        digest=digest,
        addr="/ip4/198.18.0.9/tcp/4001",
        run=RUN,
        landing=landing,
        leaving=leaving,
        toward=toward,
    ),
    epoch=st.integers(0, 8),
    toward=st.integers(0, 10),
    samples=st.integers(0, 200),
    rate=st.floats(0.0, 50.0),
    digest=st.sampled_from(DIGESTS),
    landing=st.booleans(),
    leaving=st.booleans(),
)


def views(
    mine: ProgressRecord, others: list[PeerProgress], trusted: frozenset[PeerID] | None, steps: list[int]
) -> list[SwarmView]:
    common: dict[str, Any] = dict(now=NOW, target=100, horizon=2.0, trusted=trusted)
    return [swarm_view(ME, mine, others, epoch=at, **common) for at in steps]


def decisions(v: SwarmView) -> SwarmView:
    """``v`` but its ``arriving``, its donors named by their ids (their records carry ``toward``)."""
    return dataclasses.replace(
        v, arriving=0, donors=tuple(PeerProgress(d.peer, without_toward(d).record) for d in v.donors)
    )


def without_toward(o: PeerProgress) -> PeerProgress:
    return PeerProgress(o.peer, dataclasses.replace(o.record, toward=0))


@settings(max_examples=300, deadline=None)
@given(
    mine=records,
    others=st.lists(records, max_size=12),
    trusted_mask=st.lists(st.booleans(), min_size=12, max_size=12),
    private=st.booleans(),
)
def test_toward_moves_only_the_arriving_count(
    mine: ProgressRecord, others: list[ProgressRecord], trusted_mask: list[bool], private: bool
) -> None:
    mine = dataclasses.replace(mine, leaving=False)
    peers = [PeerProgress(pid(i + 1), r) for i, r in enumerate(others)]
    trusted = None if private else frozenset(p.peer for p, t in zip(peers, trusted_mask, strict=False) if t)
    named = {mine.epoch, *(o.record.epoch for o in peers), *(o.record.toward for o in peers)}
    steps = sorted(at for at in named if at >= mine.epoch)
    with_claims = views(mine, peers, trusted, steps)
    plain = views(mine, [without_toward(o) for o in peers], trusted, steps)
    for at, claimed, honest in zip(steps, with_claims, plain, strict=True):
        # Everything but ``arriving`` is as if no record said ``toward`` at all.
        assert decisions(claimed) == decisions(honest)
        # Arriving: exactly the live peers more than a step behind that catch up to ``at`` or the step
        # before (this peer's own record among them when it views a step its record does not say).
        coming = [
            o
            for o in (*peers, *([PeerProgress(ME, mine)] if at != mine.epoch else []))
            if o.record.epoch + 1 < at and at - 1 <= o.record.toward <= at and not o.record.leaving
        ]
        assert claimed.arriving - honest.arriving == len(coming) - (
            at != mine.epoch and mine.epoch + 1 < at and at - 1 <= mine.toward <= at
        ), (claimed, honest)


def test_a_home_replaying_two_steps_behind_is_waited_for_and_one_that_is_not_catching_up_is_not() -> None:
    """The lab's case: the swarm on step 9, the home's record of step 7 with its replay landing it on
    step 8 (it then joins step 9's group ahead): a leader of 9 counts it as arriving; the same record
    without a replay in flight (a peer that lost touch, or downloads the whole state) is not."""
    mine = ProgressRecord(epoch=9, samples=50, rate=10.0, time=NOW, digest=DIGESTS[0], run=RUN)
    fast = [PeerProgress(pid(i), dataclasses.replace(mine, samples=40)) for i in (1, 2)]
    home = ProgressRecord(epoch=7, samples=0, rate=5.0, time=NOW, digest=DIGESTS[1], run=RUN)
    for toward, arriving in ((8, 1), (9, 1), (0, 0), (7, 0), (10, 0)):
        others = [*fast, PeerProgress(pid(3), dataclasses.replace(home, toward=toward))]
        v = swarm_view(ME, mine, others, now=NOW, target=100, horizon=2.0, trusted=None)
        assert v.arriving == arriving, (toward, v)
        assert v.peers == 3 and v.quorum == 2  # the home is never one of the step's peers
