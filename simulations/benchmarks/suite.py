"""The benchmark suite: ``python -m simulations bench``.

Runs every benchmark through its own command line, as a subprocess (so that each is exactly what its
row's command reproduces), collects their JSON reports in ``simulations/results/``, and writes
``simulations/results/SUMMARY.md``: one table, one row per measured quantity, with the p2ptrain value,
hivemind's where the benchmark has a hivemind equivalent (transport, DHT, all-reduce run it side by side
when hivemind is installed: ``pip install -e .[bench]`` into ``.venv-bench``), the ratio, the target,
whether it was met, and the command that reproduces the row.

Benchmarks (``--only``, comma list; default all):

- ``transport``: ``python -m simulations.bench_transport`` -> ``transport.json``
- ``dht``: ``python -m simulations.bench_dht`` at 128 nodes beside hivemind (``dht-128.json``) and at
  256 and 1,024 nodes alone (``dht.json``)
- ``allreduce``: ``python -m simulations.bench_allreduce --scenario all`` -> ``allreduce.json``
- ``equivalence``, ``heterogeneity``, ``utilization``, ``late-joiner``: ``python -m
  simulations.bench_training --scenario ...`` -> their entries in ``training.json`` (entries of scenarios
  not run this time are kept)
- ``churn``: ``python -m simulations run churn`` -> ``churn.json`` and ``churn/`` (report, plots)
- ``wan``: ``python -m simulations run wan-continents`` in DiLoCo mode and again with ``--mode sync`` ->
  ``wan-continents.json``, ``wan-continents-sync.json`` and their folders
- ``hostile``: ``python -m simulations.bench_hostile --peers 4`` -> ``hostile.json`` (every attack and a
  no-attack run of ``hostile-4``), and in the full run ``--peers 8`` -> ``hostile-8.json``; one row per
  attack: the honest peers' validation loss against the no-attack run's, offender named, kept training
- ``scale``: ``python -m simulations.bench_scale`` -> ``scale.json``: peak RSS of 2 nodes over the fp32
  parameter bytes at 124M and 350M, sync and DiLoCo (``--quick``: the 10m model)
- ``state-sync``: ``python -m simulations.bench_statesync`` -> ``statesync.json``: a late joiner of the 124M
  model over 100 Mbit/s links from 1 and 3 donors (``--quick``: the 10m model, 1 donor)
- ``bytes-per-token``: ``python -m simulations.bench_bytes`` -> ``bytes-per-token.json`` and ``.png``: bytes
  sent per token and validation loss at equal tokens, sync fp32 against DiLoCo fp16/int8/top-k, 4 and 8
  peers (``--quick``: the tiny model, 4 peers)

``--quick`` shrinks everything (each benchmark's own ``--quick``; scenarios cut to 2 minutes) and writes
to ``simulations/results/quick/`` unless ``--results`` says otherwise, so that a smoke run never replaces
the full numbers. ``--table-only`` runs nothing and rebuilds the table from the JSON there is; a
benchmark whose JSON is missing shows as "not run". ``--readme FILE`` also puts the table into FILE
between ``<!-- simulations-bench:begin -->`` and ``<!-- simulations-bench:end -->``.

Every benchmark runs in a session of its own with a time limit; on a timeout or Ctrl-C its whole process
group is killed (each benchmark also cleans up its own children and namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulations.benchmarks.bytes_per_token import result_rows as bytes_rows
from simulations.benchmarks.nat_training import result_rows as nat_rows
from simulations.replay.scenario import REPO_ROOT

RESULTS = REPO_ROOT / "simulations" / "results"
TRAINING = ("equivalence", "heterogeneity", "utilization", "late-joiner")
NAMES = (
    *("transport", "dht", "allreduce", *TRAINING, "churn", "wan", "hostile", "scale", "state-sync"),
    "bytes-per-token",
)
BEGIN, END = "<!-- simulations-bench:begin -->", "<!-- simulations-bench:end -->"
QUICK_SCENARIO_S = 120.0


@dataclass(frozen=True)
class Step:
    name: str  # what --only selects
    argv: tuple[str, ...]  # after "python -m"
    timeout: float  # seconds
    after: Callable[[Path, Path], None] | None = None  # (results, temp folder) -> None: collect outputs

    @property
    def command(self) -> str:
        return "python -m " + " ".join(self.argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="shrink everything: a smoke run")
    p.add_argument("--only", help=f"comma list of {', '.join(NAMES)} (default all)")
    p.add_argument(
        "--results", help="results folder (default simulations/results, or .../quick with --quick)"
    )
    p.add_argument("--table-only", action="store_true", help="run nothing; rebuild SUMMARY.md")
    p.add_argument("--readme", metavar="FILE", help="also put the table into FILE between the markers")


def plan(quick: bool, only: tuple[str, ...], results: Path, tmp: Path) -> list[Step]:
    q = ("--quick",) if quick else ()
    steps: list[Step] = []
    rel = _rel(results)
    if "transport" in only:
        steps.append(
            Step("transport", ("simulations.bench_transport", *q, "--json", f"{rel}/transport.json"), 1800)
        )
    if "dht" in only:
        if quick:
            steps.append(Step("dht", ("simulations.bench_dht", "--quick", "--json", f"{rel}/dht.json"), 900))
        else:
            steps.append(
                Step(
                    "dht",
                    ("simulations.bench_dht", "-v", "--nodes", "128", "--json", f"{rel}/dht-128.json"),
                    3600,
                )
            )
            steps.append(
                Step(
                    "dht",
                    (
                        "simulations.bench_dht",
                        "-v",
                        "--nodes",
                        "256,1024",
                        "--hivemind-nodes",
                        "0",
                        "--json",
                        f"{rel}/dht.json",
                    ),
                    3600,
                )
            )
    if "allreduce" in only:
        argv = ("simulations.bench_allreduce", *q, "--scenario", "all", "--json", f"{rel}/allreduce.json")
        steps.append(Step("allreduce", argv, 3600))
    chosen = [t for t in TRAINING if t in only]
    if chosen:
        part = tmp / "training.json"
        argv = ("simulations.bench_training", "--scenario", ",".join(chosen), *q, "--json", str(part))
        steps.append(
            Step(",".join(chosen), argv, 7200, after=lambda r, t: merge_training(r / "training.json", part))
        )
    shorten = ("--duration", f"{QUICK_SCENARIO_S:g}") if quick else ()
    runs: list[tuple[str, str, tuple[str, ...]]] = []
    if "churn" in only:
        runs.append(("churn", "churn", ()))
    if "wan" in only:
        runs += [("wan", "wan-continents", ()), ("wan", "wan-continents-sync", ("--mode", "sync"))]
    if "hostile" in only:
        for peers in (4,) if quick else (4, 8):
            name = "hostile.json" if peers == 4 else f"hostile-{peers}.json"
            argv = ("simulations.bench_hostile", "--peers", str(peers), *q, "--json", f"{rel}/{name}")
            steps.append(Step("hostile", argv, 2400 if quick else 3600))
    if "scale" in only:
        steps.append(Step("scale", ("simulations.bench_scale", *q, "--json", f"{rel}/scale.json"), 5400))
    if "state-sync" in only:
        argv = ("simulations.bench_statesync", *q, "--json", f"{rel}/statesync.json")
        steps.append(Step("state-sync", argv, 1800 if quick else 3600))
    if "bytes-per-token" in only:
        argv = ("simulations.bench_bytes", *q, "--json", f"{rel}/bytes-per-token.json")
        steps.append(Step("bytes-per-token", argv, 1800 if quick else 8 * 3600))
    for name, label, extra in runs:
        scenario = "wan-continents" if label.startswith("wan") else label
        out, work = tmp / label, tmp / f"{label}-nodes"
        argv = (
            "simulations",
            "run",
            scenario,
            *extra,
            *shorten,
            "--out",
            str(out),
            "--workdir",
            str(work),
            "--quiet",
        )
        steps.append(Step(name, argv, 1800, after=_collect_scenario(label, out, argv)))
    return steps


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(REPO_ROOT))
    return str(path)


def _collect_scenario(label: str, out: Path, argv: tuple[str, ...]) -> Callable[[Path, Path], None]:
    def collect(results: Path, tmp: Path) -> None:
        summary_file = out / "summary.json"
        if not summary_file.exists():
            return
        summary = json.loads(summary_file.read_text())
        keep = [a for a in argv if a not in ("--quiet",)]
        i = keep.index("--out")
        summary["command"] = "python -m " + " ".join(keep[:i])
        folder = results / label
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for f in out.iterdir():  # the report and plots; the per-peer series stay in the work folder
            if f.suffix in (".md", ".png") or f.name in ("summary.json", "run.toml", "events.json"):
                shutil.copy2(f, folder / f.name)
        _write_json(results / f"{label}.json", summary)

    return collect


def merge_training(target: Path, part: Path) -> None:
    """This run's training scenarios replace their entries in training.json; the others are kept."""
    if not part.exists():
        return
    new = json.loads(part.read_text())
    try:
        old = json.loads(target.read_text())
    except (OSError, ValueError):
        old = {}
    ran = {r["scenario"] for r in new.get("results", [])}
    kept = [r for r in old.get("results", []) if r.get("scenario") not in ran]
    merged = {**new, "results": kept + new.get("results", [])}
    if kept:
        merged["command"] = "python -m simulations.bench_training --scenario " + ",".join(
            r["scenario"] for r in merged["results"]
        )
        merged["note"] = f"entries for {', '.join(sorted(ran))} from this run; the others from earlier runs"
    _write_json(target, merged)


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def run_step(step: Step, log: Path) -> dict[str, Any]:
    """Run one benchmark with a time limit; kill its whole session on a timeout or Ctrl-C."""
    began = time.monotonic()
    print(f"== {step.command}", flush=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", *step.argv],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(step.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                _stop(proc)
    seconds = round(time.monotonic() - began, 1)
    if code == 0:
        status = "ok"
    elif code is None:
        status = f"timed out after {step.timeout:g} s"
    elif code == 1 and step.argv[:2] == ("simulations", "run"):
        status = "ran; a check failed (see its row)"
    else:
        status = f"exit status {code}"
    print(f"   {status} after {seconds:g} s (log: {log})", flush=True)
    return {"benchmark": step.name, "command": step.command, "status": status, "seconds": seconds}


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the benchmark's session (they unwind: children killed, labs deleted), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def hivemind_available() -> str:
    python = REPO_ROOT / ".venv-bench" / "bin" / "python"
    if os.environ.get("P2PTRAIN_BENCH_PYTHON") or python.exists():
        return "installed (.venv-bench): the transport, DHT and all-reduce benchmarks run it side by side"
    return "not installed: hivemind columns come from earlier runs where their JSON has them"


# ---- the table -------------------------------------------------------------------------------------


def _load(results: Path, name: str) -> dict[str, Any] | None:
    try:
        data = json.loads((results / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if isinstance(v, float) and not math.isfinite(v):
            return "-"
        text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.3g}" if abs(v) < 10 else f"{v:,.1f}"
        return f"{text}%" if unit == "%" else f"{text} {unit}".strip()
    return str(v)


def _ratio(a: Any, b: Any) -> str:
    if isinstance(a, int | float) and isinstance(b, int | float) and b:
        return f"{a / b:.2f}x"
    return "-"


def row(
    bench: str, metric: str, p2p: Any, hm: Any, target: str, met: bool | None, command: str, unit: str = ""
) -> dict[str, Any]:
    return {
        "benchmark": bench,
        "metric": metric,
        "p2ptrain": _fmt(p2p, unit),
        "hivemind": _fmt(hm, unit),
        "ratio": _ratio(p2p, hm),
        "target": target,
        "met": met,
        "command": command,
    }


def not_run(bench: str, command: str, why: str = "not run") -> dict[str, Any]:
    return {
        "benchmark": bench,
        "metric": why,
        "p2ptrain": "-",
        "hivemind": "-",
        "ratio": "-",
        "target": "-",
        "met": None,
        "command": command,
    }


def transport_rows(results: Path) -> list[dict[str, Any]]:
    d = _load(results, "transport.json")
    if d is None:
        return [not_run("transport", "python -m simulations.bench_transport")]
    out = []
    for r in d.get("rows", []):
        target, met = "-", None
        if r.get("metric") == "stream_mb_s" and d.get("target_stream_mb_s"):
            target = f">= {d['target_stream_mb_s']:g} MB/s"
            met = r.get("p2ptrain") is not None and r["p2ptrain"] >= d["target_stream_mb_s"]
        better = f" ({r['better']} is better)" if r.get("better") else ""
        out.append(
            row(
                "transport",
                r.get("label", r["metric"]) + better,
                r.get("p2ptrain"),
                r.get("hivemind"),
                target,
                met,
                r.get("command", d.get("command", "")),
                r.get("unit", ""),
            )
        )
    return out


def dht_rows(results: Path) -> list[dict[str, Any]]:
    out = []
    d = _load(results, "dht-128.json")
    if d is not None:
        hm = d.get("hivemind") or {}
        p2p = next(
            (p for p in d.get("p2ptrain", []) if p.get("gc") == "relaxed"), (d.get("p2ptrain") or [None])[0]
        )
        cmp = next((c for c in d.get("comparisons", []) if c.get("p2ptrain_gc") == "relaxed"), None)
        side = [r["command"] for r in d.get("rows", []) if r.get("system") == "hivemind"]
        cmd = (side or [r["command"] for r in d.get("rows", []) if r.get("system") == "p2ptrain"] or [""])[0]
        if p2p:
            n = p2p.get("nodes")
            for phase in ("get", "store"):
                target, met = (
                    ("< 1x hivemind (in its node)", cmp.get("target_met"))
                    if cmp and phase == "get"
                    else ("-", None)
                )
                out.append(
                    row(
                        "dht",
                        f"{phase} mean latency, {n} nodes (lower is better)",
                        p2p[phase].get("mean_ms"),
                        (hm.get(phase) or {}).get("mean_ms"),
                        target,
                        met,
                        cmd,
                        "ms",
                    )
                )
            out.append(
                row(
                    "dht",
                    f"get success, {n} nodes",
                    p2p["get"].get("success_pct"),
                    (hm.get("get") or {}).get("success_pct"),
                    "100%",
                    p2p["get"].get("success_pct") == 100.0,
                    cmd,
                    "%",
                )
            )
    d = _load(results, "dht.json")
    if d is not None:
        for r in d.get("rows", []):
            if r.get("system") != "p2ptrain":
                continue
            n = r.get("nodes")
            out.append(
                row(
                    "dht",
                    f"get mean latency, {n} nodes (lower is better)",
                    r.get("get_mean_ms"),
                    None,
                    "-",
                    None,
                    r.get("command", ""),
                    "ms",
                )
            )
            ok = r.get("get_success_pct") == 100.0 and r.get("store_success_pct") == 100.0
            out.append(
                row(
                    "dht",
                    f"store and get success, {n} nodes",
                    r.get("get_success_pct"),
                    None,
                    "100%",
                    ok,
                    r.get("command", ""),
                    "%",
                )
            )
    return out or [not_run("dht", "python -m simulations.bench_dht")]


def allreduce_rows(results: Path) -> list[dict[str, Any]]:
    d = _load(results, "allreduce.json")
    if d is None:
        return [not_run("all-reduce", "python -m simulations.bench_allreduce --scenario all")]
    by = {(r["scenario"], r["system"]): r for r in d.get("results", [])}
    out = []
    for name, scen in (d.get("scenarios") or {}).items():
        p, h, f = by.get((name, "p2ptrain"), {}), by.get((name, "hivemind"), {}), by.get((name, "floor"), {})
        if p.get("status") != "ok":
            out.append(
                not_run(
                    "all-reduce",
                    p.get("command", d.get("command", "")),
                    f"{name}: {p.get('status', 'not run')}",
                )
            )
            continue
        mb = scen.get("mb_used", scen.get("mb"))
        hm = h.get("median_s") if h.get("status") == "ok" else None
        if scen.get("netns") and scen.get("rates"):  # uneven links: the bound of the best partition
            frac = p.get("fraction_of_link_bound")
            links = "/".join(f"{r:g}" for r in scen["rates"])
            shares = "/".join(f"{s:.2f}" for s in p.get("shares_last_round") or [])
            target, met = "-", None
            metric = (
                f"{name}: {mb:g} MB, links {links} Mbit/s, median round (lower is better; {_pct(frac)} of"
                f" the bound {_fmt(p.get('link_bound_s'), 's')}; shares {shares or '-'})"
            )
        elif scen.get("netns"):
            frac = p.get("fraction_of_link_bound")
            target, met = (
                (">= 90% of the link bound", frac >= 0.9)
                if frac is not None and scen.get("compression") == "none"
                else ("-", None)
            )
            metric = (
                f"{name}: {mb:g} MB, {scen.get('rate_mbit', 0):g} Mbit/s links, median round (lower is better"
                + (f"; {_pct(frac)} of the link bound)" if scen.get("compression") == "none" else ")")
            )
        else:
            floor = f.get("median_s")
            ok = (
                hm is not None
                and floor is not None
                and p["median_s"] <= hm / 4
                and p["median_s"] <= 2 * floor
            )
            target, met = (
                "<= 0.25x hivemind and <= 2x the floor",
                ok if hm is not None and floor is not None else None,
            )
            metric = f"{name}: {mb:g} MB, median round (lower is better; floor {_fmt(floor, 's')})"
        rounds = (d.get("plan") or {}).get("rounds", 5)
        cmd = f"python -m simulations.bench_allreduce --scenario {name} --systems floor,p2ptrain,hivemind"
        cmd += f" --rounds {rounds}"
        out.append(row("all-reduce", metric, p.get("median_s"), hm, target, met, cmd, "s"))
    return out


def _pct(x: Any) -> str:
    return f"{100 * x:.0f}%" if isinstance(x, int | float) else "-"


def training_rows(results: Path) -> list[dict[str, Any]]:
    d = _load(results, "training.json")
    done = {r.get("scenario"): r for r in (d or {}).get("results", [])}
    out = []
    for name in TRAINING:
        r = done.get(name)
        cmd = f"python -m simulations.bench_training --scenario {name}"
        if r is None:
            out.append(not_run(f"training: {name}", cmd))
            continue
        for x in r.get("rows") or [
            {"variant": r.get("status", "?"), "result": r.get("error", "-"), "met": r.get("met")}
        ]:
            metric = x.get("variant") or name
            target = x.get("target") or r.get("target") or "-"
            out.append(
                {
                    "benchmark": f"training: {name}",
                    "metric": metric,
                    "p2ptrain": x.get("result", "-"),
                    "hivemind": "-",
                    "ratio": "-",
                    "target": target,
                    "met": x.get("met"),
                    "command": r.get("command", cmd),
                }
            )
    return out


def scenario_rows(results: Path, label: str) -> list[dict[str, Any]]:
    s = _load(results, f"{label}.json")
    cmd = {
        "churn": "python -m simulations run churn",
        "wan-continents": "python -m simulations run wan-continents",
        "wan-continents-sync": "python -m simulations run wan-continents --mode sync",
    }[label]
    if s is None:
        return [not_run(f"scenario: {label}", cmd)]
    cmd = s.get("command", cmd)
    short = f", shortened to {s['duration_s']:g} s" if s.get("written_duration_s") else ""
    out = []
    for c in s.get("checks", []):
        out.append(
            {
                "benchmark": f"scenario: {label}",
                "metric": c["check"] + short,
                "p2ptrain": c["measured"],
                "hivemind": "-",
                "ratio": "-",
                "target": c["target"],
                "met": c["passed"],
                "command": cmd,
            }
        )
    return out


def hostile_rows(results: Path) -> list[dict[str, Any]]:
    out = []
    for peers in (4, 8):
        name = "hostile.json" if peers == 4 else f"hostile-{peers}.json"
        bench = f"hostile peers ({peers})"
        d = _load(results, name)
        cmd = f"python -m simulations.bench_hostile --peers {peers}"
        if d is None:
            out.append(not_run(bench, cmd))
            continue
        base = d.get("baseline") or {}
        if base.get("status") != "ok":
            why = f"no-attack run: {base.get('status', 'not run')}"
            out.append(not_run(bench, d.get("command", cmd), why))
        # A later rerun of some attacks (on code changed after the full run) speaks for them.
        after = _load(results, f"hostile-{peers}-after.json") if peers == 8 else None
        redone = {r["kind"]: r for r in (after or {}).get("results", [])}
        for r in d.get("results", []):
            again = r["kind"] in redone
            src = after if again and after is not None else d
            r = redone.get(r["kind"], r)
            quick = " --quick" if src.get("quick") else ""
            c = r.get("comparison") or {}
            rel = c.get("relative")
            step = f"step {c['step']}" if c.get("step") is not None else "no step"
            anonymous = r.get("named") == "anonymous"  # records under fresh keys only: not asked
            metric = (
                f"{r['kind']}: honest val loss vs no attack ({step}, {c.get('how') or '-'}); offender named: "
                f"{_fmt(r.get('named'))}; honest peers kept training: {_fmt(r.get('kept_training'))}; "
                f"global steps {r.get('final_step', '-')} (no attack: {r.get('baseline_final_step', '-')})"
            )
            if "attacker_cost" in r:
                from simulations.benchmarks.hostile import cost_text

                metric += f"; attackers spent: {cost_text(r['attacker_cost'])}"
            if again:
                metric = f"rerun on later code ({src.get('command', '')}): {metric}"
            named = "" if anonymous else ", offender named"
            out.append(
                row(
                    bench,
                    metric if r.get("status") == "ok" else f"{r['kind']}: {r.get('status')}",
                    "-" if rel is None else f"{100 * rel:+.1f}%",
                    None,
                    f"<= +{100 * src.get('tolerance', 0.05):g}%{named}, kept training",
                    r.get("met"),
                    f"{cmd} --kinds {r['kind']}{quick}",
                )
            )
    return out


def scale_rows(results: Path) -> list[dict[str, Any]]:
    d = _load(results, "scale.json")
    if d is None:
        return [not_run("scale", "python -m simulations.bench_scale")]
    out = []
    for r in d.get("results", []):
        cmd = r.get("command", d.get("command", ""))
        bench = f"scale: {r.get('size')} {r.get('mode')}"
        peaks = [n["multiple"] for n in r.get("nodes", []) if n.get("multiple") is not None]
        if r.get("status") == "aborted" and peaks:  # killed for memory: the peaks so far bound it from below
            low = max(peaks)
            metric = f"{r.get('error')}: worst node at least {low:.2f}x (lower is better)"
            met = False if low > r["target"] else None
            out.append(row(bench, metric, f">= {low:.2f}x", None, f"<= {r['target']:g}x", met, cmd))
            continue
        if r.get("status") not in ("ok", "incomplete") or r.get("max_multiple") is None:
            out.append(not_run(bench, cmd, f"{r.get('status')}: {r.get('error', '-')}"))
            continue
        steps = "; ".join(
            f"{n}: " + ", ".join(f"{k} {v}" for k, v in c.items())
            for n, c in (r.get("outcomes") or {}).items()
        )
        metric = (
            f"peak RSS - footprint over fp32 params, worst of {r.get('peers')} nodes (lower is better; "
            f"median round {_fmt(r.get('round_seconds_median'), 's')}; steps {steps or '-'})"
        )
        out.append(
            row(bench, metric, r["max_multiple"], None, f"<= {r['target']:g}x", r.get("met"), cmd, "x")
        )
    return out


def statesync_rows(results: Path) -> list[dict[str, Any]]:
    d = _load(results, "statesync.json")
    if d is None:
        return [not_run("state sync", "python -m simulations.bench_statesync")]
    out = []
    for r in d.get("results", []):
        cmd = r.get("command", d.get("command", ""))
        bench = f"state sync: {r.get('size')}, {r.get('donors')} donor(s)"
        dl = r.get("download") or {}
        target = ">= 85%" if r.get("donors") == 1 else "-"
        if not dl:
            why = f"{r.get('status')}: {str(r.get('reason') or r.get('error'))[:200]}"
            if r.get("status") == "failed":  # the joiner never got the state: a miss, not a broken run
                out.append(row(bench, f"download: {why}", "failed", None, target, r.get("met"), cmd))
            else:
                out.append(not_run(bench, cmd, why))
            continue
        frac = dl.get("fraction_of_link")
        metric = (
            f"download rate, fraction of the {r.get('rate_mbit', 0):g} Mbit/s link "
            f"({dl['bytes'] / 1e6:.0f} MB in {dl['seconds']:.1f} s; first contribution "
            f"{_fmt(r.get('first_contribution_s'), 's')}; "
            f"{r.get('status')})"
        )
        out.append(row(bench, metric, _pct(frac), None, target, r.get("met"), cmd))
    return out


def build_table(results: Path) -> tuple[str, list[dict[str, Any]]]:
    rows = transport_rows(results) + dht_rows(results) + allreduce_rows(results) + training_rows(results)
    for label in ("churn", "wan-continents", "wan-continents-sync"):
        rows += scenario_rows(results, label)
    rows += hostile_rows(results)
    rows += scale_rows(results) + statesync_rows(results) + nat_rows(results) + bytes_rows(results)
    lines = [
        "| benchmark | metric | p2ptrain | hivemind | p2ptrain / hivemind | target | met? | command |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        cells = [
            r["benchmark"],
            r["metric"],
            r["p2ptrain"],
            r["hivemind"],
            r["ratio"],
            r["target"],
            met,
            f"`{r['command']}`",
        ]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines), rows


def write_summary(results: Path, runs: list[dict[str, Any]], quick: bool) -> str:
    table, rows = build_table(results)
    met = sum(r["met"] is True for r in rows)
    missed = sum(r["met"] is False for r in rows)
    head = [
        "# Benchmark summary",
        "",
        f"Written by `python -m simulations bench{' --quick' if quick else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from the JSON in this folder ({met} targets "
        f"met, {missed} missed). hivemind: {hivemind_available()}.",
        "Each row's command reproduces it; machines are noisy, so compare ratios within one run.",
        "",
        BEGIN,
        table,
        END,
        "",
    ]
    if runs:
        head += (
            ["This run:", ""]
            + [f"- `{r['command']}`: {r['status']} ({r['seconds']:g} s)" for r in runs]
            + [""]
        )
    text = "\n".join(head)
    (results / "SUMMARY.md").write_text(text)
    return table


def splice(readme: Path, table: str) -> bool:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        return False
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    readme.write_text(f"{before}{BEGIN}\n{table}\n{END}{after}")
    return True


def main(args: argparse.Namespace) -> int:
    only = tuple(x.strip() for x in (args.only or ",".join(NAMES)).split(",") if x.strip())
    bad = [x for x in only if x not in NAMES]
    if bad:
        print(f"error: --only: unknown {', '.join(bad)}; choose from {', '.join(NAMES)}", file=sys.stderr)
        return 2
    results = Path(args.results) if args.results else (RESULTS / "quick" if args.quick else RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    failed = False
    if not args.table_only:
        log = Path(tempfile.gettempdir()) / f"p2ptrain-bench-{time.strftime('%Y%m%d-%H%M%S')}.log"
        print(f"benchmarks' output goes to {log}")
        with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-") as tmp:
            for step in plan(args.quick, only, results, Path(tmp)):
                try:
                    result = run_step(step, log)
                finally:
                    if step.after is not None:
                        step.after(results, Path(tmp))
                runs.append(result)
                failed |= not result["status"].startswith(("ok", "ran"))
    table = write_summary(results, runs, args.quick)
    print(f"\n{results / 'SUMMARY.md'}:\n\n{table}")
    if args.readme:
        if splice(Path(args.readme), table):
            print(f"the table is in {args.readme}")
        else:
            print(f"{args.readme} has no {BEGIN} ... {END} markers: nothing put there", file=sys.stderr)
    return 1 if failed else 0
