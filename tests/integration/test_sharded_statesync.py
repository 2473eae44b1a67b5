"""State sync between sites of different sizes: donor sites of 2 and 4 ranks each publish the root an
unsharded peer with the same state publishes and serve its chunks from their ranks' shards; a joining
site of 3 ranks takes the even chunks from the donor of 2 and the odd ones from the donor of 4, checks
every chunk on arrival at its rank 0 and writes it straight into its ranks' shards. A chunk the donor of
2 corrupted is caught, its sender named, and the chunk is taken from the donor of 4 instead; nothing
unverified reaches a rank, and the joiner ends with the donors' state. One process group of 9 (donor
ranks 0-1 and 2-5, joiner ranks 6-8); the faces' link is a stand-in for the download protocol."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from p2ptrain.training.site import launch
from p2ptrain.training.site.layout import rows_of
from p2ptrain.training.site.state import ShardedState
from p2ptrain.training.state import chunks

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)
DONORS, JOINER = [[0, 1], [2, 3, 4, 5]], [6, 7, 8]
EPOCH, BAD = 12, 0  # (an even chunk: the donor of 2's)


def full_state() -> dict[str, torch.Tensor]:
    """A DiLoCo state's names (see ``state.capture``): uneven rows, chunk edges inside tensors."""
    g = torch.Generator().manual_seed(3)
    return {
        "model.0.weight": torch.randn(301, 257, generator=g),
        "model.0.bias": torch.randn(301, generator=g),
        "model.1.weight": torch.randn(517, 301, generator=g),
        "optim.outer.0.momentum_buffer": torch.randn(301, 257, generator=g),
        "optim.outer.1.momentum_buffer": torch.randn(517, 301, generator=g),
        "optim.outer.step": torch.tensor(5, dtype=torch.int64),
    }


def rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    if t.dim() == 0:
        return t.clone()
    r = rows_of(t.shape[0], world, rank)
    return t[r.start : r.stop].clone()


def run(rank: int, world: int, out: str) -> None:
    groups = [dist.new_group(DONORS[0]), dist.new_group(DONORS[1]), dist.new_group(JOINER)]
    full = full_state()
    shapes = {n: list(t.shape) for n, t in full.items()}
    for d, donor in enumerate(DONORS):
        if rank not in donor:
            continue
        me, n = donor.index(rank), len(donor)
        state = ShardedState({k: rows(t, n, me) for k, t in full.items()}, shapes, me, n, group=groups[d])
        root = state.root(EPOCH)
        if me == 0:  # the root an unsharded peer publishes for the same state
            layout = chunks.Layout.of(full)
            unsharded = chunks.root(
                EPOCH, layout, chunks.hash_chunks(layout, [full[e.name] for e in layout.entries])
            )
            assert root == unsharded
            dist.send(torch.frombuffer(bytearray(root), dtype=torch.uint8), dst=JOINER[0])
        for i in range(state.layout.chunks):
            data = state.chunk(i)  # (every chunk assembled: the joiner may ask either donor for any)
            if data is not None:
                if d == 0 and i == BAD:
                    data[100] ^= 0xFF  # a hostile donor
                dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=JOINER[0])
        return
    me, n = JOINER.index(rank), len(JOINER)
    mine = {k: torch.zeros_like(rows(t, n, me)) for k, t in full.items()}
    state = ShardedState(mine, shapes, me, n, group=groups[2])
    named: list[tuple[int, str]] = []
    if me == 0:
        roots = []
        for donor in DONORS:
            got_root = torch.empty(32, dtype=torch.uint8)
            dist.recv(got_root, src=donor[0])
            roots.append(bytes(got_root.numpy()))
        assert roots[0] == roots[1]  # donors of 2 and 4 ranks publish one root
        # the joiner knows the root to expect; the hash list is checked against it
        layout = chunks.Layout.of(full)
        hashes = chunks.hash_chunks(layout, [full[e.name] for e in layout.entries])
        assert chunks.root(EPOCH, state.layout, hashes) == roots[0]
    assert state.layout.chunks >= 2  # (chunks from both donors)
    for i in range(state.layout.chunks):
        data: bytes | None = None
        if me == 0:
            copies = []
            for donor in DONORS:  # (in the order the donors send: each sends every chunk)
                got = torch.empty(state.layout.chunk_size(i), dtype=torch.uint8)
                dist.recv(got, src=donor[0])
                copies.append(bytes(got.numpy()))
            pick = i % 2
            data = copies[pick]
            if chunks.hash_chunk([data]) != hashes[i]:
                named.append((i, f"donor site of {len(DONORS[pick])}"))
                data = copies[1 - pick]  # fetched again from the other donor
                assert chunks.hash_chunk([data]) == hashes[i]
        state.place(i, data)
    for k, t in full.items():
        if t.dim() == 0 and me != 0:
            continue
        assert torch.equal(mine[k], rows(t, n, me)), k
    dist.barrier(group=groups[2])
    if me == 0:
        assert named == [(BAD, "donor site of 2")], named
        Path(out).write_text("ok")


def test_a_joining_site_of_3_downloads_into_its_shards_from_donors_of_2_and_4(tmp_path: Path) -> None:
    out = tmp_path / "ok"
    launch.spawn(run, 9, str(out), timeout=120)
    assert out.read_text() == "ok"
