"""An in-place round whose backup write takes a while still commits the exact mean on every member.

A member averaging in place backs its own values of a partition up before that partition's early
averages land in its tensor; a large partition is backed up in a worker thread, and the reducer's first
chunks could arrive meanwhile. They used to be in the stream before its landing targets were given, so
every later chunk landed one target early and overwrote the one before: 4 of 12 rounds of 12.6M values
on two members committed misplaced chunks. Now the backup is written before the early fetch opens its
stream, and a stream's targets count from its first chunk whenever they are given
(``test_stream_landing.py``). Here the backup write is slowed (virtual seconds) so that the chunks
would arrive first, over members and seeds.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import gathering, spill
from p2ptrain.averaging.allreduce import RoundResult
from tests.harness.averaging import open_group, run_round, sign_manifest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("seed", range(4))
async def test_a_slow_backup_write_never_misplaces_the_early_averages(
    autojump_clock: object, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    n = rng.choice([2, 3])
    real = spill.put

    async def slow(file: spill.SpillFile, data: object) -> spill.Spilled:
        await trio.sleep(rng.uniform(0.2, 1.0))  # (a large partition's write, in a worker thread)
        return await real(file, data)  # type: ignore[arg-type]

    monkeypatch.setattr(gathering.spill, "put", slow)
    values = n * 4 * 262_144 + rng.randrange(1000)  # several chunks per partition
    async with open_group(n) as group:
        torch.manual_seed(seed)
        inputs = [[torch.randn(values)] for _ in range(n)]
        want = sum(t[0].double() for t in inputs) / n
        signed = sign_manifest(group.peers, inputs[0])
        outcomes = await run_round(group, signed, inputs, [1.0] * n, in_place=True)
    assert all(isinstance(o, RoundResult) for o in outcomes), outcomes
    for got in inputs:
        torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)
