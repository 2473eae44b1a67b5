"""A reducer that fails a slice for a moment is tried again, not given up (``AllReduceRound._deliver``).

At 128 simulated peers with 48 inbound slots a node, 61 of the 65 slices that never reached their
reducer were refused "busy", none by a reducer that expected the sender yet (one traced ran the round
0.16 s after its first refusal), and rounds of the swarm's second step committed without half their
members. With that fixed, 10 members of a round of 32 lost their slices to reducers that closed the
connection under them (over their slots, a node closes an idle connection when a round member arrives,
and one idle a moment ago may be the one a sender just began to use); they gave up with 12 s of the
scatter left, and the round committed short of its members' quorums. The invariant: a member whose
reducer fails its slice so (busy, or the connection closed) for less than the scatter's time delivers
it, and the round commits with every member, the exact mean.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.protocol import PART
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
        await _every_member_contributes(group, signed, originals, inputs, timeout, began)
    assert refused, "no member heard busy"


@pytest.mark.parametrize("seed", range(6))
async def test_a_slice_whose_connection_closes_under_it_is_sent_again(autojump_clock, seed):
    """Randomized: the group's size, which reducers' connections close as a member's slice starts on
    them (the request lost, as where the reducer evicted the connection as the request left), how many
    of each member's tries (1 to 3), and until when (up to a third of the scatter's time)."""
    from p2ptrain.averaging.allreduce import SCATTER

    rng = random.Random(100 + seed)
    n = rng.randint(3, 6)
    timeout = 30.0
    async with open_group(n, seed=seed) as group:
        originals = [make_tensors(10 * seed + i, [(20_001,)], [torch.float32]) for i in range(n)]
        inputs = [[t.clone() for t in ts] for ts in originals]
        signed = sign_manifest(group.peers, inputs[0], timeout=timeout)
        began = trio.current_time()
        closing = rng.sample(range(n), rng.randint(1, n - 1))
        until = {group.peers[r].addr: began + rng.uniform(0.2, SCATTER * timeout / 3) for r in closing}
        tries = {(i, r): rng.randint(1, 3) for i in range(n) for r in closing if i != r}
        by_addr = {group.peers[r].addr: r for r in closing}
        closed = []
        for i, peer in enumerate(group.peers):
            real = peer.host.connect

            async def connect(addr, *a, i=i, real=real, **kw):  # type: ignore[no-untyped-def]
                conn = await real(addr, *a, **kw)
                r = by_addr.get(str(addr))
                if r is None or trio.current_time() >= until[str(addr)] or tries[i, r] == 0:
                    return conn
                open_stream = conn.open_stream

                def closed_under(method, *args, **kw2):  # type: ignore[no-untyped-def]
                    if method is PART and tries[i, r] > 0:
                        tries[i, r] -= 1
                        closed.append((i, r))
                        conn.close_soon(group.nursery, "evicted: over 48 inbound connections")
                    return open_stream(method, *args, **kw2)

                conn.open_stream = closed_under  # type: ignore[method-assign]
                return conn

            peer.host.connect = connect  # type: ignore[method-assign]
        await _every_member_contributes(group, signed, originals, inputs, timeout, began)
    assert closed, "no slice had its connection closed under it"


async def _every_member_contributes(group, signed, originals, inputs, timeout, began):  # type: ignore[no-untyped-def]
    """Run the round: every member commits with every member's slice, the exact mean, before the
    scatter's deadline."""
    from p2ptrain.averaging.allreduce import SCATTER

    n = len(group.peers)
    with trio.fail_after(2 * timeout):
        outcomes = await run_round(group, signed, inputs, [1.0] * n)
    took = trio.current_time() - began
    assert all(isinstance(o, RoundResult) and len(o.contributors) == n for o in outcomes), outcomes
    assert check_invariant(originals, inputs, [1.0] * n, outcomes) == "commit"
    assert took < SCATTER * timeout, took
