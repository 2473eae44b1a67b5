"""A reducer that answers "busy" is waited for, not given up: its slots admit the round's members once it
holds the manifest (``Host.expect``), which the members of a large group get a moment apart.

At 128 simulated peers with 48 inbound slots a node, 61 of the 65 slices that never reached their
reducer were refused "busy", none by a reducer that expected the sender yet (one traced ran the round
0.16 s after its first refusal), and rounds of the swarm's second step committed without half their
members. The invariant: a member whose reducer answers "busy" for less than the scatter's time delivers
its slice, and the round commits with every member, the exact mean.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.errors import HandshakeRefused
from tests.harness.averaging import check_invariant, make_tensors, open_group, run_round, sign_manifest


@pytest.mark.parametrize("seed", range(6))
async def test_a_reducer_busy_for_a_while_gets_every_members_slice(autojump_clock, seed):
    """Randomized: the group's size, which reducers answer "busy" (to every member dialling them), and
    for how long (up to a third of the scatter's time)."""
    from p2ptrain.averaging.allreduce import SCATTER

    rng = random.Random(seed)
    n = rng.randint(3, 6)
    timeout = 30.0
    async with open_group(n, seed=seed) as group:
        originals = [make_tensors(10 * seed + i, [(20_001,)], [torch.float32]) for i in range(n)]
        inputs = [[t.clone() for t in ts] for ts in originals]
        signed = sign_manifest(group.peers, inputs[0], timeout=timeout)
        began = trio.current_time()
        busy_until = {
            group.peers[r].addr: began + rng.uniform(0.2, SCATTER * timeout / 3)
            for r in rng.sample(range(n), rng.randint(1, n - 1))
        }
        refused = []
        for peer in group.peers:
            real = peer.host.connect

            async def connect(addr, *a, real=real, **kw):  # type: ignore[no-untyped-def]
                if trio.current_time() < busy_until.get(str(addr), -1.0):
                    refused.append(addr)  # (as a node whose slots are full answers a peer it does not expect)
                    raise HandshakeRefused("busy", "too many connections; try later", by_remote=True)
                return await real(addr, *a, **kw)

            peer.host.connect = connect  # type: ignore[method-assign]
        with trio.fail_after(2 * timeout):
            outcomes = await run_round(group, signed, inputs, [1.0] * n)
        took = trio.current_time() - began
    assert refused, "no member heard busy"
    assert all(isinstance(o, RoundResult) and len(o.contributors) == n for o in outcomes), outcomes
    assert check_invariant(originals, inputs, [1.0] * n, outcomes) == "commit"
    assert took < SCATTER * timeout, took
