"""Helpers of ``simulations.benchmarks.training``: run files, node processes, and what their metrics say.

Every process started here runs in a session (process group) of its own and is kept in a registry, so
that :func:`kill_all` ends it and everything it started, whatever happened (an exception, Ctrl-C, a
timeout). Nodes write their logs into a folder of their own (``stdout.log``: the join address first;
``node.log``: the node's log; ``status.json``; ``metrics.jsonl``), kept after the run as evidence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import REPO_ROOT
from simulations.labs.netns import NetnsLab

PEERS = 4  # every swarm here has four peers
LOOPBACK = "127.0.0.1"
POLL = 0.2  # seconds between looks at a status or metrics file
ADDRESS_TIMEOUT = 120.0  # seconds for a node to print its address (imports, corpus, identity)
STOP_GRACE = 60.0  # seconds a node may take to stop after SIGTERM (a last round, a checkpoint)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while in the ``with`` block (other work shares
    this machine: the load says how much CPU the nodes had)."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, list[float]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def summary(self) -> dict[str, Any]:
        s = self.samples or [0.0]
        return {"mean": round(statistics.fmean(s), 2), "max": round(max(s), 2), "every_s": self.every}


# ---- run files ---------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"no TOML form for {v!r}")


def toml_text(sections: dict[str, dict[str, Any]]) -> str:
    """A run file from {"section": {key: value}} (dotted section names such as "task.options" work)."""
    out = []
    for name, table in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def write_run_file(path: Path, sections: dict[str, dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = toml_text(sections)
    path.write_text(text)
    return text


# ---- processes ---------------------------------------------------------------------------------------

_REGISTRY: list[Proc] = []


def cli() -> list[str]:
    """How the harness starts p2ptrain: this interpreter (the virtualenv's), as ``p2ptrain`` on PATH does."""
    return [sys.executable, "-m", "p2ptrain"]


def shown(argv: Sequence[str]) -> str:
    """A command as a user would type it (``p2ptrain ...`` instead of ``/path/python -m p2ptrain ...``)."""
    words = list(argv)
    if words[:3] == cli():
        words = ["p2ptrain", *words[3:]]
    return shlex.join(words)


class Proc:
    """One child process in its own session; stdout to ``folder/stdout.log``, stderr to ``node.log``."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        folder: Path,
        *,
        lab: NetnsLab | None = None,
        index: int = 0,
        threads: int = 1,
        logs: tuple[str, str] = ("stdout.log", "node.log"),
    ) -> None:
        self.name, self.argv, self.folder, self.logs = name, argv, folder, logs
        folder.mkdir(parents=True, exist_ok=True)
        self._out = open(folder / logs[0], "wb")  # noqa: SIM115 (closed in close())
        self._err = open(folder / logs[1], "wb")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        kw: dict[str, Any] = dict(
            stdout=self._out, stderr=self._err, cwd=REPO_ROOT, env=env, start_new_session=True
        )
        self.started = time.time()
        self.proc = lab.popen(index, argv, **kw) if lab else subprocess.Popen(argv, **kw)
        _REGISTRY.append(self)

    @property
    def status_file(self) -> Path:
        return self.folder / "status.json"

    @property
    def metrics_file(self) -> Path:
        return self.folder / "metrics.jsonl"

    def address(self, timeout: float = ADDRESS_TIMEOUT) -> str:
        """The join address the node printed first (a line with /p2p/)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                for line in (self.folder / self.logs[0]).read_text().splitlines():
                    if "/p2p/" in line:
                        return line.strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before printing its address")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} printed no address in {timeout:g} s")
            time.sleep(POLL)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it still runs after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM (a node stops after a last checkpoint), then SIGKILL to its group after ``grace``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self.proc.send_signal(signal.SIGTERM)
            if self.wait(grace) is None:
                self.kill()
        self.kill()  # whatever it started and left behind
        return self.proc.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        self.close()

    def close(self) -> None:
        for f in (self._out, self._err):
            with contextlib.suppress(OSError):
                f.close()

    def metrics(self, path: Path | None = None) -> list[dict[str, Any]]:
        return read_jsonl(path or self.metrics_file)

    def status(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(self.status_file.read_text()).get("training") or {})
        return {}

    def log_tail(self, chars: int = 1500) -> str:
        with contextlib.suppress(OSError, ValueError):  # ValueError: already closed
            self._err.flush()
        with contextlib.suppress(OSError):
            return (self.folder / self.logs[1]).read_bytes()[-chars:].decode(errors="replace")
        return ""


def kill_all() -> None:
    """Kill every process the harness started (and their groups) that is still there."""
    while _REGISTRY:
        _REGISTRY.pop().kill()


def node_argv(
    *,
    listen: str,
    folder: Path,
    config: Path | None,
    max_steps: int | None = None,
    duration: float | None = None,
    join: str | None = None,
    wait_peers: int = 1,
    slowdown: float = 1.0,
    mode: str | None = None,
    threads: int = 1,
    run_id: str | None = None,
    resume: bool = False,
) -> list[str]:
    argv = [*cli(), "--log-level", "info", "node", "--listen", listen]
    argv += ["--config", str(config)] if config else ["--task", "tiny-gpt"]
    argv += ["--data-dir", str(folder), "--status-file", str(folder / "status.json")]
    argv += ["--metrics-file", str(folder / "metrics.jsonl"), "--threads", str(threads), "--no-live"]
    argv += ["--max-steps", str(max_steps)] if max_steps is not None else []
    argv += ["--duration", f"{duration:g}"] if duration else []
    argv += ["--wait-peers", str(wait_peers)] if wait_peers > 1 else []
    argv += ["--slowdown", f"{slowdown:g}"] if slowdown != 1 else []
    argv += ["--mode", mode] if mode else []
    argv += ["--run-id", run_id] if run_id else []
    argv += ["--resume"] if resume else []
    argv += ["--join", join] if join else []
    return argv


def run_to_end(procs: Sequence[Proc], timeout: float) -> dict[str, Any]:
    """Wait until every process exited or ``timeout``; then stop the rest. Exit codes and whether late."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        codes.append(p.wait(deadline - time.monotonic()))
    late = [p.name for p, c in zip(procs, codes, strict=True) if c is None]
    for p in procs:
        p.stop(grace=20.0 if late else STOP_GRACE)
    return {"exit_codes": [p.proc.returncode for p in procs], "timed_out": late}


def wait_for(pred: Callable[[], Any], timeout: float, what: str, alive: Sequence[Proc] = ()) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        for p in alive:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(POLL)


# ---- reading what nodes wrote ------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                out.append(obj)
    return out


def step_lines(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-global-step lines (not the final "stopped" one), the last line of each step."""
    by_step: dict[int, dict[str, Any]] = {}
    for m in metrics:
        if "event" not in m:
            by_step[int(m["step"])] = m
    return [by_step[k] for k in sorted(by_step)]


def stopped_line(metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((m for m in reversed(metrics) if m.get("event") == "stopped"), None)


def round_samples(lines: list[dict[str, Any]]) -> list[int]:
    """Samples each global step was taken over (the round's total weight, or the solo step's samples)."""
    return [int(m["rounds"]["last"].get("samples") or 0) for m in lines if m["rounds"].get("last")]


def interpolate(trace: list[tuple[float, int]], t: float) -> float:
    """samples_here at time ``t`` from (time, samples_here) status samples (linear; clamped at the ends)."""
    if not trace:
        return 0.0
    if t <= trace[0][0]:
        return float(trace[0][1])
    for (ta, sa), (tb, sb) in itertools.pairwise(trace):
        if ta <= t <= tb:
            return sa + (sb - sa) * ((t - ta) / (tb - ta) if tb > ta else 1.0)
    return float(trace[-1][1])


def useful_samples(lines: list[dict[str, Any]], first: int, last: int) -> int:
    """A peer's samples that went into global steps first+1 .. last: the growth of its samples_here up to
    each step it averaged (or took alone). Samples before a state download are discarded by the download
    (the optimizer restarts from the donor's state), so they do not count."""
    total, prev = 0, None
    for m in lines:
        outcome = m["rounds"]["last"].get("outcome")
        if prev is not None and first < m["step"] <= last and outcome in ("averaged", "alone"):
            total += m["samples_here"] - prev["samples_here"]
        prev = m
    return total


def swarm_throughput(
    per_peer: list[list[dict[str, Any]]], traces: list[list[tuple[float, int]]]
) -> dict[str, Any]:
    """A swarm's samples per second between its first and last global step (start-up and the wait for
    peers before the first step left out), two ways:

    - processed: every peer's samples_here growth over that window (from the status files the harness
      polled, so that a peer that logged no step counts too);
    - useful: the samples that went into the global steps of the window (from the metrics lines: a peer
      left out of a round, that then downloaded the state, lost the samples it had computed).

    The window is that of the peer that logged the most global steps."""
    ref = max(range(len(per_peer)), key=lambda i: len(per_peer[i]))
    lines = per_peer[ref]
    if len(lines) < 2:
        return {"error": "fewer than two global steps logged"}
    first, last = lines[0], lines[-1]
    t0, t1 = first["time"], last["time"]
    span = t1 - t0
    processed = [round(interpolate(tr, t1) - interpolate(tr, t0)) for tr in traces]
    useful = [useful_samples(p, first["step"], last["step"]) for p in per_peer]
    total, used = sum(processed), sum(useful)
    return {
        "from_step": first["step"],
        "to_step": last["step"],
        "seconds": round(span, 2),
        "samples": processed,
        "samples_per_s": round(total / span, 2) if span > 0 else None,
        "shares": [round(x / total, 4) for x in processed] if total else None,
        "useful_samples": useful,
        "useful_samples_per_s": round(used / span, 2) if span > 0 else None,
        "useful_shares": [round(x / used, 4) for x in useful] if used else None,
        "steps_per_peer": [len(p) for p in per_peer],
    }


def status_throughput(trace: list[tuple[float, int]], skip_s: float) -> dict[str, Any]:
    """Samples per second from (time, samples_here) pairs a node wrote to its status file, leaving out
    the first ``skip_s`` seconds after the first sample was counted (warm-up)."""
    counted = [(t, s) for t, s in trace if s > 0]
    if len(counted) < 2:
        return {"error": "fewer than two status samples with training progress"}
    t0 = counted[0][0] + skip_s
    window = [(t, s) for t, s in counted if t >= t0] or counted[-2:]
    (ta, sa), (tb, sb) = window[0], window[-1]
    if tb <= ta:
        (ta, sa), (tb, sb) = counted[0], counted[-1]
    return {
        "seconds": round(tb - ta, 2),
        "samples": sb - sa,
        "samples_per_s": round((sb - sa) / (tb - ta), 2) if tb > ta else None,
    }


# ---- evidence from node logs -------------------------------------------------------------------------

# Log messages that explain lost time or samples, counted per node (see collaborative.py and trainer.py).
LOG_PATTERNS = {
    "alone_waiting": r"alone on step \d+ while \d+ peer\(s\) catch up",
    "stepped_alone": r"peers did not catch up within",
    "no_group": r"no group for step",
    "aborted": r"averaging round aborted",
    "catching_up": r"catching up:",
    "catch_up_failed": r"could not catch up",
    "left_out": r"samples were left out of the round",
    "progress_publish_failed": r"could not publish progress",
    "progress_read_failed": r"could not read progress records",
}
_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d) ")


def log_evidence(folder: Path, examples: int = 3) -> dict[str, Any]:
    """Counts of the telling messages in a node's log, a few examples of each, and its warnings/errors."""
    try:
        lines = (folder / "node.log").read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[str, Any] = {}
    for key, pat in LOG_PATTERNS.items():
        hits = [ln for ln in lines if re.search(pat, ln)]
        if hits:
            out[key] = {"count": len(hits), "examples": [h[:240] for h in hits[:examples]]}
    bad = [ln[:240] for ln in lines if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]
    if bad:
        out["warnings"] = {"count": len(bad), "first": bad[:examples]}
    return out


def log_times(folder: Path, patterns: dict[str, str]) -> dict[str, str]:
    """The wall-clock time (HH:MM:SS, as logged) of the first line matching each pattern."""
    try:
        lines = (folder / "node.log").read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out = {}
    for key, pat in patterns.items():
        for ln in lines:
            if re.search(pat, ln) and _TIME.match(ln):
                out[key] = ln[:8]
                break
    return out


def seconds_of_day(hms: str) -> int:
    h, m, s = (int(x) for x in hms.split(":"))
    return 3600 * h + 60 * m + s


# ---- notes: what the evidence says about a miss ------------------------------------------------------

STATE_SIZE_BUG = "more than this model could need"  # statesync's refusal when a state looks too big


def heterogeneity_notes(out: dict[str, Any]) -> list[str]:
    notes = [
        "Solo throughputs: "
        + ", ".join(f"x{s['slowdown']:g} {s.get('samples_per_s')} samples/s" for s in out["solo"])
        + "; each run alone, with the same run file, slowdown and threads, one after the other "
        "(the two x2 peers share one measurement). Swarm throughput: samples processed between the first "
        "and the last global step over that time (status files); 'useful' counts only the samples that "
        "went into global steps (metrics lines: a peer left out of a round loses what it computed when "
        "it downloads the state). The target is met only if both reach 90%."
    ]
    for v in out["variants"]:
        if "throughput" not in v:
            continue
        tp = v["throughput"]
        notes.append(
            f"[{v['variant']}] groups per step {v['group_per_step']}, global steps per peer "
            f"{tp.get('steps_per_peer')}, steps reached {v['steps_reached']}; each peer's speed in the swarm "
            f"relative to alone {v.get('per_peer_speed_vs_solo')} = compute utilization "
            f"{v['compute_utilization']} x compute speed relative to alone "
            f"{v.get('per_peer_compute_speed_vs_solo')}; protocol efficiency {v.get('protocol_efficiency')}; "
            f"round seconds (first peer) {v['round_seconds']}; useful samples per peer "
            f"{tp.get('useful_samples')} of processed {tp.get('samples')}. Log messages: "
            f"{evidence_counts(v['evidence'])}."
        )
        if any(g is not None and g < PEERS for g in v["group_per_step"]):
            notes.append(
                f"[{v['variant']}] some rounds formed without every peer: a peer starts matchmaking only "
                "from CollaborativeOptimizer.step(), after each of its batches, so a peer whose batch "
                "outlasts the leader's gathering window (averaging.matchmaking_time, 3 s by default) "
                "misses the group, falls behind, and must download the state, discarding its samples."
            )
        left = [n for n, ev in v["evidence"].items() if "left_out" in ev]
        if left:
            notes.append(
                f"[{v['variant']}] {', '.join(left)}: samples left out of a round ('our N samples were left "
                "out of the round'): in sync mode a member joins the round at its next step(), after its "
                "current batch; a slowed peer's batch (8x) can outlast the round's scatter deadline "
                "(0.4 x averaging.timeout), so its samples are dropped, and the fast members wait for it "
                "until then (the long round seconds above)."
            )
        stuck = evidence_with(v["evidence"], STATE_SIZE_BUG)
        if stuck:
            notes.append(
                f"[{v['variant']}] {', '.join(stuck)} could not download the state at all ('announced N "
                f"bytes, {STATE_SIZE_BUG}'): CollaborativeOptimizer.max_state_bytes() bounds a download by "
                "twice this peer's own state, which before its first optimizer step holds no AdamW moments "
                "(a third of the donor's state), so a peer that missed its first round stays behind."
            )
    notes.append(
        "Each peer's speed relative to alone below 1 comes from two things: time not computing (1 - "
        "compute utilization: waiting for rounds and for the slowest member's batch) and slower compute "
        "(4 processes, the harness and other work share 2 cores; see the load averages, and compare "
        "them with the solo runs'). The protocol efficiency takes the second out: useful samples over "
        "what the peers would have processed at their in-swarm compute speed without waiting."
    )
    return notes


def late_joiner_notes(out: dict[str, Any]) -> list[str]:
    ev = out["evidence"]
    notes = []
    for i, v in enumerate(out["variants"]):
        steps = [(x["t"], x["step"], x["last"].get("outcome")) for x in v["lines"]]
        notes.append(
            f"[{v['variant']}, node{3 + i}] timeline from its node.log (whole seconds after its start): "
            f"{v['timeline_s']}; its first global-step lines (s, step, outcome): {steps}."
        )
    notes.append(f"Log messages: {evidence_counts(ev)}.")
    if evidence_with({"node3": ev.get("node3", {})}, STATE_SIZE_BUG):
        notes.append(
            "The fresh joiner's state downloads failed ('announced N bytes, " + STATE_SIZE_BUG + "') until "
            "it had taken an optimizer step of its own: CollaborativeOptimizer.max_state_bytes() bounds a "
            "download by twice this peer's own captured state, and a fresh peer's AdamW holds no moments "
            "yet, while the donors' state does (model + 2 moments, 3x the parameters); the bound covers it "
            "(with its +1 MiB slack) only for models under about 260k parameters. The joiner waited "
            "averaging.timeout (30 s) to step alone ('peers did not catch up'), after which its download "
            "succeeded: most of the time to its first contribution is this bug."
        )
    if len(out["variants"]) > 1:
        notes.append(
            "The second joiner (node4) resumed from a checkpoint of one solo step taken before the swarm "
            "started (same run, same identity, --resume): its AdamW has moments, so the bound lets the "
            "swarm's state in; it shows the time to join once that bug is out of the way (its own state is "
            "stale, so it downloads like a fresh node)."
        )
    bad = [c for c in out.get("exit_codes_after_sigterm", []) if c not in (0, None)]
    if bad:
        notes.append(
            f"Exit codes after SIGTERM: {out['exit_codes_after_sigterm']} (not all clean): see the end of "
            "those nodes' node.log."
        )
    return notes


# ---- runs: a simulated swarm, a node alone, a solo throughput, a swarm in the netns lab ---------------


def simulate(
    folder: Path, config: Path, steps: int, timeout: float, slowdown: tuple[float, ...] = ()
) -> dict[str, Any]:
    """``p2ptrain simulate`` with 4 peers; its nodes' step lines and final status."""
    argv = [*cli(), "simulate", "--peers", str(PEERS), "--max-steps", str(steps), "--config", str(config)]
    argv += ["--slowdown", ",".join(f"{s:g}" for s in slowdown)] if slowdown else []
    argv += ["--threads", "1", "--workdir", str(folder), "--no-live"]
    proc = Proc("simulate", argv, folder, logs=("simulate.out", "simulate.err"))
    began = time.perf_counter()
    traces: list[list[tuple[float, int]]] = [[] for _ in range(PEERS)]
    deadline = time.monotonic() + timeout
    while proc.proc.poll() is None and time.monotonic() < deadline:
        for i, trace in enumerate(traces):
            poll_status(folder / f"node{i}" / "status.json", trace)
        time.sleep(0.5)
    ended = run_to_end([proc], deadline - time.monotonic())
    metrics = [read_jsonl(folder / f"node{i}" / "metrics.jsonl") for i in range(PEERS)]
    summary = read_jsonl_one(folder / "report" / "summary.json")
    return {
        "command": shown(argv),
        "exit_code": ended["exit_codes"][0],
        "timed_out": bool(ended["timed_out"]),
        "seconds": round(time.perf_counter() - began, 1),
        "lines": [step_lines(m) for m in metrics],
        "stopped": [stopped_line(m) for m in metrics],
        "traces": traces,
        "summary": summary,
        "evidence": {f"node{i}": log_evidence(folder / f"node{i}") for i in range(PEERS)},
        "tail": proc.log_tail() if ended["exit_codes"][0] else "",
    }


def poll_status(path: Path, trace: list[tuple[float, int]]) -> None:
    """Append (time, samples_here) from a node's status file when it changed."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        st = json.loads(path.read_text())["training"]
        if st.get("samples_here") is not None and (not trace or st["time"] != trace[-1][0]):
            trace.append((float(st["time"]), int(st["samples_here"])))


def read_jsonl_one(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def single(folder: Path, config: Path, timeout: float, **kw: Any) -> dict[str, Any]:
    """One node alone on loopback; its step lines."""
    argv = node_argv(listen=f"{LOOPBACK}:0", folder=folder, config=config, **kw)
    proc = Proc(folder.name, argv, folder)
    began = time.perf_counter()
    ended = run_to_end([proc], timeout)
    metrics = read_jsonl(proc.metrics_file)
    return {
        "command": shown(argv),
        "exit_code": ended["exit_codes"][0],
        "timed_out": bool(ended["timed_out"]),
        "seconds": round(time.perf_counter() - began, 1),
        "lines": step_lines(metrics),
        "stopped": stopped_line(metrics),
        "evidence": log_evidence(folder),
    }


def final_val(lines: list[dict[str, Any]], step: int) -> float | None:
    line = next((m for m in lines if m["step"] == step), None)
    return float(line["val_loss"]) if line and line.get("val_loss") is not None else None


def batch_stats(samples: list[int]) -> dict[str, Any]:
    if not samples:
        return {}
    return {
        "first": samples[0],
        "median": statistics.median(samples),
        "max": max(samples),
        "mean": round(statistics.fmean(samples), 1),
    }


def solo_throughput(folder: Path, config: Path, slowdown: float, duration: float) -> dict[str, Any]:
    """One node alone with this slowdown for ``duration`` s of training; samples/s from its status file."""
    argv = node_argv(
        listen=f"{LOOPBACK}:0", folder=folder, config=config, duration=duration, slowdown=slowdown
    )
    proc = Proc(folder.name, argv, folder)
    trace: list[tuple[float, int]] = []
    deadline = time.monotonic() + duration + 120
    while proc.proc.poll() is None and time.monotonic() < deadline:
        poll_status(proc.status_file, trace)
        time.sleep(0.25)
    proc.stop(grace=20.0)
    last = stopped_line(read_jsonl(proc.metrics_file))
    if last:
        trace.append((float(last["time"]), int(last["samples_here"])))
    got = status_throughput(trace, skip_s=3.0)
    return {"slowdown": slowdown, "command": shown(argv), "load_after": loadavg(), **got}


def lab_run(lab: NetnsLab, folder: Path, config: Path, steps: int, timeout: float) -> dict[str, Any]:
    """4 nodes, one per namespace, node 0 first, the others join it; until they reach ``steps``."""
    procs: list[Proc] = []
    before = [lab.link_bytes(i) for i in range(PEERS)]
    began = time.perf_counter()
    try:

        def start(i: int, join: str | None) -> Proc:
            argv = node_argv(
                listen=f"{lab.address(i)}:0",
                folder=folder / f"node{i}",
                config=config,
                max_steps=steps,
                wait_peers=PEERS,
                join=join,
            )
            procs.append(Proc(f"node{i}", argv, folder / f"node{i}", lab=lab, index=i))
            return procs[-1]

        join = start(0, None).address()
        for i in range(1, PEERS):
            start(i, join)
        ended = run_to_end(procs, timeout)
    finally:
        for p in procs:
            p.stop(grace=20.0)
    after = [lab.link_bytes(i) for i in range(PEERS)]
    metrics = [p.metrics() for p in procs]
    stopped = [stopped_line(m) for m in metrics]
    util = [round(s["compute_utilization"], 4) if s else None for s in stopped]
    lines = [step_lines(m) for m in metrics]
    return {
        "commands": [shown(p.argv) + f"   # in netns {i}" for i, p in enumerate(procs)],
        "exit_codes": ended["exit_codes"],
        "timed_out": ended["timed_out"],
        "seconds": round(time.perf_counter() - began, 1),
        "compute_utilization": util,
        "steps": [s["step"] if s else None for s in stopped],
        "rounds": [s["rounds"] if s else None for s in stopped],
        "batch_per_step": batch_stats(round_samples(lines[0])),
        "round_seconds": [m["rounds"]["last"].get("seconds") for m in lines[0]],
        "step_times_s": [round(m["time"] - lines[0][0]["time"], 1) for m in lines[0]] if lines[0] else [],
        "link_tx_mb": [round((a["tx"] - b["tx"]) / 1e6, 1) for a, b in zip(after, before, strict=True)],
        "evidence": {f"node{i}": log_evidence(folder / f"node{i}") for i in range(PEERS)},
        "tails": {p.name: p.log_tail(800) for p in procs} if any(ended["exit_codes"]) else {},
    }


def evidence_counts(evidence: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{node: {message kind: count}} for the nodes whose logs had any telling message."""
    return {node: {k: v["count"] for k, v in ev.items()} for node, ev in evidence.items() if ev}


def evidence_with(evidence: dict[str, dict[str, Any]], text: str) -> list[str]:
    """The nodes whose logged examples mention ``text``."""
    return [
        node
        for node, ev in evidence.items()
        if any(text in line for v in ev.values() for line in v.get("examples", v.get("first", [])))
    ]


# ---- a late joiner -------------------------------------------------------------------------------------

JOIN_MARKS = {  # what a joiner's node.log says, and when
    "address_printed": r"is up in run",
    "resumed": r"resumed from the checkpoint",
    "catching_up": r"catching up:",
    "state_applied": r"now on step",
    "first_averaged_step": r"step \d+: .*averaged",
}


def measure_join(joiner: Proc, t0: float, timeout: float, more: int, alive: Sequence[Proc]) -> dict[str, Any]:
    """Seconds from ``t0`` (the joiner's start) to its first metrics line with rounds.averaged >= 1 (a
    global step it took part in) and to its first state download; then waits for ``more`` averaged steps
    (to see that it keeps contributing). TimeoutError/RuntimeError when it does not contribute in time."""

    def first_line(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((m for m in joiner.metrics() if "event" not in m and pred(m)), None)

    contributed = wait_for(
        lambda: first_line(lambda m: m["rounds"]["averaged"] >= 1),
        timeout,
        f"a step from {joiner.name}",
        alive,
    )
    synced = first_line(lambda m: m["rounds"]["synced"] >= 1)
    with contextlib.suppress(TimeoutError):
        wait_for(
            lambda: first_line(lambda m: m["rounds"]["averaged"] >= 1 + more), 120.0, "more steps", alive
        )
    start_s = seconds_of_day(time.strftime("%H:%M:%S", time.localtime(t0)))
    return {
        "first_contribution_s": round(contributed["time"] - t0, 2),
        "first_contribution_step": contributed["step"],
        "first_contribution_round": contributed["rounds"]["last"],
        "first_sync_s": round(synced["time"] - t0, 2) if synced else None,
        "lines": [
            {"t": round(m["time"] - t0, 2), "step": m["step"], "last": m["rounds"]["last"]}
            for m in step_lines(joiner.metrics())[:8]
        ],
        "timeline_s": {  # from its node.log, whole seconds
            k: seconds_of_day(v) - start_s for k, v in log_times(joiner.folder, JOIN_MARKS).items()
        },
    }


def seed_checkpoint(folder: Path, run_id: str, timeout: float = 240.0) -> dict[str, Any]:
    """A node alone for one global step in ``folder``: its checkpoint holds AdamW moments, so a node started
    there with --resume (same identity) is not refused the swarm's state by max_state_bytes()."""
    argv = node_argv(listen=f"{LOOPBACK}:0", folder=folder, config=None, max_steps=1, run_id=run_id)
    proc = Proc(f"{folder.name}-seed", argv, folder, logs=("seed.out", "seed.log"))
    ended = run_to_end([proc], timeout)
    return {"command": shown(argv), "exit_code": ended["exit_codes"][0]}
