"""A site's group starts however long its ranks take to start (up to ``START_WAIT``), whatever the group's
own timeout, and fails its start at once when a rank's process ends before it joined.

A rank spawned on a busy host took longer to import torch than the group's timeout (15 s in a test), and
gloo's join, which waits for the other ranks only that long, failed the start ("wait timeout after
15000ms"). Here a rank's start is held back by a random 2-5 s (its arguments take that long to unpickle
in the spawned process) against a group timeout of 1 s."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from p2ptrain.training.site.commands import Command, Commands, Op
from p2ptrain.training.site.group import SiteGroup

GROUP_TIMEOUT = 1.0


def held(seconds: float, exit_code: int) -> float:
    """Called as a spawned rank unpickles its arguments: it starts ``seconds`` late, or dies then."""
    time.sleep(seconds)
    if exit_code:
        os._exit(exit_code)
    return seconds


class Held:
    """An argument that holds a spawned rank's start back (``held``)."""

    def __init__(self, seconds: float, exit_code: int = 0) -> None:
        self.seconds, self.exit_code = seconds, exit_code

    def __reduce__(self) -> tuple[object, tuple[float, int]]:
        return held, (self.seconds, self.exit_code)


def worker(rank: int, world: int, generation: int, commands: Commands, late: object) -> None:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    while commands.receive().op is not Op.STOP:
        pass


def rank0(folder: str, world: int, late: list[float], exit_code: int) -> None:
    out = Path(folder) / "result.json"
    group = SiteGroup(world, worker, Held(late[0], exit_code), timeout=GROUP_TIMEOUT)
    began = time.monotonic()
    try:
        group.start()
    except Exception as e:
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - began}))
        os._exit(0)
    t = torch.tensor([0.0])
    group.call(lambda: dist.all_reduce(t))
    out.write_text(json.dumps({"sum": t.item(), "s": time.monotonic() - began}))
    group.close(lambda: group.commands.send(Command(Op.STOP)))
    os._exit(0)


def run_rank0(tmp_path: Path, world: int, late: float, exit_code: int = 0) -> dict[str, object]:
    p = mp.get_context("spawn").Process(target=rank0, args=(str(tmp_path), world, [late], exit_code))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == 0, p.exitcode
    result: dict[str, object] = json.loads((tmp_path / "result.json").read_text())
    return result


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", [1, 2])
def test_a_site_group_waits_for_ranks_that_start_later_than_its_timeout(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    world, late = rng.choice([2, 3]), rng.uniform(2.0, 5.0)
    result = run_rank0(tmp_path, world, late)
    assert "error" not in result, result
    assert result["sum"] == sum(range(world))  # every rank in the group, in its first collective
    assert isinstance(result["s"], float) and result["s"] >= late


@pytest.mark.timeout(150)
def test_a_rank_that_dies_before_it_joins_fails_the_start_at_once(tmp_path: Path) -> None:
    result = run_rank0(tmp_path, 2, 0.5, exit_code=3)
    assert "did not start" in str(result.get("error")) and "exited with 3" in str(result["error"])
    assert isinstance(result["s"], float) and result["s"] < 60  # not the store's START_WAIT (300 s)
