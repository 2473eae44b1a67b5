"""A peer's position in the run (``Tally``): what its record says of how it came to its step."""

from __future__ import annotations

from p2ptrain.identity import Identity
from p2ptrain.training.optimizer.bookkeeping import Tally


def test_a_committed_round_says_averaged_whoever_else_contributed_and_nothing_else_does() -> None:
    tally = Tally(0.0)
    assert not tally.averaged  # (the run's first step: nothing took it here)
    other = Identity.generate().peer_id
    tally.advance(frozenset(), by_round=True)  # a round whose only contributor was this peer
    assert tally.averaged and tally.epoch == 1
    tally.advance(frozenset({other}), by_round=True)
    assert tally.averaged and tally.cohort == (2, frozenset({other}))
    tally.advance(frozenset(), by_round=False)  # a step alone
    assert not tally.averaged
    tally.advance(frozenset({other}), by_round=True)
    tally.moved_to(4)  # a download (or a checkpoint) of the same step
    assert not tally.averaged and tally.epoch == 4
