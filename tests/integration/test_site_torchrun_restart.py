"""A site started by ``torchrun --max-restarts 1`` whose rank 1 is SIGKILLed comes back: torchrun restarts
every rank (rank 0 too: the node), the new ranks form a new process group (under the attempt's prefix
of the launcher's store, not their predecessors' addresses), and rank 0 resumes the site's last
checkpoint by itself and trains to the end (real processes; a site alone, on loopback)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_site_recovery import RUN, lines, text

pytestmark = pytest.mark.timeout(900)  # (a ceiling for a loaded machine: about 60 s alone)
STEPS = 4


def rank_one(root: int) -> int | None:
    """The launched rank 1 among ``root``'s descendants (its environment says RANK=1)."""
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if pid != root and b"RANK=1" in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
                return pid
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return None


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torch's launcher is not installed")
def test_a_torchrun_site_whose_rank_died_is_restarted_and_resumes_its_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(RUN)
    a = tmp_path / "a"
    a.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "-m", "p2ptrain", "node", "--config", str(run), "--listen", "127.0.0.1:0"]
    cmd += ["--data-dir", str(a), "--max-steps", str(STEPS), "--no-live"]
    cmd += ["--metrics-file", str(a / "metrics.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(a / "node.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        end = time.monotonic() + 400
        while not any(m.get("step", 0) >= 2 for m in lines(a)):
            assert proc.poll() is None and time.monotonic() < end, text(a)[-3000:]
            time.sleep(0.2)
        victim = rank_one(proc.pid)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_a = text(a)
    assert proc.returncode == 0, log_a[-3000:]
    resumed = re.search(r"resumed from the site checkpoint of step (\d+)", log_a)
    assert resumed is not None and int(resumed.group(1)) >= 2, log_a[-3000:]
    last = lines(a)[-1]
    assert last["event"] == "stopped" and last["step"] == STEPS, last
