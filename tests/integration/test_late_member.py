"""A member of a formed group that starts its round late is not left out of it.

A member learns its group's manifest when the group forms, and runs the round when its caller gets to it:
a training loop between two batches (DiLoCo without overlap, and a sharded site always, whose
pseudo-gradient is a collective of its ranks), after a pass over its parameters. The others start at
once and send it their slices of the partition it reduces. The round's rule is that they wait for a
member's own slices until the scatter deadline (0.4 of the round's timeout); the member's side must keep
the same promise for the slices sent to it. On the code before, a call for a round the callee had not
started waited ``ROUND_WAIT`` (10 s) and was then refused ("unknown round"): a 2-rank site of a 123M
GPT, whose batch and handoff took longer than that, lost the delivery of every partition it reduced,
and every round of its group fell short of its quorum (step 1 was never taken in 12 minutes).

The invariant, tried with random group sizes, late members and delays: every member that runs the
round before the scatter deadline is a contributor, and every member holds the same exact average.
Calls from peers that are not members of a formed group still wait ``ROUND_WAIT`` at most
(``test_robust_rounds``).
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.averaging.averager import ROUND_WAIT
from p2ptrain.averaging.round_machine import SCATTER
from tests.harness.nodes import swarm

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 100.0  # the round's: its scatter deadline is 40 s after a member starts


def values(i: int) -> list[torch.Tensor]:
    return [torch.full((3000,), float(i + 1)), torch.arange(11, dtype=torch.float32) * (i + 1)]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_member_that_starts_its_round_late_is_still_a_contributor(autojump_clock, seed):
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    late = rng.sample(range(n), rng.randint(1, n - 1))
    # late ones start past the wait for an unknown round, well within the scatter deadline
    delays = [
        rng.uniform(ROUND_WAIT + 1.0, 0.7 * SCATTER * TIMEOUT) if i in late else rng.uniform(0.0, 1.0)
        for i in range(n)
    ]
    out: list[RoundResult | BaseException | None] = [None] * n
    avg = AveragerConfig(target_size=n, min_size=n, matchmaking_time=3.0)
    async with swarm(n, avg) as nodes:

        async def member(i: int) -> None:
            mine = values(i)
            try:
                signed = await nodes[i].averager.form_group(mine, timeout=TIMEOUT, group_key="late")
                await trio.sleep(delays[i])  # (its caller gets to the round only now)
                out[i] = await nodes[i].averager.run_round(signed, mine)
            except Exception as e:  # (reported below, with the delays)
                out[i] = e

        with trio.fail_after(3 * TIMEOUT):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(member, i)
    results = [r for r in out if isinstance(r, RoundResult)]
    assert len(results) == n, (delays, out)
    assert len({r.round for r in results}) == 1
    for r in results:
        assert len(r.contributors) == n, (delays, r.contributors)
        expected = sum(range(1, n + 1)) / n
        assert torch.equal(r.tensors[0], torch.full((3000,), expected)), delays
        assert torch.equal(r.tensors[1], results[0].tensors[1])
