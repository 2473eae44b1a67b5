"""A round whose deadline passes during a pass in a worker thread ends cleanly on every member.

A round's large passes run in worker threads (``averaging.offload``): the reducer's finalize, the
result's write into the round's memory, the commit into the caller's tensors (shielded, so never half
done). A deadline that passed meanwhile used to retire the round under the pass: its buffers were given
back under the commit, which then wrote nothing, and the round reported a commit while the caller's
tensors still held its own values; a reducer could be dropped under its finalize. The invariant: *each
member commits (its tensors hold the mean) or aborts with its tensors unchanged, and nothing else is
raised*, with one of those passes slowed past the deadline (virtual seconds) on some members or all.
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
PASSES = ["_settle", "finalize", "_keep_result"]


@pytest.mark.parametrize("seed", range(6))
async def test_a_pass_that_outlasts_the_deadline_ends_the_round_cleanly(
    autojump_clock: object, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    n = rng.choice([2, 3])
    slowed = PASSES[seed % len(PASSES)]
    delay = rng.choice([TIMEOUT, TIMEOUT / 2])
    real = allreduce.run_pass
    calls = 0

    async def slow(elements: int, fn: object, *args: object, passes: int = 1) -> object:
        nonlocal calls
        if getattr(fn, "__name__", "") == slowed:
            calls += 1
            if rng.random() < 0.7:  # as a thread's long pass, which a cancellation waits for: the
                with trio.CancelScope(shield=True):  # deadline may pass meanwhile
                    await trio.sleep(delay)
        return await real(elements, fn, *args, passes=passes)  # type: ignore[arg-type]

    monkeypatch.setattr(allreduce, "run_pass", slow)
    async with open_group(n) as group:
        originals = [make_tensors(i, [(1000,), (7, 3)], [torch.float32, torch.float32]) for i in range(n)]
        inputs = [[t.clone() for t in ts] for ts in originals]
        signed = sign_manifest(group.peers, inputs[0], timeout=TIMEOUT)
        outcomes = await run_round(group, signed, inputs, [1.0] * n)
    assert calls, f"no {slowed} pass ran"
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, RoundResult):
            members = [
                group.peers.index(next(p for p in group.peers if p.host.identity.peer_id == c))
                for c in outcome.contributors
            ]
            mean = [sum(originals[j][k] for j in members) / len(members) for k in range(2)]
            for got, want in zip(inputs[i], mean, strict=True):
                torch.testing.assert_close(got, want)
        else:
            assert isinstance(outcome, RoundAborted), outcome
            for got, orig in zip(inputs[i], originals[i], strict=True):
                assert torch.equal(got, orig), "an aborted member's tensors changed"
