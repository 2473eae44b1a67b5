"""One committed round, one decision, in a training swarm (issue 51's forks): collaborative peers over the
in-memory network, on the virtual clock.

The leader of a committed round and every member it counts apply it, or none of them does (where its
contributors miss the quorums the manifest signed); a member it does not count (a late joiner it does
not trust yet) may discard it alone, never apply one the others discard; and the swarm stays one
lineage, while members drop out of formed groups at
random (seeded), peers join late and, until their first round, trust only their join peer (their quorum
is then that peer and themselves, where the others' is a majority of everyone).

On the code before, each member checked a committed round's contributors against its own quorum: a
member whose join peer had dropped out of the group threw the round away while the others applied it
(and at 32 simulated peers, the discarders formed a second group of the same step: two lineages).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from p2ptrain.errors import GroupFormationFailed
from tests.harness.training import Peer, Swarm, check_identical_per_epoch, run_config, swarm


def instrument(
    peer: Peer,
    rng: random.Random,
    dropout: float,
    committed: dict[bytes, set[int]],
    applied: dict[bytes, set[int]],
    binding: dict[bytes, set[Any]],
) -> None:
    """Record the rounds ``peer`` committed and those it applied; drop out of a formed group at random
    (as a member whose state moved on, or that crashed, does: it tells the group and forms no round)."""
    averager = peer.node.averager
    form, run, credit = averager.form_group, averager.run_round, averager.trained_with

    async def form_group(tensors: Any, **kw: Any) -> Any:
        signed = await form(tensors, **kw)
        if rng.random() < dropout:
            averager.decline(signed)
            raise GroupFormationFailed("dropped out of the formed group (the test's)")
        return signed

    async def run_round(signed: Any, tensors: Any, **kw: Any) -> Any:
        result = await run(signed, tensors, **kw)
        committed.setdefault(result.round, set()).add(peer.index)
        manifest = signed.manifest
        counted = manifest.counts[0] if manifest.counts else 0
        ids = manifest.peers()
        binding[result.round] = {p for j, p in enumerate(ids) if j == 0 or counted >> j & 1}
        return result

    def trained_with(result: Any) -> None:
        applied.setdefault(result.round, set()).add(peer.index)
        credit(result)

    averager.form_group = form_group  # type: ignore[method-assign]
    averager.run_round = run_round  # type: ignore[method-assign]
    averager.trained_with = trained_with  # type: ignore[method-assign]


async def start(
    s: Swarm,
    rng: random.Random,
    committed: dict[bytes, set[int]],
    applied: dict[bytes, set[int]],
    binding: dict[bytes, set[Any]],
) -> Peer:
    peer = await s.start(compute=0.1)
    # the join peer (the one peer a newcomer trusts before its first round) drops out most often
    instrument(peer, rng, 0.5 if peer.index == 0 else 0.2, committed, applied, binding)
    return peer


@pytest.mark.timeout(600)  # (in memory on the virtual clock; the wall time is the machine's load)
@pytest.mark.parametrize("seed", [1])
async def test_every_member_of_a_committed_round_applies_it_and_the_swarm_stays_one(
    autojump_clock: object, seed: int
) -> None:
    rng = random.Random(seed)
    committed: dict[bytes, set[int]] = {}
    applied: dict[bytes, set[int]] = {}
    binding: dict[bytes, set[Any]] = {}
    async with swarm(run_config("sync")) as s:
        peers = [await start(s, rng, committed, applied, binding) for _ in range(3)]
        await s.until(lambda: all(p.opt.epoch >= 2 for p in peers), timeout=120)
        peers.append(await start(s, rng, committed, applied, binding))  # late: it trusts its join peer only
        await trio.sleep(rng.uniform(0.0, 2.0))
        peers.append(await start(s, rng, committed, applied, binding))
        top = max(p.opt.epoch for p in peers)
        await s.until(lambda: all(p.opt.epoch >= top + 6 for p in peers), timeout=300)
    index = {p.node.peer_id: p.index for p in peers}
    split = {}
    for r, c in committed.items():
        bound = {index[p] for p in binding[r] if p in index} & c  # the leader and the members it counts
        took = applied.get(r, set())
        # (a round whose signed quorums its contributors miss is applied by none of those; a member the
        # leader does not count may discard it alone, never apply one they discard)
        if (took & bound) not in (bound, set()) or (took and not took & bound and bound):
            split[r.hex()[:8]] = (sorted(c), sorted(bound), sorted(took))
    assert not split, (
        f"members of one committed round decided differently (committed, bound, applied): {split}"
    )
    assert len(committed) >= 4
    check_identical_per_epoch(peers)
