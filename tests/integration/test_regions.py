"""A step's swarm split into regions (``progress.regions``): collaborative peers over the in-memory
network on the virtual clock, their compute speeds drawn per seed.

The invariants a split swarm keeps, whatever the peers' speeds and the order their rounds commit in:

* every committed round's members are of one region of its step (a pure function of their ids);
* a region commits a step once: every member of its rounds of that step leaves with one state (no
  fork, counted per region);
* a round averages its members' states, not only their gradients: members that came to the step with
  different states (from different regions of the step before) leave it with one;
* the split is real: some steps are committed by more than one region's round.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.buckets import Regions
from tests.harness.training import Peer, run_config, swarm

pytestmark = pytest.mark.timeout(600)  # (nine nodes train meanwhile: real CPU, a busy machine)

PEERS = 9  # (their ids fall in all four buckets)
STEPS = 6


def _record(p: Peer, rounds: list[tuple[Peer, int, frozenset[str], str]]) -> None:
    """Every round ``p`` applies: (peer, the step it left, its members' short ids, its parameters after)."""
    note = p.opt.stats.note_step

    def noting(last: dict[str, Any]) -> None:
        note(last)
        if last["outcome"] == "averaged":
            members = frozenset(last["shares"]) - frozenset(last["excluded"])
            rounds.append((p, int(last["epoch"]), members, p.params_hash()))

    p.opt.stats.note_step = noting  # type: ignore[method-assign]


async def _split(seed: int) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=4, regions=2)
    regions = Regions.of(4, 2)
    rounds: list[tuple[Peer, int, frozenset[str], str]] = []
    async with swarm(config) as s:
        peers = []
        for _ in range(PEERS):
            p = await s.start(compute=rng.choice([0.1, 0.15, 0.2, 0.3]))
            _record(p, rounds)
            peers.append(p)
        await s.until(lambda: sum(p.opt.epoch >= STEPS for p in peers) >= PEERS - 1, timeout=400)
    by_id: dict[str, PeerID] = {p.node.peer_id.short(): p.node.peer_id for p in peers}
    assert rounds
    states: dict[tuple[int, int], set[str]] = {}
    came_with: dict[tuple[int, int], set[str]] = {}
    for p, epoch, members, after in rounds:
        region = regions.of_peer(p.node.peer_id, epoch)
        # one region's members, all of them
        assert {regions.of_peer(by_id[m], epoch) for m in members} == {region}, (epoch, members)
        states.setdefault((epoch, region), set()).add(after)
        if epoch in p.params_at:  # (the state it came to the step with)
            came_with.setdefault((epoch, region), set()).add(p.params_at[epoch])
    forks = {k: v for k, v in states.items() if len(v) > 1}
    assert not forks, f"two states of one region and step: {sorted(forks)}"
    # members that came with different states left with one (the states were averaged)
    assert any(len(before) > 1 for before in came_with.values()), came_with
    # more than one region's round committed a step
    steps = {e for e, _ in states}
    assert any(len({r for e2, r in states if e2 == e}) > 1 for e in steps), sorted(states)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_split_swarm_commits_each_region_once_and_mixes_the_states(
    seed: int, autojump_clock: object
) -> None:
    await _split(seed)
