"""Which rank holds every byte of each chunk of a site's state: ``ShardedState.owners`` (from the runs of
one rank's bytes, as every hash computes it) is ``owner(i)`` chunk by chunk (from the chunk's parts),
over random layouts: tensors of random dtypes, rows and widths, 0-d values, fewer rows than ranks (whose
rows sit next to the next tensor's rows of the same rank), tensors of many chunks, any number of ranks.
Layouts only: the shards are meta tensors."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.training.site.layout import rows_of
from p2ptrain.training.site.state import ShardedState
from p2ptrain.training.state import chunks

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16)


def random_shapes(rng: random.Random, world: int) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for k in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.1:
            shape: list[int] = []
        elif kind < 0.3:
            shape = [rng.randint(1, world), rng.randint(1, 300_000)]  # (maybe fewer rows than ranks)
        elif kind < 0.6:
            shape = [rng.randint(1, 20_000), rng.randint(1, 2_000)]  # (many chunks)
        else:
            shape = [rng.randint(1, 700)] + [rng.randint(1, 40) for _ in range(rng.randint(0, 2))]
        shapes[f"t{k:02d}"] = shape
    return shapes


def state_of(
    shapes: dict[str, list[int]], dtypes: dict[str, torch.dtype], rank: int, world: int
) -> ShardedState:
    local = {}
    for n, s in shapes.items():
        rows = (len(rows_of(s[0], world, rank)), *s[1:]) if s else ()
        local[n] = torch.empty(rows, dtype=dtypes[n], device="meta")
    return ShardedState(local, shapes, rank, world)


@pytest.mark.parametrize("seed", range(40))
def test_owners_are_each_chunks_owner(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4, 8])
    shapes = random_shapes(rng, world)
    dtypes = {n: rng.choice(DTYPES) for n in shapes}
    state = state_of(shapes, dtypes, rng.randrange(world), world)
    owners = state.owners()
    assert owners == [state.owner(i) for i in range(state.layout.chunks)]
    if world == 1:
        assert owners == [0] * state.layout.chunks
    # (every byte is in some rank's run: a chunk of one owner has all its bytes from that rank)
    for i, r in enumerate(owners):
        if r is not None:
            assert sum(p.hi - p.lo for p in state.parts(i) if p.rank == r) == state.layout.chunk_size(i)


def test_a_chunk_across_two_tensors_of_one_rank_is_that_ranks() -> None:
    """A tensor of one row (rank 0's alone) next to rank 0's rows of the next: one owner, two parts."""
    rows = chunks.CHUNK // 4
    shapes = {"a": [1, rows], "b": [4, rows]}  # (a: rank 0's 1 MiB; b: 1 MiB of rows on each rank)
    state = state_of(shapes, {"a": torch.float32, "b": torch.float32}, 0, 4)
    assert state.owners() == [0, 0, 1, 2, 3]
    shifted = {"a": [1, rows // 2], "b": [4, rows]}  # (a half chunk: chunk 0 is a and half of b's rank 0)
    state = state_of(shifted, {"a": torch.float32, "b": torch.float32}, 0, 4)
    assert state.owners() == [0, None, None, None, 3]
    assert len({p.index for p in state.parts(0)}) == 2
