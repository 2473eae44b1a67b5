"""End to end: ``p2ptrain simulate`` trains with real node processes and writes its report.

What is proved here: three real ``p2ptrain node`` processes, joined through the first one's address,
train one model together until ``--max-steps``; every node ends on that step with the same parameters
(the digests in their status files agree), the loss fell, every global step was averaged in a group, and
the report folder holds per-peer metrics, a PNG plot and a summary that say so.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.identity import Identity

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "p2ptrain"]
BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")  # .ci/run installs it

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


def test_simulate_stops_on_sigint_even_where_it_was_ignored(tmp_path: Path) -> None:
    """A shell script's background job inherits SIGINT ignored; ``kill -INT`` must still stop the swarm
    (before, Python installed no Ctrl-C handler then, and it trained on to its end)."""
    config = tmp_path / "small.toml"
    config.write_text(SMALL_RUN)
    work = tmp_path / "sim"
    ignoring = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    args = ["simulate", "--peers", "2", "--max-steps", "100000", "--config", str(config), "--no-live"]
    with subprocess.Popen(
        [sys.executable, "-c", ignoring, *CLI, *args, "--workdir", str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            trained = lambda st: (st.get("training") or {}).get("step", 0) >= 1  # noqa: E731
            wait_for_json(work / "node1" / "status.json", trained, timeout=240)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=240)  # (the nodes drain their round: a loaded machine)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "interrupted: stopping the nodes" in out, out[-3000:]
    summary = json.loads((work / "report" / "summary.json").read_text())
    assert 1 <= summary["last_step"] < 100000


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
    # both losses, each named (final_loss was the validation loss, unlabeled)
    assert summary["final_loss"] is not None and summary["final_val_loss"] is not None
    assert f"final loss {summary['final_loss']} (validation {summary['final_val_loss']})" in result.stdout
    assert (report / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for i in range(3):
        peer = json.loads((report / f"peer-{i}.json").read_text())
        final = peer["final_status"]["training"]
        assert final["step"] == steps and final["finished"] is True
        lines = [m for m in peer["metrics"] if "event" not in m]
        assert [m["step"] for m in lines][-1] == steps
        assert lines[-1]["loss"] < lines[0]["loss"]  # it learned something
        assert str(steps) in lines[-1]["digests"]  # the steps' digests, also where hashed after the line
        rounds = final["rounds"]
        assert rounds["averaged"] >= steps // 2 and rounds["aborted"] == 0, rounds
        assert peer["final_status"]["state"] == "stopped"
    digests = {
        json.loads((report / f"peer-{i}.json").read_text())["final_status"]["training"]["digest"]
        for i in range(3)
    }
    assert len(digests) == 1


@pytest.mark.parametrize("case", ["missing", "broken", "unknown task"])
def test_simulate_with_an_unusable_run_file_says_why_in_the_terminal(tmp_path: Path, case: str) -> None:
    """(Before: the cause was in node 0's log only, the terminal said "0 of 1 nodes reached step 0"
    with --peers 4, and a meaningless report was written.)"""
    config = tmp_path / "run.toml"
    if case == "broken":
        config.write_text("[training]\nbatch_sise = 3\n")
    elif case == "unknown task":
        config.write_text('[task]\nname = "no_such_task_here"\n')
    sim = tmp_path / "sim"
    result = subprocess.run(
        [*CLI, "simulate", "--peers", "4", "--config", str(config), "--no-live", "--workdir", str(sim)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    if case == "unknown task":  # found by the node that loads it: its error, and no report
        assert result.returncode == 1, out
        assert "node 0 exited with status 2: p2ptrain node: unknown task 'no_such_task_here'" in out, out
        assert "no node trained: no report written" in out and not (sim / "report").exists()
        return
    assert result.returncode == 2, out
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2ptrain simulate: "), result.stderr
    assert ("cannot read config" if case == "missing" else "unknown key training.batch_sise") in lines[0]
    assert not sim.exists()  # nothing started


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


def test_an_unusable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    """A file where the folder should be (before: a NotADirectoryError traceback)."""
    (tmp_path / "a-file").write_text("")
    result = node("--task", "tiny-gpt", "--data-dir", str(tmp_path / "a-file" / "d"), timeout=60)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("p2ptrain node: --data-dir "), result.stderr
    assert "cannot use it as a folder" in last, result.stderr
    assert "Traceback" not in result.stderr


def test_a_second_node_on_the_same_data_dir_is_refused_until_the_first_is_gone(tmp_path: Path) -> None:
    """Two nodes on one machine with one data directory would share one identity (each refusing to
    dial "itself") and write into one checkpoints folder; the second is refused at once, with what to
    do. The lock goes with the process, however it ends (here: SIGKILL)."""
    config = tmp_path / "small.toml"
    config.write_text(SMALL_RUN)
    data, status_file = tmp_path / "d", tmp_path / "status.json"
    common = ["--config", str(config), "--data-dir", str(data), "--threads", "1", "--no-live"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [*CLI, "node", "--listen", "127.0.0.1:0", *common, "--status-file", str(status_file)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            wait_for_json(status_file, lambda s: bool(s.get("addresses")))
            second = node(*common, "--max-steps", "1", timeout=60)
            assert second.returncode == 2, second.stderr
            last = second.stderr.strip().splitlines()[-1]
            assert f"data directory {data.resolve()} is in use by another node on this machine" in last
            assert f"(pid {first.pid})" in last and "give each node its own --data-dir" in last
            assert "Traceback" not in second.stderr
        finally:
            first.kill()
            first.wait(timeout=60)
    again = node(*common, "--max-steps", "1", timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.parametrize("case", ["another run", "another peer"])
def test_a_node_every_join_address_refuses_for_good_stops_and_says_why(tmp_path: Path, case: str) -> None:
    """(Before: it logged an ERROR line on every retry, forever, and trained alone meanwhile.)"""
    status_file = tmp_path / "status.json"
    with open(tmp_path / "peer.log", "w") as log:
        run = "other" if case == "another run" else "e2e-train"
        argv = ["node", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "p"), "--run-id", run]
        peer = subprocess.Popen(
            [*CLI, *argv, "--status-file", str(status_file)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            address = wait_for_json(status_file, lambda s: bool(s.get("addresses")))["addresses"][0]
            if case == "another peer":  # the right place, but not the peer the address names
                address = address.rsplit("/p2p/", 1)[0] + f"/p2p/{Identity.generate().peer_id}"
                expect = "(peer_id)"
            else:
                expect = "(run_id): the listener is in run 'other', the dialer asked for run 'e2e-train'"
            config = tmp_path / "small.toml"
            config.write_text(SMALL_RUN)
            result = node(
                "--config", str(config), "--data-dir", str(tmp_path / "d"), "--no-live", "--join", address
            )
        finally:
            peer.kill()
            peer.wait(timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"p2ptrain node: cannot join the swarm: join {address} refused: "), last
    assert expect in last, last
    assert "Traceback" not in result.stderr
    assert result.stderr.count("refused: ") == 2  # logged once (and said once at the end): not retried


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


def test_a_training_node_reports_status_metrics_and_health_then_drains_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL_RUN)
    status_file, err = tmp_path / "status.json", tmp_path / "stderr.log"
    args = ["node", "--listen", "127.0.0.1:0", "--config", str(config), "--data-dir", str(tmp_path / "d")]
    args += ["--status-file", str(status_file), "--metrics-port", "0", "--log-format", "json", "--no-live"]
    with open(tmp_path / "stdout.log", "w") as out, open(err, "w") as errf:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=errf, text=True)
        try:
            status = wait_for_json(status_file, lambda s: (s.get("training") or {}).get("step", 0) >= 2)
            address = status["addresses"][0]
            asked = subprocess.run(
                [*CLI, "status", address, "--run-id", "e2e-train", "--json"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert asked.returncode == 0, asked.stderr
            remote = json.loads(asked.stdout)
            assert remote["peer_id"] == status["peer_id"] and remote["training"]["step"] >= 2
            assert "pid" not in remote and all("remote" not in c for c in remote["connections"])
            port = status["metrics_port"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
                assert r.status == 200
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                assert b"p2ptrain_global_step " in r.read()
            if BROWSER is not None:  # the live page, rendered by a real browser from the node's own status
                url = f"http://127.0.0.1:{port}/"
                page = subprocess.run(
                    [
                        BROWSER,
                        "--no-sandbox",
                        "--disable-gpu",
                        "--virtual-time-budget=3000",
                        "--dump-dom",
                        url,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=90,
                )
                step = re.search(r'<b id="step">(\d+)</b>', page.stdout)
                assert step is not None and int(step.group(1)) >= 2, page.stdout[-2000:]
                assert 'data-name="training loss"' in page.stdout
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=90) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [json.loads(x) for x in err.read_text().splitlines()]  # every log line is JSON
    messages = [x["message"] for x in lines]
    assert any("draining" in m for m in messages) and any(
        m.startswith("checkpoint of step") for m in messages
    )
    final = json.loads(status_file.read_text())
    assert final["state"] == "stopped" and final["training"]["finished"] is True
    assert list((tmp_path / "d" / "checkpoints").glob("step-*"))


def wait_for_json(path: Path, ready: Any, timeout: float = 60.0) -> dict[str, Any]:
    """Poll a JSON file another process rewrites until ``ready(content)``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError):
            content = None
        if content and ready(content):
            return content  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise AssertionError(f"{path} never satisfied the condition within {timeout} s")


TOPK_RUN = (
    SMALL_RUN.replace('id = "e2e-train"', 'id = "e2e-topk"\nauthority = "REPLACE-WITH-YOUR-AUTHORITY-KEY"')
    + """
[averaging]
compression = "topk1-q2"
"""
).replace("[training]\n", '[training]\nmode = "diloco"\n')


def test_a_private_simulation_trains_a_top_k_run_that_an_open_swarm_refuses(tmp_path: Path) -> None:
    """A run file refuses top-k in an open swarm (its rounds cannot be audited), and the shipped top-k run
    files name a placeholder authority: ``simulate --private`` gives the local swarm a throwaway authority
    and each node a certificate, so such a run trains locally as it would in a private swarm."""
    config = tmp_path / "topk.toml"
    config.write_text(TOPK_RUN.replace('authority = "REPLACE-WITH-YOUR-AUTHORITY-KEY"\n', ""))
    refused = subprocess.run(
        [*CLI, "node", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "is for private swarms" in refused.stdout + refused.stderr
    config.write_text(TOPK_RUN)
    args = ["simulate", "--peers", "2", "--max-steps", "3", "--config", str(config), "--no-live", "--private"]
    result = subprocess.run(
        [*CLI, *args, "--workdir", str(tmp_path / "sim")], capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a private swarm" in result.stdout
    summary = json.loads((tmp_path / "sim" / "report" / "summary.json").read_text())
    assert summary["last_step"] == 3 and summary["finished"] == 2 and summary["identical"] is True
    for i in range(2):
        assert (tmp_path / "sim" / f"node{i}" / "membership.cert").read_text().startswith("-----")
