"""Catch-up benchmark with real processes: a sync home peer on a slow link, in network namespaces.

The real-process counterpart of ``simulations.benchmarks.statesync_catchup`` (issue 49's sync-mode
chase): ``--fast`` ``p2ptrain node`` processes train ``configs/tiny-gpt.toml`` (sync mode, AdamW: a
state of about 10 MB; the swarm's batch ``--target`` samples, steps of a few seconds) in a
``simulations.labs.netns`` lab, each on a ``--fast-mbit`` link; once they took
a few steps, a home peer joins them on a ``--rate-mbit`` link (``tc tbf`` both ways), a link on which the
state's download takes longer than one of the swarm's steps. Measured from the nodes' metrics files and
the home peer's log, over ``--seconds`` from its first step:

* the swarm's steps while the home peer was there, and those it averaged in with its own samples (its
  metrics line for the step says ``averaged`` with ``mine`` > 0); target: at least 80%;
* its state downloads (its join's included) and the steps it replayed instead
  (``p2ptrain.training.state.replay``);
* whether every peer held the same parameters at every step they share (their metrics' digests).

``--replay-steps 0`` runs the code before replay (every catch-up a download) for comparison.

Usage::

    python -m simulations.benchmarks.statesync_home [--rate-mbit 10] [--fast 3] [--fast-mbit 100]
        [--seconds 150] [--target 64] [--replay-steps 4] [--subnets] [--json PATH] [--workdir DIR]

JSON report to PATH (default ``simulations/results/statesync_home.json``; ``-``: stdout), a table to
stderr. Needs root, ``ip`` and ``tc`` (``simulations.labs.netns``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment
from simulations.benchmarks.training_runs import read_jsonl
from simulations.labs.netns import NetnsLab, read_line, unavailable

MODULE = "simulations.benchmarks.statesync_home"
DEFAULT_JSON = "simulations/results/statesync_home.json"
CONFIG = REPO_ROOT / "configs" / "tiny-gpt.toml"
TARGET = 0.8
PORT = 4001
START_TIMEOUT = 300.0  # (a busy machine starts a node slowly)
WARM_STEPS = 3  # the fast peers' steps before the home peer joins


class _Node:
    """One ``p2ptrain node`` in lab peer ``i``'s namespace; its folder holds node.log and metrics.jsonl."""

    def __init__(
        self, lab: NetnsLab, i: int, folder: Path, join: str | None, config: Path, extra: list[str]
    ) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "p2ptrain", "--log-level", "info", "node", "--config", str(config)]
        argv += ["--run-id", "statesync-home", "--listen", f"{lab.address(i)}:{PORT}"]
        argv += ["--data-dir", str(folder / "data"), "--metrics-file", str(folder / "metrics.jsonl")]
        argv += ["--threads", "1", "--no-live", *extra]
        argv += ["--join", join] if join else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with (folder / "node.log").open("ab") as log:  # (the child keeps its own copy)
            self.proc = lab.popen(i, argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.address = read_line(self.proc, START_TIMEOUT).strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.folder / "metrics.jsonl")

    def step(self) -> int:
        steps = [int(m["step"]) for m in self.metrics() if m.get("step") is not None]
        return max(steps, default=0)

    def log(self) -> str:
        path = self.folder / "node.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _wait(what: str, done: Any, timeout: float) -> None:
    began = time.monotonic()
    while not done():
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.5)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rates: list[float | tuple[float, float]] = [args.fast_mbit] * args.fast + [args.rate_mbit]
    config = workdir / "run.toml"  # the run file, with ``--replay-steps`` and ``--target``
    text = CONFIG.read_text()
    settings = [("replay_steps", str(args.replay_steps)), ("target_batch_size", str(args.target))]
    settings += [tuple(kv.split("=", 1)) for kv in args.set]  # type: ignore[misc]
    for key, value in settings:
        text, n = re.subn(
            rf"(?m)^{re.escape(key.strip())} = [^#\n]*?(\s*#|$)", rf"{key.strip()} = {value.strip()}\1", text
        )
        if n != 1:
            raise RuntimeError(f"{CONFIG} has no {key} line to set")
    config.write_text(text)
    wait = ["--wait-peers", str(args.fast)]
    with NetnsLab(args.fast + 1, rates=rates, prefix="p2phome", subnets=args.subnets) as lab:
        fast = [_Node(lab, 0, workdir / "fast0", None, config, wait)]
        fast += [
            _Node(lab, i, workdir / f"fast{i}", fast[0].address, config, wait) for i in range(1, args.fast)
        ]
        _wait("the fast peers' first steps", lambda: fast[0].step() >= WARM_STEPS, 600.0)
        home = _Node(lab, args.fast, workdir / "home", fast[0].address, config, [])
        _wait("the home peer's first step", lambda: home.step() > 0, 600.0)
        first = max(n.step() for n in fast)
        began = time.time()
        time.sleep(args.seconds)
        last = max(n.step() for n in fast)
        for n in [home, *fast]:
            n.stop()
    seen: dict[int, tuple[str, int]] = {}  # the home peer's steps: epoch -> (outcome, its samples)
    for m in home.metrics():
        r = (m.get("rounds") or {}).get("last") or {}
        if (
            r.get("epoch") is not None
            and int(r["epoch"]) >= first
            and m.get("time", 0) <= began + args.seconds
        ):
            seen[int(r["epoch"])] = (str(r.get("outcome")), int(r.get("mine", 0)))
    present = last - first
    averaged = sum(1 for outcome, mine in seen.values() if outcome == "averaged" and mine > 0)
    digests: dict[str, set[str]] = {}
    for n in [home, *fast]:
        for m in n.metrics():
            for step, d in (m.get("digests") or {}).items():
                if d and set(d) != {"0"}:  # (a placeholder while a state is being hashed)
                    digests.setdefault(step, set()).add(d)
    log = home.log()
    sizes = [float(x) for x in re.findall(r"downloaded step \d+'s state \(([\d.]+) MB", log)]
    state = sizes[0] * 1e6 if sizes else 0.0
    downloads = len(re.findall(r"downloaded step \d+'s state", log))
    replayed = sum(int(x) for x in re.findall(r"replayed (\d+) step\(s\)", log))
    return {
        "fast": args.fast,
        "fast_mbit": args.fast_mbit,
        "rate_mbit": args.rate_mbit,
        "replay_steps": args.replay_steps,
        "target_batch_size": args.target,
        "subnets": args.subnets,
        "state_mb": round(state / 1e6, 1),
        "state_download_s_at_link_rate": round(state * 8 / (args.rate_mbit * 1e6), 1),
        "seconds": args.seconds,
        "swarm_steps_present": present,
        "step_s": round(args.seconds / present, 2) if present else None,
        "averaged": averaged,
        "fraction": round(averaged / present, 3) if present else None,
        "home_outcomes": {
            o: sum(1 for x, _ in seen.values() if x == o) for o in {x for x, _ in seen.values()}
        },
        "downloads": downloads,
        "replayed_steps": replayed,
        "steps_compared": len(digests),
        "identical": all(len(d) == 1 for d in digests.values()),
        "met": bool(present) and averaged >= TARGET * present,
    }


def format_table(report: dict[str, Any]) -> str:
    r = report["result"]
    rows = [
        [
            "rate Mbit/s",
            "swarm steps",
            "averaged",
            "fraction",
            "downloads",
            "replayed",
            "step s",
            "identical",
        ],
        [
            f"{r['rate_mbit']:g}",
            str(r["swarm_steps_present"]),
            str(r["averaged"]),
            f"{100 * r['fraction']:.0f}%" if r["fraction"] is not None else "-",
            str(r["downloads"]),
            str(r["replayed_steps"]),
            str(r["step_s"]),
            str(r["identical"]),
        ],
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(f"target: averaged in >= {TARGET:.0%} of the steps; met: {r['met']}")
    text.append(f"reproduce: {report['command']}")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=10.0, help="the home peer's link (default 10)")
    parser.add_argument("--fast", type=int, default=3, help="peers on fast links (default 3)")
    parser.add_argument("--fast-mbit", type=float, default=100.0, help="their links (default 100)")
    parser.add_argument("--seconds", type=float, default=150.0, help="measured from the home's first step")
    parser.add_argument("--replay-steps", type=int, default=4, help="statesync.replay_steps (0: no replay)")
    parser.add_argument(
        "--target", type=int, default=64, help="training.target_batch_size (default 64: steps of a few s)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another line of the run file (e.g. n_embd=384, block_size=32: a larger state for the compute)",
    )
    parser.add_argument(
        "--subnets",
        action="store_true",
        help="each peer in a /24 of its own (as home peers on different connections are); default: one /24",
    )
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    parser.add_argument("--workdir", metavar="DIR", help="node folders (default: a new temp folder)")
    args = parser.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"cannot build a namespace lab here: {why}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="statesync-home-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    command = f"python -m {MODULE} " + " ".join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {
        "benchmark": "statesync-home",
        "command": command.strip(),
        "environment": base_environment(("p2ptrain", "torch", "trio")),
        "load_before": os.getloadavg(),
        "workdir": str(workdir),
        "result": run(args, workdir),
    }
    report["load_after"] = os.getloadavg()
    json_path = (
        None if args.json == "-" else str(REPO_ROOT / args.json if args.json == DEFAULT_JSON else args.json)
    )
    write_report(report, json_path, format_table(report))
    return 0 if report["result"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
