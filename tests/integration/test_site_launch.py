"""How a spawned site's ranks end (``training.site.launch``): a rank whose work is done waits for the
others, then leaves without tearing down its process group or shutting its interpreter down (both ran the
backend's C++ teardown under its live threads, and crashed ranks that had done their work: one SIGSEGV in
CI); a rank whose work raised still reports it."""

from __future__ import annotations

import atexit
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from p2ptrain.training.site import launch

pytestmark = pytest.mark.timeout(180)  # (spawned ranks start slowly on a busy machine)


def done(rank: int, world: int, folder: str) -> None:
    atexit.register(Path(folder, f"shutdown-{rank}").write_text, "ran")  # an interpreter shutdown runs it
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    Path(folder, f"sum-{rank}").write_text(str(t.tolist()))


def failing(rank: int, world: int, folder: str) -> None:
    dist.barrier()
    raise ValueError(f"rank {rank}'s work failed")


def test_ranks_that_did_their_work_leave_together_without_a_teardown(tmp_path: Path) -> None:
    launch.spawn(done, 3, str(tmp_path), timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sum-0", "sum-1", "sum-2"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {str([3.0, 3.0, 3.0])}


def test_a_rank_whose_work_raised_reports_it(tmp_path: Path) -> None:
    """(One rank: with more, whichever rank's error spawn reads first is reported, its own or a peer's
    reset connection.)"""
    with pytest.raises(mp.ProcessRaisedException, match="rank 0's work failed"):  # type: ignore[attr-defined]
        launch.spawn(failing, 1, str(tmp_path), timeout=60)
