"""Scale benchmark: memory of real ``p2ptrain node`` processes training the built-in GPT at 124M and 350M.

For each size (``--sizes``) and mode (``--modes``), ``--peers`` nodes (2 by default) train the built-in
``tiny-gpt`` task, shaped by ``[task.options]`` (``n_layer``, ``n_head``, ``n_embd``, ``block_size``), on
loopback, for ``--max-steps`` global steps, with one sample per batch and a short context, so that a CPU
step takes seconds. Each node is its own process; the harness measures

* its **peak RSS**: the kernel's own high-water mark, ``ru_maxrss`` of the process as ``wait4()`` returns
  it when the harness reaps it (the same figure as ``VmHWM`` in ``/proc/PID/status``, but it also covers
  the last moments before exit: the final checkpoint), cross-checked against ``VmHWM`` sampled every
  0.1 s while it runs;
* the **footprint before the model exists**, subtracted from the peak: the peak RSS of a Python process
  (same interpreter, same ``OMP_NUM_THREADS=1``) that imports the modules a node imports (torch,
  p2ptrain's CLI, node, trainer), loads the task with the same options (the corpus), and runs one
  forward/backward and AdamW step of a 1-layer, 8-wide GPT, so that the kernels' libraries and their
  buffers are loaded: everything a node holds apart from its model and what scales with it. (No log line
  comes between a node's imports and its model: ``train_node`` builds the model before the node prints
  anything, hence a separate process.) It also reports the node's RSS when it printed its address (the
  model and its optimizer built, nothing trained yet);
* the **multiple**: (peak - footprint) / (4 x parameters), the peak over the fp32 bytes of the model.
  Targets from the issue: at most 6x in sync mode (AdamW), 7x in DiLoCo mode;
* the **round times** from the nodes' metrics files (``rounds.last.seconds`` of every averaged step) and
  the bytes each peer sent per global step; with ``--rate-mbit R`` (root: network namespaces, every link
  shaped with ``tc tbf``), the link bound of a butterfly all-reduce, 2 (N-1)/N x S x 8 / R with S the
  parameters in the wire's element size, and the round time's fraction of it. On loopback there is no
  link bound (reported as such).

Where the peak comes from: each node's largest sampled RSS per phase of its life (up to its first global
step, between steps, up to its "stopped" metrics line, which the trainer writes after its final
checkpoint, and after it: the shutdown), and
how each of its steps went (averaged, alone, synced: a node that downloads or serves the state holds that
state's bytes too, which the multiple then includes).

The machine is shared: a configuration starts only if MemAvailable covers ``peers x (footprint + 8 x
fp32)`` (a run that meets its target fits; ``--force`` skips the check), and a watchdog kills the nodes
if MemAvailable falls below 1.5 GiB. Such a run is reported ``aborted``, its peaks as lower bounds.

Run files mirror the shipped ones (``configs/tiny-gpt.toml`` for sync: AdamW, no compression;
``configs/tiny-gpt-diloco.toml`` for DiLoCo: fp16 pseudo-gradients, overlap on), with evaluation and
periodic checkpoints off (the final checkpoint a clean stop writes stays: it is part of a node's life).

Usage::

    python -m simulations.bench_scale [--sizes 124m,350m] [--modes sync,diloco] [--peers 2]
        [--max-steps 2] [--rate-mbit R] [--timeout 1200] [--force] [--quick] [--json PATH] [--workdir DIR]

Sizes: ``124m`` and ``350m`` are the shapes of ``configs/gpt2-124m.toml`` (25 layers x 640, 123.3M
parameters) and ``configs/gpt2-medium.toml`` (GPT-2 medium's 24 x 1024: 302.6M with the byte-level
vocabulary of 256, GPT-2's 355M less its 50,257-token embedding); also ``86m`` (``gpt2-small.toml``),
``10m`` (a smoke size) or ``LAYERSxHEADSxWIDTH`` (``12x12x768``). The context is 64 bytes, not the run
files' 1,024, so that a CPU step takes seconds: activations are small, the model's state dominates.
``--quick``: ``10m`` only, a smoke run. The JSON report goes to PATH (default
``simulations/results/scale.json``; ``-``: stdout), a table to stderr. Every node runs in a process
group of its own, every wait is bounded, everything the benchmark started is killed at the end; node
folders (logs, metrics) are kept under the work directory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment
from simulations.benchmarks.training_runs import (
    LOOPBACK,
    Proc,
    kill_all,
    loadavg,
    log_evidence,
    node_argv,
    read_jsonl,
    shown,
    step_lines,
    stopped_line,
    write_run_file,
)
from simulations.labs.netns import NetnsLab, unavailable

MODULE = "simulations.bench_scale"
DEFAULT_JSON = "simulations/results/scale.json"
# (n_layer, n_head, n_embd): the shapes of the shipped run files, with the byte-level vocabulary (256).
SIZES: dict[str, tuple[int, int, int]] = {
    "10m": (6, 6, 384),  # a smoke size
    "86m": (12, 12, 768),  # configs/gpt2-small.toml: GPT-2 small's shape, 85.3M at a 64-byte context
    "124m": (25, 10, 640),  # configs/gpt2-124m.toml: 123.3M
    "350m": (
        24,
        16,
        1024,
    ),  # configs/gpt2-medium.toml: GPT-2 medium's shape (355M with its vocabulary), 302.6M
}
MODES = ("sync", "diloco")
TARGETS = {"sync": 6.0, "diloco": 7.0}  # peak RSS over fp32 parameter bytes, from the issue
BLOCK_SIZE = 64  # bytes of context: a CPU step of the 350M model in seconds
BATCH_SIZE = 1
MAX_BYTES = 1_000_000  # training text: the corpus is part of the footprint, keep it small
SAMPLE_EVERY = 0.1  # seconds between /proc samples
SERIES_POINTS = 120  # RSS samples kept per node in the report (downsampled)
MIN_AVAILABLE = 1.5 * 2**30  # bytes: below this MemAvailable the nodes are killed (the machine is shared)
PLAN_MULTIPLE = 8.0  # a configuration starts only if MemAvailable covers peers x (footprint + this x fp32)
WIRE_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}  # bytes per value on the wire (int8: + scales)

# The footprint of a node before its model exists (see the module docstring); prints one JSON line.
BASELINE = r"""
import json, os, sys
import torch
import p2ptrain.cli, p2ptrain.cli.train, p2ptrain.node, p2ptrain.training.loop.trainer  # what a node imports
from p2ptrain.tasks import load_task
from p2ptrain.tasks.gpt import GPT, GPTConfig

torch.set_num_threads(1)
task = load_task("tiny-gpt", json.loads(sys.argv[1]))
model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))
opt = torch.optim.AdamW(model.parameters())
x = torch.zeros(1, 8, dtype=torch.long)
torch.nn.functional.cross_entropy(model(x).view(-1, 256), x.view(-1)).backward()
opt.step()
fields = {}
for line in open(f"/proc/{os.getpid()}/status"):
    key, _, value = line.partition(":")
    if key in ("VmRSS", "VmHWM"):
        fields[key] = int(value.split()[0]) * 1024
print(json.dumps({"rss_bytes": fields["VmRSS"], "hwm_bytes": fields["VmHWM"], "torch": torch.__version__}))
"""


# ---- pure helpers --------------------------------------------------------------------------------------


def parse_size(text: str) -> tuple[str, tuple[int, int, int]]:
    """``124m`` (a name in SIZES) or ``LxHxE``: (label, (n_layer, n_head, n_embd)). ValueError if neither."""
    t = text.strip().lower()
    if t in SIZES:
        return t, SIZES[t]
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", t)
    if not m:
        raise ValueError(f"size {text!r}: one of {', '.join(SIZES)} or LAYERSxHEADSxWIDTH (12x12x768)")
    layers, heads, width = (int(g) for g in m.groups())
    if min(layers, heads, width) < 1 or width % heads:
        raise ValueError(f"size {text!r}: positive numbers, the width divisible by the heads")
    return t, (layers, heads, width)


def parameter_count(shape: tuple[int, int, int], block_size: int = BLOCK_SIZE, vocab: int = 256) -> int:
    """GPTConfig.num_parameters() of this shape (tied head, learned positions), without importing torch."""
    layers, _, c = shape
    return vocab * c + block_size * c + layers * (12 * c * c + 13 * c) + 2 * c


def rss_multiple(peak_bytes: int, baseline_bytes: int, parameters: int) -> float:
    """(peak - footprint before the model) over the model's fp32 bytes (4 per parameter)."""
    if parameters <= 0:
        raise ValueError("parameters must be positive")
    return (peak_bytes - baseline_bytes) / (4 * parameters)


def parse_proc_status(text: str) -> dict[str, int]:
    """The ``kB`` fields of /proc/PID/status (VmRSS, VmHWM, ...) in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        words = value.split()
        if len(words) == 2 and words[1] == "kB" and words[0].isdigit():
            out[key.strip()] = int(words[0]) * 1024
    return out


def link_bound_s(parameters: int, peers: int, rate_mbit: float, element_bytes: int) -> float:
    """The shortest butterfly all-reduce of ``parameters`` values of ``element_bytes`` each among ``peers``
    on links of ``rate_mbit`` (each direction): every peer sends and receives 2 (N-1)/N of the vector."""
    if peers < 2 or rate_mbit <= 0:
        raise ValueError("a bound needs 2+ peers and a rate")
    return 2 * (peers - 1) / peers * parameters * element_bytes * 8 / (rate_mbit * 1e6)


def downsample(series: Sequence[tuple[float, int]], points: int = SERIES_POINTS) -> list[tuple[float, int]]:
    """At most ``points`` samples, evenly spaced in the list, the largest sample always kept."""
    if len(series) <= points:
        return list(series)
    step = len(series) / points
    keep = {int(i * step) for i in range(points)} | {len(series) - 1}
    keep.add(max(range(len(series)), key=lambda i: series[i][1]))
    return [series[i] for i in sorted(keep)]


def phase_peaks(
    series: Sequence[tuple[float, int]], step_times: Sequence[float], stopped_at: float | None
) -> list[dict[str, Any]]:
    """The largest sampled RSS in each phase of a node's life: up to its first global step, between
    steps, from its last step to its "stopped" line (written after the final checkpoint), and after it."""
    marks = [*step_times] + ([stopped_at] if stopped_at is not None else [])
    names = [f"to step {i + 1}" for i in range(len(step_times))]
    names += ["to the stopped line"] if stopped_at is not None else []
    out, lo = [], -1.0
    for name, hi in [*zip(names, marks, strict=True), ("to the exit", float("inf"))]:
        got = [rss for t, rss in series if lo < t <= hi]
        if got:
            out.append(
                {"phase": name, "until_s": None if hi == float("inf") else hi, "rss_max_bytes": max(got)}
            )
        lo = hi
    return out


def mem_available(text: str | None = None) -> int | None:
    """MemAvailable from /proc/meminfo (or ``text``), bytes."""
    if text is None:
        try:
            text = Path("/proc/meminfo").read_text()
        except OSError:
            return None
    return parse_proc_status(text).get("MemAvailable")


def round_summary(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per global step of one node: its outcome, the round's seconds, group, and the MB it sent since the
    previous step (metrics ``bytes_sent``; averaging and control traffic together)."""
    out, prev = [], None
    for m in lines:
        last = m.get("rounds", {}).get("last") or {}
        sent = m.get("bytes_sent")
        mb: float | None = (
            round((sent - prev) / 1e6, 1) if isinstance(sent, int) and isinstance(prev, int) else None
        )
        out.append(
            {
                "step": m.get("step"),
                "outcome": last.get("outcome"),
                "seconds": last.get("seconds"),
                "group": last.get("group"),
                "sent_mb": mb,
            }
        )
        prev = sent
    return out


# ---- processes and their memory -------------------------------------------------------------------------


class MemoryWatch:
    """Samples VmRSS and VmHWM of some processes every SAMPLE_EVERY seconds, in a thread, until closed."""

    def __init__(self) -> None:
        self.series: dict[int, list[tuple[float, int]]] = {}
        self.hwm: dict[int, int] = {}
        self._pids: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.low_memory: tuple[float, int] | None = None  # (time, MemAvailable) when the nodes were killed
        self.min_available: int | None = None

    def add(self, pid: int, started: float) -> None:
        with self._lock:
            self._pids.append((pid, started))
            self.series[pid] = []

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pids = list(self._pids)
            for pid, started in pids:
                try:
                    fields = parse_proc_status(Path(f"/proc/{pid}/status").read_text())
                except OSError:
                    continue
                if "VmRSS" in fields:
                    self.series[pid].append((round(time.time() - started, 2), fields["VmRSS"]))
                if "VmHWM" in fields:
                    self.hwm[pid] = max(self.hwm.get(pid, 0), fields["VmHWM"])
            self._guard([pid for pid, _ in pids])
            self._stop.wait(SAMPLE_EVERY)

    def _guard(self, pids: list[int]) -> None:
        """Kill the nodes (their process groups) if the machine runs low on memory: others share it."""
        avail = mem_available()
        if avail is None:
            return
        self.min_available = avail if self.min_available is None else min(self.min_available, avail)
        if avail < MIN_AVAILABLE and self.low_memory is None:
            self.low_memory = (time.time(), avail)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def rss_at(self, pid: int, t: float) -> int | None:
        """The first RSS sample at or after ``t`` seconds since the process started."""
        return next((rss for s, rss in self.series.get(pid, []) if s >= t), None)


@dataclass
class Reaped:
    code: int | None  # None: still running (not reaped)
    maxrss_bytes: int | None  # ru_maxrss of the process (the kernel's peak RSS), once reaped


def try_reap(proc: Proc) -> Reaped:
    """Reap ``proc`` if it exited, with its rusage (``os.wait4``); Popen is told its exit status."""
    p = proc.proc
    if p.returncode is not None:
        return Reaped(p.returncode, None)
    try:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
    except ChildProcessError:
        return Reaped(p.poll(), None)
    if pid == 0:
        return Reaped(None, None)
    p.returncode = os.waitstatus_to_exitcode(status)
    return Reaped(p.returncode, usage.ru_maxrss * 1024)  # Linux: kilobytes


def reap_all(procs: Sequence[Proc], timeout: float, grace: float = 60.0) -> dict[str, Reaped]:
    """Wait until every process exited (reaping each with its rusage) or ``timeout``; then SIGTERM the
    rest (a node drains and checkpoints), wait ``grace``, SIGKILL their groups. {name: Reaped}."""
    got: dict[str, Reaped] = {}
    phases = [(timeout, None), (grace, signal.SIGTERM), (10.0, signal.SIGKILL)]
    for seconds, sig in phases:
        for p in procs:
            if p.name not in got and sig is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if sig == signal.SIGKILL:
                        os.killpg(p.proc.pid, sig)
                    else:
                        p.proc.send_signal(sig)
        deadline = time.monotonic() + seconds
        while True:
            for p in procs:
                if p.name not in got:
                    r = try_reap(p)
                    if r.code is not None:
                        got[p.name] = r
            if len(got) == len(procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if len(got) == len(procs):
            break
    for p in procs:
        p.kill()  # what a node left in its group; closes the log files
        got.setdefault(p.name, Reaped(p.proc.returncode, None))
    return got


def measure_baseline(options: dict[str, Any]) -> dict[str, Any]:
    """The footprint of a node-like process before any model (see BASELINE)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", BASELINE, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"baseline process failed: {done.stderr[-500:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ---- one configuration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    sizes: tuple[str, ...]
    modes: tuple[str, ...]
    peers: int
    max_steps: int
    rate_mbit: float  # 0: loopback
    timeout: float
    workdir: Path
    quick: bool

    def command(self, size: str | None = None, mode: str | None = None) -> str:
        words = [f"python -m {MODULE}"]
        words += ["--sizes", size or ",".join(self.sizes), "--modes", mode or ",".join(self.modes)]
        words += ["--peers", str(self.peers), "--max-steps", str(self.max_steps)]
        words += ["--rate-mbit", f"{self.rate_mbit:g}"] if self.rate_mbit else []
        return " ".join(words)


def run_sections(label: str, shape: tuple[int, int, int], mode: str, peers: int) -> dict[str, dict[str, Any]]:
    layers, heads, width = shape
    options = {"n_layer": layers, "n_head": heads, "n_embd": width, "block_size": BLOCK_SIZE}
    options["max_bytes"] = MAX_BYTES
    # sync: every peer's batch is one sample, a step averages one batch of each peer. DiLoCo: each peer
    # takes about two inner steps per round (a short round, so that a few happen soon).
    target = peers * BATCH_SIZE * (1 if mode == "sync" else 2)
    training = {"mode": mode, "batch_size": BATCH_SIZE, "target_batch_size": target, "lr": 1e-4}
    training |= {"warmup_steps": 0, "threads": 1}
    sections: dict[str, dict[str, Any]] = {
        "run": {"id": f"bench-scale-{label}-{mode}", "seed": 1},
        "task": {"name": "tiny-gpt"},
        "task.options": options,
        "training": training,
    }
    if mode == "diloco":  # configs/tiny-gpt-diloco.toml's settings
        sections["diloco"] = {"overlap": True}
        sections["averaging"] = {"timeout": 60.0, "compression": "fp16"}
    else:  # configs/tiny-gpt.toml's: AdamW, gradients averaged in fp32
        sections["averaging"] = {"timeout": 60.0, "compression": "none"}
    sections["checkpoint"] = {"every_steps": 0}
    sections["eval"] = {"every_steps": 0}
    return sections


def run_one(plan: Plan, label: str, shape: tuple[int, int, int], mode: str, baseline: int) -> dict[str, Any]:
    folder = plan.workdir / f"{label}-{mode}"
    sections = run_sections(label, shape, mode, plan.peers)
    config = folder / "run.toml"
    text = write_run_file(config, sections)
    params = parameter_count(shape)
    out: dict[str, Any] = {
        "size": label,
        "mode": mode,
        "peers": plan.peers,
        "shape": {"n_layer": shape[0], "n_head": shape[1], "n_embd": shape[2], "block_size": BLOCK_SIZE},
        "parameters": params,
        "fp32_bytes": 4 * params,
        "baseline_bytes": baseline,
        "run_file": text,
        "target": TARGETS[mode],
        "command": plan.command(label, mode),
        "workdir": str(folder),
    }
    procs: list[Proc] = []
    began = time.perf_counter()
    lab = NetnsLab(plan.peers, plan.rate_mbit, prefix="p2pscale") if plan.rate_mbit else None
    with contextlib.ExitStack() as stack:
        if lab is not None:
            stack.enter_context(lab)
        watch = stack.enter_context(MemoryWatch())
        try:
            join = None
            for i in range(plan.peers):
                host = lab.address(i) if lab else LOOPBACK
                argv = node_argv(
                    listen=f"{host}:0", folder=folder / f"node{i}", config=config, max_steps=plan.max_steps,
                    join=join, wait_peers=plan.peers,
                )  # fmt: skip
                p = Proc(f"node{i}", argv, folder / f"node{i}", lab=lab, index=i)
                procs.append(p)
                watch.add(p.proc.pid, p.started)
                if join is None:
                    join = p.address(timeout=600.0)  # the model is built before the address is printed
            reaped = reap_all(procs, plan.timeout)
        except (TimeoutError, RuntimeError, OSError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
            reaped = reap_all(procs, 0.0, grace=30.0)
    out["seconds"] = round(time.perf_counter() - began, 1)
    out["commands"] = [shown(p.argv) for p in procs]
    nodes = []
    for p in procs:
        pid = p.proc.pid
        r = reaped[p.name]
        sampled = watch.hwm.get(pid)
        peaks = [x for x in (r.maxrss_bytes, sampled) if x]
        peak = max(peaks) if peaks else None
        metrics = read_jsonl(p.metrics_file)
        lines = step_lines(metrics)
        stopped = stopped_line(metrics)
        up = address_time(p)
        stopped_at = round(stopped["time"] - p.started, 1) if stopped else None
        series = watch.series.get(pid, [])
        peak_at = max(series, key=lambda s: s[1])[0] if series else None
        node: dict[str, Any] = {
            "name": p.name,
            "exit_code": r.code,
            "peak_bytes": peak,
            "peak_source": "ru_maxrss (wait4)" if r.maxrss_bytes else "VmHWM sampled",
            "vmhwm_sampled_bytes": sampled,
            "ru_maxrss_bytes": r.maxrss_bytes,
            "multiple": round(rss_multiple(peak, baseline, params), 3) if peak else None,
            "multiple_without_subtracting": round(peak / (4 * params), 3) if peak else None,
            "rss_at_address_bytes": watch.rss_at(pid, up) if up is not None else None,
            "address_printed_s": up,
            "largest_rss_sample_at_s": peak_at,
            "steps": stopped["step"] if stopped else (lines[-1]["step"] if lines else 0),
            "rounds": round_summary(lines),
            "step_times_s": [round(m["time"] - p.started, 1) for m in lines],
            "stopped_at_s": stopped_at,
            "rss_max_by_phase": [
                {**ph, "multiple": round(rss_multiple(ph["rss_max_bytes"], baseline, params), 3)}
                for ph in phase_peaks(series, [round(m["time"] - p.started, 1) for m in lines], stopped_at)
            ],
            "rss_series": downsample(series),
            "evidence": log_evidence(p.folder),
        }
        if r.code:
            node["log_tail"] = p.log_tail(1200)
        nodes.append(node)
    out["nodes"] = nodes
    multiples = [n["multiple"] for n in nodes if n["multiple"] is not None]
    averaged = [
        r["seconds"] for n in nodes for r in n["rounds"] if r["outcome"] == "averaged" and r["seconds"]
    ]
    out["max_multiple"] = max(multiples) if len(multiples) == len(nodes) and nodes else None
    out["round_seconds"] = averaged
    out["round_seconds_median"] = round(statistics.median(averaged), 3) if averaged else None
    element = WIRE_BYTES[sections["averaging"]["compression"]]
    if plan.rate_mbit and plan.peers >= 2:
        bound = link_bound_s(params, plan.peers, plan.rate_mbit, element)
        out["link_bound_s"] = round(bound, 2)
        if averaged:
            out["fraction_of_link_bound"] = round(bound / statistics.median(averaged), 3)
    else:
        out["link_bound_s"] = None  # loopback: no link to bound the round
        if averaged:
            mb = 2 * (plan.peers - 1) / plan.peers * params * element / 1e6
            out["loopback_mb_per_s"] = round(mb / statistics.median(averaged), 1)
    out["min_mem_available_bytes"] = watch.min_available
    out["outcomes"] = {
        n["name"]: dict(collections.Counter(str(r["outcome"]) for r in n["rounds"])) for n in nodes
    }
    done = all(n["exit_code"] == 0 for n in nodes) and all(n["steps"] >= plan.max_steps for n in nodes)
    if watch.low_memory is not None:
        out["status"] = "aborted"
        low = watch.low_memory[1] / 2**30
        out["error"] = f"nodes killed: MemAvailable fell to {low:.1f} GiB; the peaks are lower bounds"
    elif out["max_multiple"] is None:
        out["status"] = "error"
    elif not done:
        out["status"] = "incomplete"  # the peaks are real, but the nodes did not finish their steps
    else:
        out["status"] = "ok"
    out["met"] = out["max_multiple"] <= TARGETS[mode] if out["status"] == "ok" else None
    return out


_UP = re.compile(r"is up in run")


def address_time(p: Proc) -> float | None:
    """Seconds from the start to the node printing its address (its model built), from its log."""
    with contextlib.suppress(OSError):
        for line in (p.folder / "node.log").read_text(errors="replace").splitlines():
            if _UP.search(line):
                try:  # --log-format json: a float time; text: HH:MM:SS (whole seconds)
                    return round(float(json.loads(line)["time"]) - p.started, 2)
                except (ValueError, KeyError, TypeError):
                    h, m, s = (int(x) for x in line[:8].split(":"))
                    t0 = time.localtime(p.started)
                    return float(3600 * (h - t0.tm_hour) + 60 * (m - t0.tm_min) + s - t0.tm_sec)
    return None


# ---- the report ----------------------------------------------------------------------------------------


def gb(x: Any) -> str:
    return f"{x / 2**30:.2f}" if isinstance(x, int | float) else "-"


def format_table(report: dict[str, Any]) -> str:
    head = ["size", "mode", "peers", "params", "peak GiB", "footprint GiB", "multiple", "target", "met"]
    head += ["round s", "bound s", "steps per node", "status", "s"]
    lines = [head]
    for r in report["results"]:
        peaks = [n["peak_bytes"] for n in r.get("nodes", []) if n.get("peak_bytes")]
        met = {True: "yes", False: "NO", None: "-"}[r.get("met")]
        lines.append(
            [
                r["size"],
                r["mode"],
                str(r["peers"]),
                f"{r['parameters'] / 1e6:.1f}M",
                "/".join(gb(p) for p in peaks) or "-",
                gb(r.get("baseline_bytes")),
                "/".join(f"{n['multiple']:.2f}" for n in r.get("nodes", []) if n.get("multiple") is not None)
                or "-",
                f"<= {r['target']:g}x",
                met,
                f"{r['round_seconds_median']:.1f}" if r.get("round_seconds_median") else "-",
                f"{r['link_bound_s']:.1f}" if r.get("link_bound_s") else "n/a",
                " / ".join(
                    ",".join(f"{k} {v}" for k, v in counts.items()) or "none"
                    for counts in r.get("outcomes", {}).values()
                )
                or "-",
                r["status"] + (f": {r['error']}" if r.get("error") else ""),
                f"{r.get('seconds', 0):.0f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(
        "multiple: (peak RSS - footprint before the model) / (4 x parameters), per node; footprint: "
        "peak RSS of a process with a node's imports, corpus and kernels but no model"
    )
    text.append(
        "steps per node: how each node's global steps went (averaged with the others, alone, synced: state "
        "downloaded); a node that downloaded or served a state holds that state's bytes too"
    )
    text.append(f"node folders: {report['workdir']}; reproduce: {report['command']}")
    return "\n".join(text)


def parse_list(text: str, allowed: Sequence[str] | None = None) -> tuple[str, ...]:
    items = tuple(s.strip().lower() for s in text.split(",") if s.strip())
    if not items:
        raise argparse.ArgumentTypeError("give at least one")
    if allowed is not None:
        bad = [s for s in items if s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_list, help="comma list (default 124m,350m; --quick: 10m)")
    parser.add_argument(
        "--modes", type=lambda t: parse_list(t, MODES), default=MODES, help="comma list (default both)"
    )
    parser.add_argument("--peers", type=int, default=2, help="nodes per run (default 2)")
    parser.add_argument("--max-steps", type=int, default=2, help="global steps per run (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="shape links (netns, root); 0: loopback")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default 1200)")
    parser.add_argument("--quick", action="store_true", help="the 10m model only: a smoke run")
    parser.add_argument("--force", action="store_true", help="run a configuration even if memory looks short")
    parser.add_argument(
        "--json", default=DEFAULT_JSON, metavar="PATH", help=f"report (default {DEFAULT_JSON}; -: stdout)"
    )
    parser.add_argument("--workdir", metavar="DIR", help="node folders go here (default: a new temp folder)")
    args = parser.parse_args(argv)
    sizes = args.sizes or (("10m",) if args.quick else ("124m", "350m"))
    try:
        shapes = [parse_size(s) for s in sizes]
    except ValueError as e:
        parser.error(str(e))
    if not 2 <= args.peers <= 8:
        parser.error("--peers: 2 to 8")
    if args.rate_mbit and unavailable():
        parser.error(f"--rate-mbit needs network namespaces: {unavailable()}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    plan = Plan(
        tuple(label for label, _ in shapes), args.modes, args.peers, args.max_steps, args.rate_mbit,
        args.timeout, workdir.resolve(), args.quick,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: nodes killed, lab deleted
    json_path = (
        None
        if args.json == "-"
        else str(REPO_ROOT / DEFAULT_JSON if args.json == DEFAULT_JSON else args.json)
    )
    report: dict[str, Any] = {
        "benchmark": "scale",
        "command": plan.command(),
        "quick": plan.quick,
        "environment": base_environment(("p2ptrain", "torch", "numpy", "trio")),
        "workdir": str(plan.workdir),
        "targets": {f"{m} (peak RSS / fp32 parameter bytes)": f"<= {TARGETS[m]:g}x" for m in MODES},
        "emulation": f"netns, {plan.rate_mbit:g} Mbit/s links (tc tbf)" if plan.rate_mbit else "loopback",
        "load_before": loadavg(),
        "results": [],
    }
    began = time.perf_counter()
    try:
        for label, shape in shapes:
            layers, heads, width = shape
            options = {"n_layer": layers, "n_head": heads, "n_embd": width, "block_size": BLOCK_SIZE}
            base = measure_baseline(options | {"max_bytes": MAX_BYTES})
            report.setdefault("baselines", {})[label] = base
            for mode in plan.modes:
                skipped = memory_short(plan, label, shape, mode, base["hwm_bytes"], args.force)
                if skipped is not None:
                    report["results"].append(skipped)
                    save_partial(report, json_path)
                    print(f"skipping {label} {mode}: {skipped['error']}", file=sys.stderr, flush=True)
                    continue
                print(f"running {label} {mode} ({plan.peers} peers) ...", file=sys.stderr, flush=True)
                try:
                    r = run_one(plan, label, shape, mode, base["hwm_bytes"])
                except Exception as e:  # one configuration failing must not hide the others' numbers
                    r = {
                        "size": label,
                        "mode": mode,
                        "peers": plan.peers,
                        "parameters": parameter_count(shape),
                    }
                    r |= {"target": TARGETS[mode], "status": "error", "error": f"{type(e).__name__}: {e}"}
                    r["met"] = None
                finally:
                    kill_all()
                report["results"].append(r)
                save_partial(report, json_path)
    finally:
        kill_all()
    report["load_after"] = loadavg()
    report["total_s"] = round(time.perf_counter() - began, 1)
    report["notes"] = notes(report)
    report.pop("partial", None)
    write_report(report, json_path, format_table(report))
    return 0 if all(r["status"] == "ok" for r in report["results"]) else 1


def save_partial(report: dict[str, Any], json_path: str | None) -> None:
    """The report so far, to ``json_path`` (atomically), marked partial: a run cut short keeps its numbers."""
    if json_path is None:
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**report, "partial": True}, indent=2) + "\n")
    tmp.replace(path)


def memory_short(
    plan: Plan, label: str, shape: tuple[int, int, int], mode: str, baseline: int, force: bool
) -> dict[str, Any] | None:
    """A "skipped" result when this machine's MemAvailable does not cover the configuration (None: run it)."""
    params = parameter_count(shape)
    need = plan.peers * (baseline + PLAN_MULTIPLE * 4 * params)
    avail = mem_available()
    if force or avail is None or avail >= need + MIN_AVAILABLE:
        return None
    why = (
        f"needs about {need / 2**30:.1f} GiB ({plan.peers} x (footprint + {PLAN_MULTIPLE:g} x fp32)), "
        f"MemAvailable is {avail / 2**30:.1f} GiB (--force runs it anyway; a guard kills the nodes below "
        f"{MIN_AVAILABLE / 2**30:g} GiB)"
    )
    r = {"size": label, "mode": mode, "peers": plan.peers, "parameters": params, "target": TARGETS[mode]}
    return r | {"status": "skipped", "error": why, "met": None, "command": plan.command(label, mode)}


def notes(report: dict[str, Any]) -> list[str]:
    out = [
        "Footprint subtracted (per size, 'baselines'): the peak RSS (VmHWM) of a Python process that imports "
        "torch and the modules a node imports, loads the task's corpus with the run's options, and runs one "
        "forward/backward/AdamW step of a 1-layer, 8-wide GPT (OMP_NUM_THREADS=1, as the nodes). A node "
        "builds its model before it logs anything, so no log line marks its own footprint.",
        "Peak: ru_maxrss from wait4() when the harness reaps the node (the kernel's high-water mark over the "
        "whole life, final checkpoint included), checked against VmHWM sampled every 0.1 s.",
    ]
    for r in report["results"]:
        for n in r.get("nodes", []):
            if n.get("exit_code"):
                out.append(
                    f"[{r['size']} {r['mode']}] {n['name']} exited {n['exit_code']}: {n.get('log_tail', '')}"
                )
    return out


if __name__ == "__main__":
    sys.exit(main())
