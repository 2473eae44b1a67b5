"""State-sync benchmark: a late joiner downloads the ~124M model's state over 100 Mbit/s links.

For each donor count (``--donors``, default 1 and 3), ``D`` donors (real ``p2ptrain node`` processes)
train the built-in GPT at ``--size`` in DiLoCo mode, each in a network namespace of its own behind a
link shaped with ``tc tbf`` at ``--rate-mbit`` each way (``simulations.labs.netns``; root). Without root, or
with ``--userspace``, the userspace WAN emulator (``simulations.labs.wan.WanSwitch``) shapes the links
instead. Once the donors took their first global step, a fresh node (the joiner) starts on a link of the
same rate and joins them. It is behind, so it downloads the state. Measured from the joiner's log (run
with ``--log-format json``: millisecond timestamps) and metrics file:

* the **bytes downloaded** (its "downloaded step N's state (X MB)" line) and the **download time**, from
  the start of the successful transfer (its "catching up" line, or the last failed donor of the same
  attempt) to that line; the **rate** as a fraction of the link rate (target: at least 85% from one
  donor); also the rate of the transfer's body (from its 25% to its 100% progress line), the time spent
  decoding and checking after the last byte (100% line to the "downloaded" line), and the bytes the
  joiner's link received in the download window (link counters: headers and other traffic included);
* the **time from the joiner's start to its first contribution**: its first metrics line whose last
  round was averaged with its own samples in it and at least one other contributor.

``--catchup`` (issue 49): the donors' rounds last about ``CATCHUP_ROUND_FACTOR`` times the state's
transfer time instead, so that the swarm steps once or twice while the joiner downloads; then it must
catch up without a second download (by replaying the missed steps' results, see
``p2ptrain.training.state.replay``). Reported besides: the downloads and the replayed steps, and
**caught up s**, the time from its first "catching up" line to the last "now on step" line before its
first contribution (targets: one download, and at most ``CATCHUP_TARGET`` times the state's transfer
time at the link rate).

The run file is ``configs/gpt2-124m.toml``'s DiLoCo (overlap on, fp16 pseudo-gradients, a 600 s round
timeout, 30 s progress records) at ``--size``, with one sample per batch, a 64-byte context (a CPU step
in seconds), evaluation and periodic checkpoints off. Rounds are long on purpose: the donors' target
batch is set so that a round lasts about ``ROUND_FACTOR`` times the state's transfer time at the link
rate (at least ``MIN_ROUND_S``), from an estimate of this machine's compute speed (``--round-samples``
sets it outright), so that the swarm does not move on twice while the joiner downloads. If the joiner
does not contribute within ``--timeout`` seconds, or its downloads fail ``--max-failures`` times, or it
exits, the run ends with status ``failed`` and the reason from its log; nothing waits without a bound.
Each node's peak RSS (VmHWM, sampled) is reported too, and the nodes are killed (status ``aborted``) if
the machine's MemAvailable falls below 1.5 GiB.

Usage::

    python -m simulations.bench_statesync [--donors 1,3] [--size 124m] [--rate-mbit 100] [--timeout 900]
        [--userspace] [--max-failures 4] [--round-samples N] [--catchup] [--quick] [--json PATH]
        [--workdir DIR]

``--quick``: ``--size 10m --donors 1`` (a smoke run of a few minutes). The JSON report goes to PATH
(default ``simulations/results/statesync.json``; ``-``: stdout), a table to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment
from simulations.benchmarks.scale import (
    BLOCK_SIZE,
    MemoryWatch,
    parameter_count,
    parse_list,
    parse_size,
    save_partial,
)
from simulations.benchmarks.training_runs import (
    Proc,
    interpolate,
    kill_all,
    loadavg,
    log_evidence,
    node_argv,
    read_jsonl,
    shown,
    step_lines,
    wait_for,
    write_run_file,
)
from simulations.labs.netns import NetnsLab, unavailable

MODULE = "simulations.bench_statesync"
DEFAULT_JSON = "simulations/results/statesync.json"
TARGET_FRACTION = 0.85  # of the link rate, from one donor
BATCH_SIZE = 1
MAX_BYTES = 1_000_000
# A DiLoCo state in fp32 copies of the model: 3 (the model, the global copy, the outer momentum) before
# commit 13e8f22, 2 since (the model at its global parameters, the momentum). Sizes the rounds: the larger.
STATE_COPIES = 3
ROUND_FACTOR = 2.0  # a round lasts this many expected transfer times ...
MIN_ROUND_S = 60.0  # ... and at least this
# Forward/backward FLOP/s of one 1-thread node on this machine's cores (measured: about 24 GFLOP/s for
# the 124M model with a 64-byte context): sizes the donors' rounds from the model's 6 x params x tokens.
GFLOPS = 24.0
DONOR_STEP_TIMEOUT = 900.0  # seconds for the donors' first global step
CATCHUP_ROUND_FACTOR = 0.4  # --catchup: a round lasts this many expected transfer times
CATCHUP_TARGET = 1.5  # --catchup: on the swarm's step within this many transfer times at the link rate


# ---- pure helpers: the joiner's log ---------------------------------------------------------------------

PATTERNS = {  # message kinds in a node's log (p2ptrain/training/collaborative.py, statesync.py, cli/train.py)
    "up": re.compile(r"is up in run"),
    "catching_up": re.compile(r"catching up: (.*)"),
    "progress": re.compile(r"downloading the swarm's state: (\d+)% of ([\d.]+) MB"),
    # "from PEER" (one donor at a time), or "from N donor(s) in S s" (chunks from several at once)
    "downloaded": re.compile(r"downloaded step (\d+)'s state \(([\d.]+) MB\) from (\S+)"),
    # "state download from PEER failed: WHY" (one donor at a time), or "state download from PEER: WHY"
    "failed": re.compile(r"state download from (\S+?)(?: failed)?: (.*)"),
    "could_not": re.compile(r"could not catch up \((.*)\)"),
    "applied": re.compile(r"now on step (\d+)"),
    "replayed": re.compile(r"replayed (\d+) step"),
}


@dataclass(frozen=True)
class Event:
    t: float  # seconds since the epoch, as logged
    kind: str
    groups: tuple[str, ...]
    message: str


def parse_events(lines: Iterable[str]) -> list[Event]:
    """The telling messages of a ``--log-format json`` log (other lines, e.g. tracebacks, are skipped)."""
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
            t, message = float(entry["time"]), str(entry["message"])
        except (ValueError, KeyError, TypeError):
            continue
        for kind, pattern in PATTERNS.items():
            m = pattern.search(message)
            if m:
                out.append(Event(t, kind, m.groups(), message))
                if kind != "applied":  # ("now on step N: replayed k step(s) ...": both)
                    break
    return out


def attempts(events: list[Event]) -> list[dict[str, Any]]:
    """Each catch-up attempt (from a "catching up" line): how it ended, when, the bytes, the reason.

    A successful attempt's transfer starts at the attempt or at the last donor that failed in it (a
    download tries the donors one after the other)."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for e in events:
        if e.kind == "catching_up":
            cur = {"start": e.t, "transfer_start": e.t, "why": e.groups[0], "outcome": None, "failures": []}
            out.append(cur)
        elif cur is None or cur["outcome"] is not None:
            continue
        elif e.kind == "failed":
            cur["failures"].append(f"{e.groups[0]}: {e.groups[1]}")
            cur["transfer_start"] = e.t
        elif e.kind == "progress" and int(e.groups[0]) in (25, 100):
            cur[f"t{int(e.groups[0])}"] = e.t  # the last bytes in at t100; decoding and checks follow
        elif e.kind == "downloaded":
            cur |= {"outcome": "downloaded", "end": e.t, "step": int(e.groups[0])}
            cur["bytes"] = round(float(e.groups[1]) * 1e6)
            if e.groups[2].isdigit():  # "from N donor(s)": chunks from several at once
                cur["donors_used"] = int(e.groups[2])
            else:
                cur["donor"] = e.groups[2]
        elif e.kind == "could_not":
            cur |= {"outcome": "failed", "end": e.t, "reason": e.groups[0]}
    return out


def download_figures(
    attempt: dict[str, Any], rate_mbit: float, first_start: float | None = None
) -> dict[str, Any]:
    """Seconds, Mbit/s and the fraction of the link of one successful attempt. ``first_start``: the start
    of the first of the attempts before it that failed; a download that resumes (keeps the chunks it has)
    is timed from there, so that the bytes earlier attempts fetched do not make it look faster."""
    begin = attempt["transfer_start"] if first_start is None else first_start
    secs = attempt["end"] - begin
    nbytes = attempt["bytes"]
    mbit = nbytes * 8 / secs / 1e6 if secs > 0 else None
    out: dict[str, Any] = {
        "bytes": nbytes,
        "seconds": round(secs, 3),
        "rate_mbit": round(mbit, 2) if mbit else None,
        "fraction_of_link": round(mbit / rate_mbit, 3) if mbit else None,
        "from_catching_up_s": round(attempt["end"] - attempt["start"], 3),
        "timed_from": "the last attempt's transfer" if first_start is None else "the first failed attempt",
    }
    if "t100" in attempt:
        out["bytes_in_s"] = round(attempt["t100"] - begin, 3)  # the bytes' own time
        out["decode_and_check_s"] = round(attempt["end"] - attempt["t100"], 3)
        if attempt.get("t25") is not None and attempt["t100"] > attempt["t25"]:
            body = 0.75 * nbytes * 8 / (attempt["t100"] - attempt["t25"]) / 1e6
            out |= {"body_rate_mbit": round(body, 2), "body_fraction_of_link": round(body / rate_mbit, 3)}
    return out


def first_contribution(metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first global-step line of a round this node averaged with others, its own samples in it."""
    for m in metrics:
        if "event" in m:
            continue
        last = (m.get("rounds") or {}).get("last") or {}
        others = (last.get("contributors") or last.get("group") or 0) >= 2
        if last.get("outcome") == "averaged" and (last.get("mine") or 0) > 0 and others:
            return m
    return None


def failure_reason(events: list[Event], limit: int = 3) -> str | None:
    """The last few download failures, as the joiner logged them."""
    bad = [e.message for e in events if e.kind in ("failed", "could_not")]
    return "; ".join(bad[-limit:]) if bad else None


def round_samples(
    donors: int, parameters: int, state_bytes: int, rate_mbit: float, cores: int, catchup: bool = False
) -> int:
    """The donors' target batch: a round of about ROUND_FACTOR x the state's transfer time (at least
    MIN_ROUND_S; ``catchup``: CATCHUP_ROUND_FACTOR x, no minimum), at the estimated samples/s of
    ``donors`` 1-thread nodes sharing ``cores`` cores."""
    transfer = state_bytes * 8 / (rate_mbit * 1e6)
    seconds = CATCHUP_ROUND_FACTOR * transfer if catchup else max(MIN_ROUND_S, ROUND_FACTOR * transfer)
    per_node = GFLOPS * 1e9 / (6 * parameters * BLOCK_SIZE * BATCH_SIZE)  # samples/s
    rate = per_node * min(donors, max(1, cores))
    return max(2 * donors, round(seconds * rate))


def host_port(addr: str) -> tuple[str, int] | None:
    """A status file's listening address, ``/ip4/H/tcp/P/p2p/ID`` or ``H:P``, as (H, P); None if neither."""
    parts = addr.split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
        return parts[2], int(parts[4])
    host, _, port = addr.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


# ---- emulation -----------------------------------------------------------------------------------------


class Links:
    """N peers on links of one rate: network namespaces (root) or the userspace WAN switch."""

    def __init__(self, n: int, rate_mbit: float, userspace: bool) -> None:
        self.n, self.rate_mbit = n, rate_mbit
        self.lab: NetnsLab | None = None
        self.switch: Any = None
        self._stack = contextlib.ExitStack()
        self.kind = "userspace" if userspace or unavailable() else "netns"

    def __enter__(self) -> Links:
        if self.kind == "netns":
            self.lab = self._stack.enter_context(NetnsLab(self.n, self.rate_mbit, prefix="p2psync"))
        else:
            from simulations.labs.wan import LinkProfile, WanSwitch

            profiles = [LinkProfile(self.rate_mbit, self.rate_mbit) for _ in range(self.n)]
            self.switch = self._stack.enter_context(WanSwitch(profiles).in_thread())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def describe(self) -> str:
        if self.kind == "netns":
            return f"network namespaces, every link {self.rate_mbit:g} Mbit/s each way (tc tbf)"
        return f"userspace WAN switch (simulations.labs.wan), every link {self.rate_mbit:g} Mbit/s each way"

    def listen_args(self, i: int) -> tuple[str, list[str]]:
        """(--listen value, more node arguments) for peer i."""
        if self.lab is not None:
            return f"{self.lab.address(i)}:0", []
        host = self.switch.source_address(i)
        return f"{host}:0", ["--announce", self.switch.announce(i), "--source-address", host]

    def started(self, i: int, proc: Proc) -> None:
        """Userspace: tell the switch where peer i really listens (from its status file)."""
        if self.switch is None:
            return
        host = self.switch.source_address(i)

        def listening() -> tuple[str, int] | None:
            with contextlib.suppress(OSError, ValueError):
                for addr in json.loads(proc.status_file.read_text()).get("listening") or []:
                    got = host_port(str(addr))
                    if got is not None and got[0] == host:
                        return got
            return None

        self.switch.set_upstream(i, wait_for(listening, 120.0, f"peer {i}'s listening address", [proc]))

    def received(self, i: int) -> int | None:
        """Bytes peer i's link delivered to it so far."""
        with contextlib.suppress(RuntimeError, OSError, ValueError, KeyError, IndexError):
            if self.lab is not None:
                return self.lab.link_bytes(i)["rx"]
            return int(self.switch.stats()["peers"][i]["received"])
        return None


@contextlib.contextmanager
def sampling(links: Links, i: int, every: float = 0.5) -> Iterator[list[tuple[float, int]]]:
    """(time, bytes received by peer i's link) every ``every`` seconds while in the block."""
    trace: list[tuple[float, int]] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            got = links.received(i)
            if got is not None:
                trace.append((time.time(), got))
            stop.wait(every)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield trace
    finally:
        stop.set()
        thread.join(5.0)


# ---- one run ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    donors: tuple[int, ...]
    size: str
    shape: tuple[int, int, int]
    rate_mbit: float
    timeout: float
    userspace: bool
    max_failures: int
    round_samples: int | None
    workdir: Path
    quick: bool
    catchup: bool = False

    def command(self, donors: int | None = None) -> str:
        d = str(donors) if donors is not None else ",".join(str(x) for x in self.donors)
        words = [
            f"python -m {MODULE}",
            "--donors",
            d,
            "--size",
            self.size,
            "--rate-mbit",
            f"{self.rate_mbit:g}",
        ]
        words += ["--timeout", f"{self.timeout:g}"]
        words += ["--userspace"] if self.userspace else []
        words += ["--round-samples", str(self.round_samples)] if self.round_samples else []
        words += ["--catchup"] if self.catchup else []
        return " ".join(words)


def run_sections(plan: Plan, donors: int, target: int) -> dict[str, dict[str, Any]]:
    layers, heads, width = plan.shape
    return {
        "run": {"id": f"bench-statesync-{plan.size}-{donors}", "seed": 1},
        "task": {"name": "tiny-gpt"},
        "task.options": {
            "n_layer": layers,
            "n_head": heads,
            "n_embd": width,
            "block_size": BLOCK_SIZE,
            "max_bytes": MAX_BYTES,
        },
        "training": {
            "mode": "diloco",
            "batch_size": BATCH_SIZE,
            "target_batch_size": target,
            "lr": 1e-4,
            "warmup_steps": 0,
            "threads": 1,
        },
        # configs/gpt2-124m.toml's settings: a round of 124M fp16 pseudo-gradients takes about 20 s at
        # 100 Mbit/s, longer than the scatter deadline (0.4 x timeout) of the 60 s of the tiny configs
        "diloco": {"overlap": True},
        "averaging": {"timeout": 600.0, "matchmaking_time": 5.0, "compression": "fp16"},
        "progress": {"interval": 1.0, "ttl": 30.0},
        "checkpoint": {"every_steps": 0},
        "eval": {"every_steps": 0},
    }


def run_donors(plan: Plan, donors: int) -> dict[str, Any]:
    params = parameter_count(plan.shape)
    state_bytes = STATE_COPIES * 4 * params
    target = plan.round_samples or round_samples(
        donors, params, state_bytes, plan.rate_mbit, os.cpu_count() or 1, plan.catchup
    )
    folder = plan.workdir / f"donors-{donors}"
    config = folder / "run.toml"
    text = write_run_file(config, run_sections(plan, donors, target))
    out: dict[str, Any] = {
        "donors": donors,
        "size": plan.size,
        "parameters": params,
        "expected_state_bytes": state_bytes,
        "expected_transfer_s": round(state_bytes * 8 / (plan.rate_mbit * 1e6), 1),
        "target_batch_size": target,
        "rate_mbit": plan.rate_mbit,
        "run_file": text,
        "command": plan.command(donors),
        "workdir": str(folder),
        "catchup": plan.catchup,
    }
    procs: list[Proc] = []
    began = time.perf_counter()
    with Links(donors + 1, plan.rate_mbit, plan.userspace) as links, MemoryWatch() as watch:
        out["emulation"] = links.describe()

        def start(i: int, join: str | None, wait: int, name: str) -> Proc:
            listen, more = links.listen_args(i)
            argv = node_argv(
                listen=listen,
                folder=folder / name,
                config=config,
                max_steps=100_000,
                join=join,
                wait_peers=wait,
            )
            argv += [*more, "--log-format", "json"]
            p = Proc(name, argv, folder / name, lab=links.lab, index=i)
            procs.append(p)
            watch.add(p.proc.pid, p.started)  # peak RSS; kills the nodes if the machine runs low on memory
            links.started(i, p)
            return p

        try:
            first = start(0, None, donors, "donor0")
            join = first.address(timeout=600.0)
            for i in range(1, donors):
                start(i, join, donors, f"donor{i}")
            wait_for(
                lambda: any(m["step"] >= 1 for m in step_lines(first.metrics())),
                DONOR_STEP_TIMEOUT,
                "the donors' first global step",
                procs,
            )
            out["donors_first_step_s"] = round(time.perf_counter() - began, 1)
            t0 = time.time()
            with sampling(links, donors) as trace:
                joiner = start(donors, join, 1, "joiner")
                out |= watch_joiner(plan, joiner, t0, procs)
            swarm = [
                (float(m["time"]), int(m["step"])) for p in procs[:donors] for m in step_lines(p.metrics())
            ]
            events = parse_events(read_lines(joiner))
            on_step = on_swarm_step(events, swarm)
            if on_step is not None:
                out["on_swarm_step_s"] = round(on_step - t0, 2)
            if on_step is not None and out.get("download"):
                out["on_step_x"] = on_step_x(events, on_step, plan.rate_mbit, out["download"]["bytes"])
            if plan.catchup and out.get("download"):
                bound = replay_bound(events, swarm, plan.rate_mbit, out["download"]["bytes"])
                out["replay_bound"] = bound
                if out.get("caught_up_s") is not None and bound:
                    out["caught_up_x"] = round(out["caught_up_s"] / bound["download_s_at_link"], 2)
            out["joiner_link"] = link_figures(
                trace, out.get("download"), plan.rate_mbit, t0, out.get("attempts", [])
            )
        except (TimeoutError, RuntimeError, OSError) as e:
            out |= {"status": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            out["exit_codes_after_sigterm"] = {p.name: p.stop(grace=30.0) for p in procs}
    out["seconds"] = round(time.perf_counter() - began, 1)
    out["peak_rss_bytes"] = {p.name: watch.hwm.get(p.proc.pid) for p in procs}  # VmHWM, sampled
    if watch.low_memory is not None:
        low = watch.low_memory[1] / 2**30
        out |= {"status": "aborted", "reason": f"nodes killed: MemAvailable fell to {low:.1f} GiB"}
    out["commands"] = [shown(p.argv) for p in procs]
    out["evidence"] = {p.name: log_evidence(p.folder) for p in procs}
    out["serving_log_lines"] = {p.name: count_serving(p) for p in procs if p.name != "joiner"}
    return out


def read_lines(p: Proc) -> list[str]:
    try:
        return (p.folder / "node.log").read_text(errors="replace").splitlines()
    except OSError:
        return []


SERVING = re.compile(r"serving step \d+'s state|took a snapshot of step \d+ to serve")


def count_serving(p: Proc) -> int:
    """This donor's log lines about serving its state: one per download served ("serving step N's state",
    whole-state streams) or one per snapshot taken to serve ("took a snapshot of step N to serve", chunked
    downloads, which log no line per download)."""
    n = 0
    for line in read_lines(p):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if SERVING.search(str(json.loads(line)["message"])):
                n += 1
    return n


def watch_joiner(plan: Plan, joiner: Proc, t0: float, alive: list[Proc]) -> dict[str, Any]:
    """Poll the joiner until its first contribution, a timeout, too many failed downloads, or an exit."""
    deadline = time.monotonic() + plan.timeout
    status, reason, contributed = "failed", None, None
    while True:
        events = parse_events(read_lines(joiner))
        contributed = first_contribution(read_jsonl(joiner.metrics_file))
        if contributed is not None:
            status = "ok"
            break
        failures = sum(1 for e in events if e.kind == "failed")
        if failures >= plan.max_failures:
            reason = f"{failures} failed downloads: {failure_reason(events)}"
            break
        dead = next((p for p in alive if p.proc.poll() is not None), None)
        if dead is not None:
            reason = f"{dead.name} exited ({dead.proc.returncode}): {dead.log_tail(600)}"
            break
        if time.monotonic() > deadline:
            why = failure_reason(events) or "none"
            reason = f"no contribution within {plan.timeout:g} s; last failures: {why}"
            break
        time.sleep(0.5)
    events = parse_events(read_lines(joiner))
    tries = attempts(events)
    out: dict[str, Any] = {"status": status}
    if reason:
        out["reason"] = reason
    first = {kind: next((e.t - t0 for e in events if e.kind == kind), None) for kind in PATTERNS}
    out["timeline_s"] = {k: round(v, 2) for k, v in first.items() if v is not None and k != "progress"}
    out["attempts"] = [
        {
            k: (round(v - t0, 2) if k in ("start", "transfer_start", "end", "t25", "t100") else v)
            for k, v in a.items()
        }
        for a in tries
    ]
    index = next((i for i, a in enumerate(tries) if a["outcome"] == "downloaded"), None)
    if index is not None:
        ok, before = tries[index], tries[:index]
        first_start = before[0]["start"] if before else None
        out["download"] = download_figures(ok, plan.rate_mbit, first_start) | {
            "failed_attempts_before": len(before),
            "window_s": [round((first_start or ok["transfer_start"]) - t0, 2), round(ok["end"] - t0, 2)],
            "step": ok["step"],
            "donor": ok.get("donor"),
            "donors_used": ok.get("donors_used", 1 if ok.get("donor") else None),
        }
    out["failed_downloads"] = sum(1 for e in events if e.kind == "failed")
    if contributed is not None:
        last = contributed["rounds"]["last"]
        out["first_contribution_s"] = round(contributed["time"] - t0, 2)
        out["first_contribution"] = {"step": contributed["step"], **last}
    out |= catchup_figures(events, contributed["time"] if contributed is not None else None)
    return out


def on_swarm_step(events: list[Event], swarm: list[tuple[float, int]]) -> float | None:
    """When the joiner first landed (a download or a replay) on the step the donors were on then
    (``swarm``: the donors' (time, step) lines); None if it never did."""
    for e in events:
        if e.kind != "applied":
            continue
        now = max((step for t, step in swarm if t <= e.t), default=0)
        if int(e.groups[0]) >= now:
            return e.t
    return None


def on_step_x(events: list[Event], on_step: float, rate_mbit: float, state_bytes: int) -> float | None:
    """The time from the joiner's first "catching up" line to its first landing on the swarm's step
    (``on_step``), in downloads of ``state_bytes`` at the link rate; None without a "catching up"."""
    start = next((e.t for e in events if e.kind == "catching_up"), None)
    if start is None or state_bytes <= 0:
        return None
    return round((on_step - start) / (state_bytes * 8 / (rate_mbit * 1e6)), 2)


REPLAY_BYTES = re.compile(r"replayed (\d+) step\(s\) from step \d+ \(([\d.]+) MB")


def replay_bound(
    events: list[Event], swarm: list[tuple[float, int]], rate_mbit: float, state_bytes: int
) -> dict[str, Any]:
    """The least time any catch-up by one download and replays can take, in downloads at the link rate:
    the joiner must receive the state (``state_bytes``: D seconds at the link rate) and one step's result
    (R bytes) for every step the swarm takes meanwhile (one per T seconds), so its time C satisfies
    ``C >= D + (C / T) R / rate``, i.e. ``C / D >= 1 / (1 - R / (rate T))`` (no bound at all once a
    step's result takes longer to fetch than the swarm takes to make it). R: the bytes per step of the
    joiner's replays; T: the median interval between the donors' successive steps. Empty without a
    replay or three donor steps."""
    per_step = [
        float(m.group(2)) * 1e6 / int(m.group(1))
        for e in events
        if e.kind == "applied" and (m := REPLAY_BYTES.search(e.message)) and int(m.group(1)) > 0
    ]
    start = next((e.t for e in events if e.kind == "catching_up"), None)
    landed = [e.t for e in events if e.kind == "applied"]
    if not per_step or start is None or not landed:
        return {}
    reached: dict[int, float] = {}
    for t, step in sorted(swarm):
        reached.setdefault(step, t)
    times = sorted(t for step, t in reached.items() if step >= 1)  # (step 0: the start, not a step)
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    if not gaps:
        return {}
    step_s = gaps[len(gaps) // 2]
    result_s = statistics.median(per_step) * 8 / (rate_mbit * 1e6)
    out: dict[str, Any] = {
        "result_mb_per_step": round(statistics.median(per_step) / 1e6, 1),
        "result_s_at_link": round(result_s, 2),
        "swarm_step_s": round(step_s, 1),
        "download_s_at_link": round(state_bytes * 8 / (rate_mbit * 1e6), 1),
    }
    out["bound_x"] = round(1 / (1 - result_s / step_s), 2) if result_s < step_s else math.inf
    return out


def catchup_figures(events: list[Event], contributed_at: float | None) -> dict[str, Any]:
    """Downloads and replayed steps until the first contribution (all of them if none), and the time
    from the first "catching up" line to the last "now on step" line before it (``caught_up_s``)."""
    until = contributed_at if contributed_at is not None else math.inf
    before = [e for e in events if e.t <= until]
    out: dict[str, Any] = {
        "downloads": sum(1 for e in before if e.kind == "downloaded"),
        "replayed_steps": sum(int(e.groups[0]) for e in before if e.kind == "replayed"),
    }
    start = next((e.t for e in before if e.kind == "catching_up"), None)
    landed = [e.t for e in before if e.kind == "applied"]
    if start is not None and landed and contributed_at is not None:
        out["caught_up_s"] = round(landed[-1] - start, 2)
    return out


def link_figures(
    trace: list[tuple[float, int]],
    download: dict[str, Any] | None,
    rate_mbit: float,
    t0: float,
    tries: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """What the joiner's link received (headers included): in all, in the download window, and in each
    catch-up attempt (times relative to ``t0``, as in the report's ``attempts``)."""
    if len(trace) < 2:
        return {}
    out: dict[str, Any] = {"received_bytes": trace[-1][1] - trace[0][1]}
    per = []
    for a in tries:
        if a.get("end") is None or a["end"] <= a["start"]:
            continue
        got = interpolate(trace, t0 + a["end"]) - interpolate(trace, t0 + a["start"])
        mbit = got * 8 / (a["end"] - a["start"]) / 1e6
        per.append({"outcome": a["outcome"], "seconds": round(a["end"] - a["start"], 2), "bytes": round(got)})
        per[-1] |= {"mbit": round(mbit, 2), "fraction_of_link": round(mbit / rate_mbit, 3)}
    if per:
        out["per_attempt"] = per
    if download:
        a, b = (t0 + x for x in download["window_s"])
        got = interpolate(trace, b) - interpolate(trace, a)
        if b > a:
            mbit = got * 8 / (b - a) / 1e6
            out |= {"window_bytes": round(got), "window_mbit": round(mbit, 2)}
            out["window_fraction_of_link"] = round(mbit / rate_mbit, 3)
    return out


# ---- the report ------------------------------------------------------------------------------------------


def format_table(report: dict[str, Any]) -> str:
    head = ["donors", "size", "MB down", "download s", "Mbit/s", "of link", "target", "first contribution s"]
    head += ["downloads", "replayed", "on step s", "caught up s", "x download: on step, caught up (least)"]
    head += ["status", "s"]
    lines = [head]
    for r in report["results"]:
        d = r.get("download") or {}
        target = f">= {100 * TARGET_FRACTION:g}%" if r["donors"] == 1 or r.get("catchup") else "-"
        frac = d.get("fraction_of_link")
        lines.append(
            [
                str(r["donors"]),
                r["size"],
                f"{d['bytes'] / 1e6:.0f}" if d else "-",
                f"{d['seconds']:.1f}" if d else "-",
                f"{d['rate_mbit']:.1f}" if d.get("rate_mbit") else "-",
                f"{100 * frac:.0f}%" if frac is not None else "-",
                target,
                f"{r['first_contribution_s']:.1f}" if r.get("first_contribution_s") is not None else "-",
                str(r.get("downloads", "-")),
                str(r.get("replayed_steps", "-")),
                f"{r['on_swarm_step_s']:.1f}" if r.get("on_swarm_step_s") is not None else "-",
                f"{r['caught_up_s']:.1f}" if r.get("caught_up_s") is not None else "-",
                (f"{r['on_step_x']}, " if r.get("on_step_x") is not None else "-, ")
                + (f"{r['caught_up_x']}" if r.get("caught_up_x") is not None else "-")
                + (
                    f" (>= {r['replay_bound']['bound_x']})"
                    if (r.get("replay_bound") or {}).get("bound_x")
                    else ""
                ),
                r.get("status", "?")
                + (f": {r.get('reason') or r.get('error')}"[:160] if r.get("status") != "ok" else ""),
                f"{r.get('seconds', 0):.0f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(f"emulation: {report['emulation']}; node folders: {report['workdir']}")
    text.append(f"reproduce: {report['command']}")
    return "\n".join(text)


def met(r: dict[str, Any], catchup: bool = False) -> bool | None:
    """One donor: the download reached the target fraction of the link; other donor counts: reported.
    ``catchup`` (any donor count: the swarm must move on without the joiner, which takes two donors):
    the fraction of the joiner's link, one download only, and on the swarm's step within CATCHUP_TARGET
    times the download's time at the link rate."""
    d = r.get("download") or {}
    if r["donors"] != 1 and not catchup:
        return None
    if not d:  # no download: the joiner failed to get one (a miss), or the run broke (no verdict)
        return False if r.get("status") == "failed" else None
    frac = d.get("fraction_of_link")
    ok = frac is not None and frac >= TARGET_FRACTION
    if catchup:
        at_link = d["bytes"] * 8 / (r["rate_mbit"] * 1e6)
        caught = r.get("caught_up_s")
        ok = ok and r.get("downloads") == 1 and caught is not None and caught <= CATCHUP_TARGET * at_link
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--donors", type=parse_list, help="comma list of donor counts (default 1,3)")
    parser.add_argument("--size", help="model size (default 124m; --quick: 10m); see bench_scale")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="every link, each way (default 100)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the joiner (default 900)")
    parser.add_argument("--userspace", action="store_true", help="the userspace WAN switch, not namespaces")
    parser.add_argument(
        "--max-failures", type=int, default=4, help="give up after this many failed downloads"
    )
    parser.add_argument("--round-samples", type=int, help="the donors' target batch (default: from the link)")
    parser.add_argument("--quick", action="store_true", help="--size 10m --donors 1: a smoke run")
    parser.add_argument(
        "--catchup",
        action="store_true",
        help="rounds shorter than the download: the swarm moves on meanwhile",
    )
    parser.add_argument(
        "--json", default=DEFAULT_JSON, metavar="PATH", help=f"report (default {DEFAULT_JSON}; -: stdout)"
    )
    parser.add_argument("--workdir", metavar="DIR", help="node folders go here (default: a new temp folder)")
    args = parser.parse_args(argv)
    try:
        size, shape = parse_size(args.size or ("10m" if args.quick else "124m"))
        donors = tuple(int(x) for x in (args.donors or (("1",) if args.quick else ("1", "3"))))
    except ValueError as e:
        parser.error(str(e))
    if any(not 1 <= d <= 8 for d in donors):
        parser.error("--donors: 1 to 8 each")
    if args.rate_mbit <= 0:
        parser.error("--rate-mbit must be positive")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-statesync-"))
    plan = Plan(
        donors=donors,
        size=size,
        shape=shape,
        rate_mbit=args.rate_mbit,
        timeout=args.timeout,
        userspace=args.userspace,
        max_failures=args.max_failures,
        round_samples=args.round_samples,
        workdir=workdir.resolve(),
        quick=args.quick,
        catchup=args.catchup,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: nodes killed, lab deleted
    emulation = "userspace" if args.userspace or unavailable() else "netns"
    json_path = (
        None
        if args.json == "-"
        else str(REPO_ROOT / DEFAULT_JSON if args.json == DEFAULT_JSON else args.json)
    )
    report: dict[str, Any] = {
        "benchmark": "state-sync",
        "command": plan.command(),
        "quick": plan.quick,
        "environment": base_environment(("p2ptrain", "torch", "numpy", "trio")),
        "workdir": str(plan.workdir),
        "emulation": emulation + ("" if emulation == "netns" or args.userspace else f" ({unavailable()})"),
        "target": f"download >= {100 * TARGET_FRACTION:g}% of the link rate from one donor"
        + (
            f"; one download, on the swarm's step within {CATCHUP_TARGET:g}x its time at the link rate"
            if plan.catchup
            else ""
        ),
        "load_before": loadavg(),
        "results": [],
    }
    began = time.perf_counter()
    try:
        for d in plan.donors:
            print(f"running {size} with {d} donor(s) ...", file=sys.stderr, flush=True)
            try:
                r = run_donors(plan, d)
            except Exception as e:  # one run failing must not hide the others' numbers
                r = {"donors": d, "size": size, "status": "error", "error": f"{type(e).__name__}: {e}"}
            finally:
                kill_all()
            r["met"] = met(r, plan.catchup)
            report["results"].append(r)
            save_partial(report, json_path)
    finally:
        kill_all()
    report["load_after"] = loadavg()
    report["total_s"] = round(time.perf_counter() - began, 1)
    report.pop("partial", None)
    write_report(report, json_path, format_table(report))
    return 0 if all(r.get("status") == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
