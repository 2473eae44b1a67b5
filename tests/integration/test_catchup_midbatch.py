"""A sync peer joins the group of its step when one forms while it is on the step, mid-batch too.

The invariant: a peer that is on a step and has samples to give looks for that step's group whenever the
swarm's records put the target within reach, not only when one of its batches ends, so that it is in
the group whether the group forms between two of its batches or at the end of one (``CollaborativeOptimizer
._look_between_batches``). It looked only at the end of its batches (one batch ahead, at most the
matchmaking time): a group whose leader gathered and sealed it within one of its batches formed without
it, the peer was then a step behind and replayed that step, and each replay landed after the next group
had formed. Over the in-memory network on the virtual clock: two peers with batches of 1.5 s, one with
batches of 6 s (longer than the 2 s a leader waits), steps of about 15 s.
"""

from __future__ import annotations

import pytest

from p2ptrain.training.optimizer.bookkeeping import RoundStats
from tests.harness.training import check_identical_per_epoch, run_config, swarm

pytestmark = pytest.mark.timeout(180)

LONG_BATCH = 6.0  # seconds: longer than a leader's wait (run_config's matchmaking_time, 2 s)
STEPS = 7


async def test_a_peer_with_long_batches_averages_in_the_steps_it_is_on(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the code before, the long-batch peer's samples went into 1 of the 10 steps (then it replayed
    every step, a step behind); now into most of them, and it downloads nothing."""
    cfg = run_config("sync").replace("averaging", timeout=30.0).replace("training", target_batch_size=160)
    mine: dict[int, list[tuple[int, int]]] = {}
    note_step = RoundStats.note_step

    def noted(self: RoundStats, last: dict[str, object]) -> None:
        mine.setdefault(id(self), []).append((int(last["epoch"]), int(last.get("mine", 0))))  # type: ignore[call-overload]
        note_step(self, last)

    monkeypatch.setattr(RoundStats, "note_step", noted)
    async with swarm(cfg, summed=True) as s:
        fast = [await s.start(compute=1.5) for _ in range(2)]
        slow = await s.start(compute=LONG_BATCH)
        await s.until(lambda: fast[0].opt.epoch >= STEPS, timeout=170)
    steps = fast[0].opt.epoch
    went_in = sorted({e for e, n in mine.get(id(slow.opt.stats), []) if n > 0})
    detail = (went_in, steps, [(e, outcome) for e, _, outcome, _ in slow.steps])
    assert len(went_in) >= 0.8 * steps, detail
    assert slow.opt.shared.downloads == 0, detail
    check_identical_per_epoch([*fast, slow])
