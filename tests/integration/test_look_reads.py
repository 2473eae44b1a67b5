"""A look for a step's group sizes it by the records this peer holds, and asks the replicas only where
those are unsure (``ProgressBoard.asks_replicas``), as the progress loop's reads do.

Every look read the replicas first: at 128 simulated peers with 48 inbound slots a node, that read took
0.9 s at the median and 2.4 s at p90 (up to 4 s), and a follower whose look began 3.7 s before it asked
its leader found the group formed 0.03 s earlier. The partners offer their new records as they publish
them, so what this peer holds is their latest.

The invariant, over random swarms stepping every few seconds: a peer's reads of the replicas come at
most once a record's life (``ttl``), however many looks it makes, and every step's round holds every
peer (a record offered since the last read counts, as the replicas' would)."""

from __future__ import annotations

import random

import pytest
import trio

from tests.harness.training import check_identical_per_epoch, run_config, swarm

pytestmark = pytest.mark.timeout(300)
TTL = 10.0


@pytest.mark.parametrize("seed", range(3))
async def test_looks_read_the_records_held_and_the_replicas_once_a_record_life(
    autojump_clock: object, seed: int
) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", interval=0.5, ttl=TTL)
    async with swarm(config) as s:
        peers = [await s.start(compute=rng.uniform(0.1, 0.3)) for _ in range(rng.randint(3, 5))]
        await s.until(lambda: all(p.opt.epoch >= 2 for p in peers), timeout=600)
        reads: dict[int, list[bool]] = {id(p): [] for p in peers}
        steps_of: dict[int, list[dict[str, object]]] = {id(p): [] for p in peers}
        for p in peers:
            note = p.opt.stats.note_step

            def noted(last: dict[str, object], _p=p, _note=note) -> None:  # type: ignore[no-untyped-def]
                steps_of[id(_p)].append(last)
                _note(last)

            p.opt.stats.note_step = noted  # type: ignore[method-assign]
            refresh = p.opt.board.refresh

            async def counted(*, network: bool = True, _p=p, _refresh=refresh) -> None:  # type: ignore[no-untyped-def]
                reads[id(_p)].append(network)
                await _refresh(network=network)

            p.opt.board.refresh = counted  # type: ignore[method-assign]
        began, first = trio.current_time(), max(p.opt.epoch for p in peers)
        await s.until(lambda: all(p.opt.epoch >= first + 8 for p in peers), timeout=600)
        took = trio.current_time() - began
        steps = min(p.opt.epoch for p in peers) - first
        assert took < 8 * TTL / 2, "steps too slow to tell a look's read from the loop's: make them faster"
        for p in peers:
            asked = reads[id(p)].count(True)
            # (the loop's, once a record's life, and one as a step's records change at once: a view
            # that is briefly unsure, one step behind as the others' records of the new step arrive)
            assert asked <= took / TTL + 2 + steps / 4, (asked, took, steps, reads[id(p)])
        check_identical_per_epoch(peers)
        assert all(p.opt.stats.solo == 0 for p in peers)
        for p in peers:  # every peer in every round of the window, its own samples in the average
            rounds = steps_of[id(p)]
            assert len(rounds) >= 8, rounds
            assert all(r["outcome"] == "averaged" and r["group"] == len(peers) for r in rounds), rounds
