"""End to end: ``p2ptrain simulate`` trains with real node processes and writes its report.

What is proved here: three real ``p2ptrain node`` processes, joined through the first one's address,
train one model together until ``--max-steps``; every node ends on that step with the same parameters
(the digests in their status files agree), the loss fell, every global step was averaged in a group, and
the report folder holds per-peer metrics, a PNG plot and a summary that say so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "p2ptrain"]

# A small model and batch, so that the test spends its time on the protocol, not on arithmetic.
SMALL_RUN = """
[run]
id = "e2e-train"

[task.options]
n_layer = 1
n_embd = 32
n_head = 2
block_size = 32
max_bytes = 300000

[training]
batch_size = 8
target_batch_size = 48
lr = 0.003
warmup_steps = 0

[eval]
every_steps = 2
"""


def test_simulate_trains_three_nodes_to_the_same_parameters(tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL_RUN)
    steps = 6
    args = ["simulate", "--peers", "3", "--max-steps", str(steps), "--config", str(config), "--no-live"]
    result = subprocess.run(
        [*CLI, *args, "--workdir", str(tmp_path / "sim")],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = tmp_path / "sim" / "report"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["last_step"] == steps and summary["finished"] == 3
    assert summary["identical"] is True and summary["problems"] == []
    assert (report / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for i in range(3):
        peer = json.loads((report / f"peer-{i}.json").read_text())
        final = peer["final_status"]["training"]
        assert final["step"] == steps and final["finished"] is True
        lines = [m for m in peer["metrics"] if "event" not in m]
        assert [m["step"] for m in lines][-1] == steps
        assert lines[-1]["loss"] < lines[0]["loss"]  # it learned something
        rounds = final["rounds"]
        assert rounds["averaged"] >= steps // 2 and rounds["aborted"] == 0, rounds
        assert peer["final_status"]["state"] == "stopped"
    digests = {
        json.loads((report / f"peer-{i}.json").read_text())["final_status"]["training"]["digest"]
        for i in range(3)
    }
    assert len(digests) == 1


def node(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "node", "--listen", "127.0.0.1:0", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("flags", "file_text", "names"),
    [
        (["--task", "no_such_module_here:make_task"], None, "no_such_module_here"),
        (["--task", "justaname"], None, "justaname"),
        (["--config", "{file}"], "[training]\nbatch_sise = 3\n", "training.batch_sise"),
        (["--config", "{file}"], "[training]\nmode = 'fast'\n", "training.mode"),
        (["--config", "{file}"], "[training\n", "not valid TOML"),
        (["--config", "{missing}"], None, "cannot read config"),
        (["--task", "tiny-gpt", "--device", "warp-drive"], None, "--device"),
    ],
    ids=["module", "spec", "unknown-key", "bad-mode", "toml", "missing-file", "device"],
)
def test_bad_task_config_or_device_is_a_one_line_error(
    tmp_path: Path, flags: list[str], file_text: str | None, names: str
) -> None:
    run_file = tmp_path / "run.toml"
    if file_text is not None:
        run_file.write_text(file_text)
    flags = [f.format(file=run_file, missing=tmp_path / "nope.toml") for f in flags]
    result = node(*flags, "--data-dir", str(tmp_path / "d"), timeout=60)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("p2ptrain node: ") and names in last, result.stderr
    assert "Traceback" not in result.stderr


def test_resume_continues_from_the_last_checkpoint(tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL_RUN)
    data = tmp_path / "d"
    common = ["--config", str(config), "--data-dir", str(data), "--threads", "1", "--no-live"]
    first = node(*common, "--max-steps", "2", "--metrics-file", str(tmp_path / "m1.jsonl"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert (data / "checkpoints" / "step-000000002").is_dir()
    second = node(*common, "--max-steps", "4", "--resume", "--metrics-file", str(tmp_path / "m2.jsonl"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from the checkpoint of step 2" in second.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "m2.jsonl").read_text().splitlines()]
    assert steps[0] == 3 and steps[-1] == 4  # it went on from step 2, not from scratch
