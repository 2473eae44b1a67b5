"""A site's hash and snapshot are made where the bytes are: the invariant is that **rank 0 receives only
the bytes of chunks split between ranks, plus the own chunks of ranks that cannot write its file**
(it cannot open that file by its path: another machine), never the rest of the state, while the root
and the snapshot file are an unsharded peer's, bit for bit.

Random states (seeded): tensors of random rows and widths and dtypes, some of fewer rows than ranks, a
0-d value, large ones whose rows fill whole chunks on every rank; a site of 4 ranks where rank 0 names
its file by a path relative to its folder, and rank 2 runs in another folder, where that path names
nothing (as on a machine that does not share rank 0's)."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import pytest
import torch

from p2ptrain.training.site import launch
from p2ptrain.training.site.layout import rows_of
from p2ptrain.training.site.state import ShardedState
from p2ptrain.training.state import chunks

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)
WORLD, OTHER_MACHINE, SEEDS = 4, 2, (1, 2, 3)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float16)


def random_state(seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for k in range(rng.randint(3, 7)):
        dtype = torch.float32 if k == 0 else rng.choice(DTYPES)
        if k == 0 or rng.random() < 0.3:  # large: every rank's rows hold whole chunks (2 MiB or more)
            shape: tuple[int, ...] = (rng.randint(4_000, 6_000), rng.choice((700, 900)))
        elif rng.random() < 0.3:  # fewer rows than ranks
            shape = (rng.randint(1, WORLD - 1), rng.randint(1, 5_000))
        else:
            shape = (rng.randint(1, 900), rng.randint(1, 700))
        values = torch.randn(shape, generator=g) * 100
        out[f"model.{k}.weight"] = values.to(dtype)
    out["optim.outer.step"] = torch.tensor(rng.randint(0, 99), dtype=torch.int64)
    return out


def rows(t: torch.Tensor, rank: int) -> torch.Tensor:
    if t.dim() == 0:
        return t.clone()
    r = rows_of(t.shape[0], WORLD, rank)
    return t[r.start : r.stop].clone()


def run(rank: int, world: int, out: str) -> None:
    os.chdir(Path(out).parent / ("elsewhere" if rank == OTHER_MACHINE else "here"))
    lines = []
    for seed in SEEDS:
        full = random_state(seed)
        shapes = {n: list(t.shape) for n, t in full.items()}
        state = ShardedState({k: rows(t, rank) for k, t in full.items()}, shapes, rank, world)
        path = None
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="test-site-snapshot-", dir=".")
            path = os.path.relpath(path)
        try:
            hashes = state.hash_into(path)
        finally:
            if path is not None:
                os.unlink(path)
        written = state.received
        state.received = 0
        again = state.hashes()  # (hashed only: no file)
        if rank != 0:
            assert hashes is None and again is None
            continue
        layout = chunks.Layout.of(full)
        tensors = [full[e.name] for e in layout.entries]
        assert hashes == again == chunks.hash_chunks(layout, tensors)
        snapshot = os.pread(fd, layout.size + 1, 0)
        os.close(fd)
        for i in range(layout.chunks):
            expected = b"".join(chunks.chunk_pieces(layout, tensors, i))
            assert snapshot[i * chunks.CHUNK : i * chunks.CHUNK + len(expected)] == expected, (seed, i)
        assert len(snapshot) == layout.size
        owners = [state.owner(i) for i in range(layout.chunks)]
        assert set(owners) >= set(range(world)), (seed, owners)  # (every rank hashed chunks of its own)
        assert None in owners  # (and some chunks were split)
        split = sum(p.hi - p.lo for i, o in enumerate(owners) if o is None for p in state.parts(i) if p.rank)
        remote = sum(layout.chunk_size(i) for i, o in enumerate(owners) if o == OTHER_MACHINE)
        assert state.received == split, (seed, state.received, split)
        assert written == split + remote, (seed, written, split, remote)
        elsewhere = sum(p.hi - p.lo for i in range(layout.chunks) for p in state.parts(i) if p.rank)
        lines.append(f"{seed} {elsewhere} {split} {written}")
    if rank == 0:
        Path(out).write_text("\n".join(lines))


def test_a_site_hashes_and_writes_each_chunk_where_its_bytes_are(tmp_path: Path) -> None:
    out = tmp_path / "ok"
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    launch.spawn(run, WORLD, str(out), timeout=240)
    report = out.read_text().splitlines()
    assert len(report) == len(SEEDS)
    for line in report:  # of the bytes on other ranks (all of which rank 0 received when it assembled
        # every chunk), the hash alone moved the split chunks' only, and the snapshot the remote rank's too
        _, elsewhere, split, written = map(int, line.split())
        assert split < written < elsewhere, line
