"""The wire layout of a site (pure): for random shapes and rank counts, every rank's runs are exactly
its ``torch.chunk`` rows of each parameter (FSDP2's dim-0 sharding), the runs of all ranks tile the flat
vector once, and any span is covered by the runs ``within`` returns, cut to it."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.training.site.layout import WireLayout, rows_of


@pytest.mark.parametrize("seed", range(20))
def test_runs_are_the_chunks_fsdp2_gives_each_rank_and_tile_the_wire_vector(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    shapes = [
        tuple(rng.randint(0 if k else 1, 12) for k in range(rng.randint(1, 3)))
        for _ in range(rng.randint(1, 7))
    ]
    layout = WireLayout([f"p{i}" for i in range(len(shapes))], shapes, world)
    flat = torch.arange(layout.total)
    params = [flat[layout.offsets[i] : layout.offsets[i + 1]].view(s) for i, s in enumerate(shapes)]
    covered = torch.zeros(layout.total, dtype=torch.int64)
    for r in range(world):
        for i, p in enumerate(params):
            chunks = torch.chunk(p, world, dim=0) if p.shape[0] else ()
            mine = chunks[r] if r < len(chunks) else p[0:0]
            assert layout.local_shape(i, r) == mine.shape
            assert len(rows_of(p.shape[0], world, r)) == mine.shape[0]
        for run in layout.runs[r]:
            covered[run.lo : run.hi] += 1
            rows = rows_of(shapes[run.param][0], world, r)
            local = params[run.param][rows.start : rows.stop].reshape(-1)
            assert torch.equal(local[run.at : run.at + run.size], flat[run.lo : run.hi])
        assert layout.shard_numel(r) == sum(run.size for run in layout.runs[r])
    assert bool((covered == 1).all())
    for _ in range(10):
        lo = rng.randint(0, layout.total)
        hi = rng.randint(lo, layout.total)
        runs = layout.within(lo, hi)
        assert sum(run.size for run in runs) == hi - lo
        assert [run.lo for run in runs] == sorted(run.lo for run in runs)
        for run in runs:
            rows = rows_of(shapes[run.param][0], world, run.rank)
            local = params[run.param][rows.start : rows.stop].reshape(-1)
            assert torch.equal(local[run.at : run.at + run.size], flat[run.lo : run.hi])


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="scalar"):
        WireLayout(["s"], [()], 2)
    with pytest.raises(ValueError, match="at least one rank"):
        WireLayout(["a"], [(3,)], 0)
    layout = WireLayout(["a"], [(5, 2)], 2)
    with pytest.raises(ValueError, match="not FSDP2's dim-0 chunks"):
        layout.check_local(1, [torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="not within"):
        layout.within(0, 11)
