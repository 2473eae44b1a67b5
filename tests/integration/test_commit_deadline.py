"""A round whose deadline passes while it writes its result is committed, not timed out.

The commit writes the round's result into the caller's tensors (in a worker thread for a large vector,
shielded from cancellation so it is never half done). A deadline that passed meanwhile used to turn
the round into a timeout once the commit was done: the caller was told its round failed, with its
tensors already holding the result, and an abort must leave them untouched. The invariant: *a member
either commits (its tensors hold the mean) or aborts with its tensors unchanged*, here with the commit
slowed past the deadline (virtual seconds) on one member or all.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import allreduce
from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.errors import RoundAborted
from tests.harness.averaging import make_tensors, open_group, run_round, sign_manifest

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 20.0


@pytest.mark.parametrize("seed", range(4))
async def test_a_commit_that_outlasts_the_deadline_is_a_commit(
    autojump_clock: object, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    n = rng.choice([2, 3])
    slow = set(rng.sample(range(n), rng.randint(1, n)))
    real = allreduce.run_pass
    names: dict[int, int] = {}

    async def slow_commit(elements: int, fn: object, *args: object, passes: int = 1) -> object:
        owner = getattr(fn, "__self__", None)
        if getattr(fn, "__name__", "") == "_settle" and names.get(id(owner)) in slow:
            await trio.sleep(TIMEOUT)  # (shielded: the deadline passes meanwhile)
        return await real(elements, fn, *args, passes=passes)  # type: ignore[arg-type]

    monkeypatch.setattr(allreduce, "run_pass", slow_commit)
    real_init = allreduce.AllReduceRound.__init__

    def init(self: allreduce.AllReduceRound, host: object, *a: object, **k: object) -> None:
        real_init(self, host, *a, **k)  # type: ignore[arg-type]
        names[id(self)] = [p.host for p in group.peers].index(host)

    monkeypatch.setattr(allreduce.AllReduceRound, "__init__", init)
    async with open_group(n) as group:
        originals = [make_tensors(i, [(1000,), (7, 3)], [torch.float32, torch.float32]) for i in range(n)]
        inputs = [[t.clone() for t in ts] for ts in originals]
        signed = sign_manifest(group.peers, inputs[0], timeout=TIMEOUT)
        outcomes = await run_round(group, signed, inputs, [1.0] * n)
    mean = [sum(o[k] for o in originals) / n for k in range(2)]
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, RoundResult):
            for got, want in zip(inputs[i], mean, strict=True):
                torch.testing.assert_close(got, want)
        else:
            assert isinstance(outcome, RoundAborted), outcome
            for got, orig in zip(inputs[i], originals[i], strict=True):
                assert torch.equal(got, orig), "an aborted member's tensors changed"
    assert any(isinstance(outcomes[i], RoundResult) for i in slow)  # (the slowed commits committed)
