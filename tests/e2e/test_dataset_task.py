"""End to end: a task of one's own over a Hugging Face ``datasets.Dataset``, trained by ``p2ptrain node``
processes, each reading shards of the data that no other peer reads (``integrations.data``), and going
on where it stopped after a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

pytest.importorskip("datasets")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "p2ptrain"]
SIZE, SHARD = 4000, 40

TASK = f"""
import os
import datasets
import torch
from p2ptrain.integrations.data import swarm_batches
from p2ptrain.tasks import Task

def task(**options):
    g = torch.Generator().manual_seed(0)
    x = torch.randn({SIZE}, 8, generator=g)
    ds = datasets.Dataset.from_dict({{"idx": list(range({SIZE})), "x": x.tolist(), "y": x.sum(1).tolist()}})
    ds = ds.with_format("torch")
    log = open(os.environ["READ_LOG"], "a")

    def collate(examples):
        log.write(" ".join(str(int(e["idx"])) for e in examples) + "\\n")
        log.flush()
        return torch.stack([e["x"] for e in examples]), torch.stack([e["y"] for e in examples])

    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

    return Task(
        name="sum-of-8",
        model=lambda: torch.nn.Linear(8, 1),
        batches=swarm_batches(ds, collate=collate, shard_size={SHARD}),
        loss=loss,
    )
"""

RUN = """
[run]
id = "e2e-data"

[training]
batch_size = 8
target_batch_size = 32
lr = 0.01
warmup_steps = 0
"""


LOGS: dict[int, IO[str]] = {}  # each process's log file, closed once it has exited (``wait``)


def start(tmp: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    env = os.environ | {"READ_LOG": str(tmp / f"read-{name}.txt")}
    args = ["node", "--listen", "127.0.0.1:0", "--task", "mytask:task", "--config", "run.toml"]
    args += ["--data-dir", f"data-{name}", "--status-file", f"status-{name}.json", "--no-live", *extra]
    out = open(tmp / f"{name}.log", "a")  # noqa: SIM115 (closed in ``wait``)
    proc = subprocess.Popen([*CLI, *args], cwd=tmp, env=env, stdout=out, stderr=out, text=True)
    LOGS[proc.pid] = out
    return proc


def read(tmp: Path, name: str) -> list[int]:
    path = tmp / f"read-{name}.txt"
    return [int(i) for line in path.read_text().splitlines() for i in line.split()] if path.exists() else []


def wait(proc: subprocess.Popen[str], tmp: Path, name: str) -> None:
    try:
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        LOGS.pop(proc.pid).close()
    assert code == 0, (tmp / f"{name}.log").read_text()[-3000:]


def test_nodes_read_disjoint_shards_of_a_dataset_and_resume_them(tmp_path: Path) -> None:
    (tmp_path / "mytask.py").write_text(TASK)
    (tmp_path / "run.toml").write_text(RUN)
    first = start(tmp_path, "a", "--max-steps", "4", "--wait-peers", "2")
    try:
        status = tmp_path / "status-a.json"
        for _ in range(600):  # the first node's address, once it listens
            try:
                address = json.loads(status.read_text())["addresses"][0]
                break
            except (OSError, ValueError, KeyError, IndexError):
                subprocess.run(["sleep", "0.1"], check=True)
        else:
            raise AssertionError((tmp_path / "a.log").read_text()[-3000:])
        second = start(tmp_path, "b", "--max-steps", "4", "--wait-peers", "2", "--join", address)
        wait(second, tmp_path, "b")
    finally:
        wait(first, tmp_path, "a")
    a, b = read(tmp_path, "a"), read(tmp_path, "b")
    assert a and b
    assert len(a) + len(b) < SIZE  # (all in the first pass: no index is read twice by design)
    shards_a, shards_b = {i // SHARD for i in a}, {i // SHARD for i in b}
    assert not shards_a & shards_b, sorted(shards_a & shards_b)
    assert len(set(a)) == len(a) and len(set(b)) == len(b)

    # The first peer again, from its data directory: it goes on in the shard it held, not from scratch.
    # (Alone, with the peer it trained with gone, it waits rather than step: stopped once it has read.)
    held = json.loads(next((tmp_path / "data-a").glob("data-*.json")).read_text())
    again = start(tmp_path, "a", "--resume")
    try:
        for _ in range(1200):
            if len(read(tmp_path, "a")) > len(a) + 16 or again.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        again.send_signal(signal.SIGTERM)
    finally:
        wait(again, tmp_path, "a")
    after = read(tmp_path, "a")[len(a) :]
    assert after, held
    if held["offset"] < SHARD:  # it goes on in the shard it held, with examples of that shard alone
        assert after[0] // SHARD == held["shard"], (held, after[:5])
        assert {i // SHARD for i in after[: SHARD - held["offset"]]} == {held["shard"]}, (held, after)
    else:  # (saved as it read the shard's last example: that shard is over, it takes a new one)
        assert after[0] // SHARD not in {held["shard"], *held["done"]}, (held, after[:5])
    # (Its examples since the last save come again. The other peer is gone, and with it its claims: the
    # DHT keeps them in memory, so this peer may go on to shards that peer read.)
