"""End to end: ``p2ptrain simulate`` runs a ``[pipeline]`` run file with real node processes.

What is proved here: three real ``p2ptrain node`` processes split a two-stage GPT between them (by
rank, as a swarm that starts together does: two on stage 0, one on stage 1), send their micro-batches
through one peer of every stage over the real transport, average each stage with its peers and end
every step with the same weights per stage; the live table and the report show each peer's stage,
queue and throughput.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RUN = """
[run]
id = "e2e-pipeline"

[task.options]
n_layer = 2
n_embd = 32
n_head = 2
block_size = 32
max_bytes = 300000

[training]
lr = 0.003
batch_size = 8

[averaging]
matchmaking_time = 1.0

[pipeline]
stages = [0, 1]
micro_batch = 4
compression = "int8"
"""


def test_simulate_runs_a_pipeline_and_reports_each_peers_stage(tmp_path: Path) -> None:
    config = tmp_path / "pipeline.toml"
    config.write_text(RUN)
    steps = 2
    args = ["simulate", "--peers", "3", "--max-steps", str(steps), "--config", str(config), "--no-live"]
    result = subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args, "--workdir", str(tmp_path / "sim")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stage thr." in result.stdout and "queue" in result.stdout  # the live table's columns
    summary = json.loads((tmp_path / "sim" / "report" / "summary.json").read_text())
    assert summary["last_step"] == steps and summary["finished"] == 3
    assert summary["identical"] is True and summary["problems"] == [] and summary["diverged_steps"] == []
    pipeline = summary["pipeline"]
    assert pipeline["peers_per_stage"] == [2, 1]
    assert pipeline["stage_weights_identical"] == {"0": True, "1": True}
    for peer in pipeline["peers"]:
        assert peer["stage"] in (0, 1) and peer["queue"] == 0 and peer["throughput"] > 0
        assert peer["micro_batches"] == 2 * steps and peer["given_up"] == 0
        assert peer["bytes_per_micro_batch"] > 0
    for i in range(3):
        status = json.loads((tmp_path / "sim" / "report" / f"peer-{i}.json").read_text())["final_status"]
        training = status["training"]
        assert training["mode"] == "pipeline" and training["step"] == steps
        # stage 0's two peers average every step; stage 1's one peer steps alone
        assert training["rounds"]["averaged" if training["stage"] == 0 else "alone"] == steps
