"""The integration examples, end to end: two peers of a swarm, each a real process running a training
loop of another library (``examples/hf_trainer.py``: a Hugging Face ``Trainer``;
``examples/lightning_fit.py``: a Lightning ``Trainer``), joined through one address. They take global
steps together: at every swarm step both report, the parameters are the same on both, and the joiner
took steps with the first peer (not alone)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"huggingface": "hf_trainer.py", "lightning": "lightning_fit.py"}
MODULES = {"huggingface": "transformers", "lightning": "lightning"}
TIMEOUT = 400.0
# Local steps each peer takes: about 12 global steps of the run file's target on an idle 2-core machine;
# with 60, a CI run under load took 2 together, and the test asks for 3.
LOCAL_STEPS = 120


def lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith('{"'):  # (the Trainer prints its logs as Python dicts: {'loss': ...})
            out.append(json.loads(line))
    return out


def swarm_log(err: Path, tail: int = 40) -> str:
    """The last ``tail`` lines a peer wrote to ``err`` (the swarm's warnings among them)."""
    return "\n".join(err.read_text().splitlines()[-tail:])


def start(tmp: Path, name: str, example: str, *extra: str) -> tuple[subprocess.Popen[str], Path, Path]:
    folder = tmp / name
    folder.mkdir()
    out, err = folder / "stdout.log", folder / "stderr.log"
    args = [
        sys.executable,
        str(ROOT / "examples" / example),
        "--run",
        str(ROOT / "examples" / "swarm-run.toml"),
        "--wait-peers",
        "2",
    ]
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [*args, "--listen", "127.0.0.1:0", *extra], stdout=o, stderr=e, text=True, cwd=folder
        )
    return proc, out, err


def wait(proc: subprocess.Popen[str], err: Path, deadline: float) -> None:
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise AssertionError(f"still running at the deadline; stderr:\n{err.read_text()[-3000:]}") from None
    assert proc.returncode == 0, err.read_text()[-3000:]


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("library", sorted(EXAMPLES))
def test_two_peers_of_an_example_take_identical_global_steps_together(tmp_path: Path, library: str) -> None:
    pytest.importorskip(MODULES[library])
    example = EXAMPLES[library]
    deadline = time.monotonic() + TIMEOUT
    first, first_out, first_err = start(tmp_path, "first", example, "--max-steps", str(LOCAL_STEPS))
    procs = [first]
    try:
        while not lines(first_out):
            assert first.poll() is None, first_err.read_text()[-3000:]
            assert time.monotonic() < deadline, "no address printed"
            time.sleep(0.1)
        address = lines(first_out)[0]["address"]
        second, second_out, second_err = start(
            tmp_path, "second", example, "--max-steps", str(LOCAL_STEPS), "--join", address
        )
        procs.append(second)
        wait(second, second_err, deadline)
        wait(first, first_err, deadline)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    steps = [{r["step"]: r["params"] for r in lines(out) if "step" in r} for out in (first_out, second_out)]
    common = sorted(set(steps[0]) & set(steps[1]))
    # (where a round stalled, the swarm's warnings say why)
    logs = "".join(f"\n--- {e.parent.name}:\n" + swarm_log(e) for e in (first_err, second_err))
    assert len(common) >= 3, (
        f"steps taken together: {common}; first {sorted(steps[0])}, second {sorted(steps[1])}{logs}"
    )
    forked = [s for s in common if steps[0][s] != steps[1][s]]
    assert not forked, f"different parameters on steps {forked}"
