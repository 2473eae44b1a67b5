"""A training peer whose group failed to form looks again within the retry gap, not at its next batch.

The invariant (``RoundRunner._matchmake``): after a look for its step's group ended without one, a peer
still on that step, with no round or download in flight, goes on looking: it begins the next look within
``RoundRunner.retry_gap`` (under half the matchmaking window), whatever its batches take, unless the
peers one step behind hold the group back (then it looks again once they arrived). Restarted by
its batches instead, a peer was unannounced for up to a batch after each failed look: two peers whose
batches ran out of phase led alternate windows of one step, each alone, for good (a 3-peer DiLoCo swarm
of ``test_catchup`` took 1-2 steps in 60 s, about 1 run in 3).

Checked on a swarm whose batches take 2.5 matchmaking windows, with failures injected at random into
the peers' looks (seeded; each seed a different pattern): no failed look whose peer stayed on the step
ends the peer's looking, most are followed by the next one within the gap, and the swarm's peers stay
on one set of parameters.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.averaging.averager import Averager
from p2ptrain.errors import GroupFormationFailed
from tests.harness.training import Peer, check_identical_per_epoch, run_config, swarm

BATCH_TIME = 5.0  # virtual seconds per batch: 2.5 matchmaking windows (``run_config``: 2 s)
SLACK = 0.5  # for the fresh read of the progress records a look begins with


@pytest.mark.timeout(300)  # ~10 s of CPU each; longer on a busy machine
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_failed_look_is_followed_by_the_next_within_the_retry_gap(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = random.Random(seed)
    form_group = Averager.form_group
    starts: dict[int, list[float]] = {}  # id(averager) -> when each of its looks began
    peers: dict[int, Peer] = {}
    checked: list[tuple[int, float]] = []  # (peer, failed at) whose next look was due
    late: list[tuple[int, float, float | None]] = []  # the look ended with the failure
    prompt: list[tuple[int, float]] = []  # the next look began within the gap
    watching: list[trio.Nursery] = []  # (where the checks run)

    async def due(peer: Peer, epoch: int, failed_at: float) -> None:
        gap = peer.opt.rounds.retry_gap()
        await trio.sleep(gap + SLACK)
        opt = peer.opt
        view = opt.board.view
        if opt.tally.epoch != epoch or opt.rounds.in_flight is not None or opt.shared.download is not None:
            return  # it moved on: no look of that step was due
        if view is None or view.behind:
            return  # the others took the step without it: it catches up instead
        checked.append((peer.index, failed_at))
        after = [t for t in starts[id(opt.node.averager)] if t > failed_at]
        if after and after[0] - failed_at <= gap + SLACK:
            prompt.append((peer.index, failed_at))
        elif not opt.rounds.matchmaking:  # (it may wait for peers one step behind, still looking)
            late.append((peer.index, failed_at, after[0] if after else None))

    async def injected(self: Averager, *args: object, **kw: object) -> object:
        starts.setdefault(id(self), []).append(trio.current_time())
        peer = peers[id(self)]
        if rng.random() < 0.4:  # this look fails, as one whose group came out too small does
            await trio.sleep(rng.uniform(0.0, 2.0))
            watching[0].start_soon(due, peer, peer.opt.tally.epoch, trio.current_time())
            raise GroupFormationFailed("injected: no group formed in time")
        return await form_group(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Averager, "form_group", injected)
    async with trio.open_nursery() as nursery, swarm(run_config()) as s:
        watching.append(nursery)
        for _ in range(3):
            p = await s.start(compute=BATCH_TIME)
            peers[id(p.node.averager)] = p
        await trio.sleep(90)
        nursery.cancel_scope.cancel()
    assert len(checked) >= 3, (checked, [p.steps for p in s.peers])  # the check had cases to check
    assert not late, late
    assert len(prompt) >= len(checked) / 2, (prompt, checked)
    assert min(len(p.steps) for p in s.peers) >= 3, [p.steps for p in s.peers]
    check_identical_per_epoch(s.peers)
