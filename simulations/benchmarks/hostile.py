"""Hostile peers benchmark: the issue's adversarial scenarios, each compared with the same swarm unattacked.

For ``--peers 4`` (``simulations/scenarios/hostile-4.toml``: peer 3 hostile) or ``--peers 8``
(``hostile-8.toml``: peers 6 and 7 hostile), it runs the scenario once with no attack (every peer
honest: the baseline) and once per attack of ``--kinds`` (the scenario's hostile peers all run that one;
default every kind of ``p2ptrain.testing.adversary``), with
real ``p2ptrain node`` processes through ``simulations.replay.runner``, one run after the other. Robust
aggregation and audits are on in both files, in the baseline too, so that the attack is the only
difference. From each run's ``summary.json`` it reports:

- the honest peers' validation loss (the median over them) at the last global step evaluated in both
  this run and the baseline (at the last evaluation of each when they share none), and its difference
  relative to the baseline's. Target: at most 5% above it (a lower loss passes);
- whether every adversary was *named*: accused by its short peer id in at least one honest peer's log
  (``simulations.replay.report`` says which lines count); not asked for attacks made through records of fresh
  keys (``ANONYMOUS``: nothing ties those to the attacking peer);
- whether the honest peers *kept training*: none exited by itself and each took a global step within the
  last ``max(30 s, a quarter of the duration)``;
- whether they kept their *pace*: the global step they reached is at least ``STEPS_FLOOR`` (half) of the
  step the no-attack run reached in the same time (an attack that stalls the swarm fails even when what
  little it trained is not worse);
- the scenario's own checks (the honest peers hold identical parameters, their loss falls, no crashes).

An attack meets the issue's target when all four hold. Usage::

    python -m simulations.bench_hostile [--kinds nan,scale,random,inflate,garbage-reducer] [--peers 4|8]
        [--mode sync|diloco] [--duration S] [--quick] [--json PATH] [--workdir DIR] [--reanalyse DIR]

``--mode diloco`` runs the scenario with DiLoCo (local steps, then an averaged pseudo-gradient and the
outer step) instead of the scenario's synchronous mode; the report goes to ``hostile-diloco*.json``.

``--quick`` shortens every run to ``QUICK_S`` seconds (``--duration`` to any length). The JSON report goes
to PATH (default ``simulations/results/hostile.json``, ``hostile-8.json`` for 8 peers, both under
``simulations/results/quick/`` with ``--quick``; ``-`` for stdout), a table to stderr; every run's report
folder (report.md, plots, node logs) is kept under the work directory as evidence. ``--reanalyse DIR``
runs nothing: it analyses the report folders an earlier run left in DIR again (after a change to the
analysis, to the accusing log forms say; the logs are scanned again) and writes the JSON and the table
anew. Exit status 0 when every run completed (whether or not the targets were met: the JSON says), 1
when one could not run or was interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2ptrain.errors import ConfigError
from p2ptrain.testing import sybils
from p2ptrain.testing.adversary import ADVERSARIES
from simulations.benchmarks.environment import REPO_ROOT, environment, write_report
from simulations.replay.scenario import SCENARIOS_DIR, Scenario, load_scenario

MODULE = "simulations.bench_hostile"
SCENARIOS = {4: "hostile-4", 8: "hostile-8"}
TOLERANCE = 0.05  # the honest peers' validation loss at most this much above the no-attack run's
STEPS_FLOOR = 0.5  # the honest peers' global step at least this share of the no-attack run's
QUICK_S = 90.0
BASELINE = "no attack"
# Attacks through records signed by fresh keys: they leave the honest peers nothing that ties them to the
# attacking peer's id, so naming it is not asked of them (judged by the loss and by training going on).
ANONYMOUS = frozenset(sybils.KINDS)
OFFENDER_KEYS = ("peer", "peer_id", "named_by", "accusing_lines", "excluded_rounds", "banned_by")


def default_json(peers: int, quick: bool, mode: str | None = None) -> Path:
    """simulations/results/hostile.json (hostile-8.json for 8 peers, hostile-diloco[-8].json in DiLoCo
    mode); under results/quick/ for --quick, so that a smoke run never replaces the full numbers."""
    folder = REPO_ROOT / "simulations" / "results" / ("quick" if quick else "")
    name = "hostile" + ("-diloco" if mode == "diloco" else "")
    return folder / (f"{name}.json" if peers == 4 else f"{name}-{peers}.json")


def variant(
    base: Scenario, kind: str | None, duration: float | None = None, mode: str | None = None
) -> Scenario:
    """The scenario with its hostile peers running ``kind`` (None: every peer honest), in ``mode``."""
    hostile = base.adversaries
    kinds = [kind if p.index in hostile else None for p in base.peers]
    return unnamed(base.with_changes(duration=duration, adversaries=kinds, mode=mode), kind)


def unnamed(scenario: Scenario, kind: str | None) -> Scenario:
    """Nothing ties the fresh keys' records of an ``ANONYMOUS`` attack to the attacking peer: its
    scenario does not ask the honest peers to name it."""
    if kind not in ANONYMOUS:
        return scenario
    return dataclasses.replace(scenario, checks=dataclasses.replace(scenario.checks, offenders_named=False))


# ---- the comparison (pure) -------------------------------------------------------------------------


def _points(summary: dict[str, Any] | None) -> dict[int, float | None]:
    pts = ((summary or {}).get("honest") or {}).get("val_points") or []
    return {int(s): (float(v) if isinstance(v, int | float) and math.isfinite(v) else None) for s, v in pts}


def compare(
    baseline: dict[int, float | None], attacked: dict[int, float | None], tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """The honest peers' validation loss under attack against the baseline's: at the last step both
    evaluated, else at the last evaluation of each. ``within``: at most ``tolerance`` above it (None:
    nothing to compare)."""
    out: dict[str, Any] = {
        "how": None,
        "step": None,
        "baseline_step": None,
        "loss": None,
        "baseline_loss": None,
        "relative": None,
        "within": None,
    }
    if not baseline or not attacked:
        out["how"] = "no validation loss " + ("in the no-attack run" if not baseline else "in this run")
        return out
    common = sorted(set(baseline) & set(attacked))
    if common:
        sb = sa = common[-1]
        out["how"] = "same step"
    else:
        sb, sa = max(baseline), max(attacked)
        out["how"] = "last evaluations"
    vb, va = baseline[sb], attacked[sa]
    out |= {"step": sa, "baseline_step": sb, "loss": va, "baseline_loss": vb}
    if vb is None or vb <= 0:
        out["how"] += "; the no-attack loss is not usable"
        return out
    if va is None:
        out["how"] += "; the loss under attack is not finite"
        out["within"] = False
        return out
    rel = round((va - vb) / vb, 4)  # judged as shown: 4 decimals
    out |= {"relative": rel, "within": rel <= tolerance}
    return out


def pace(final_step: Any, baseline_step: Any, floor: float = STEPS_FLOOR) -> bool | None:
    """Did the honest peers reach at least ``floor`` of the no-attack run's global step (None: one of the
    two runs reports none)?"""
    if not isinstance(final_step, int) or not isinstance(baseline_step, int):
        return None
    return final_step >= floor * baseline_step


def assess(
    kind: str, summary: dict[str, Any] | None, baseline: dict[str, Any] | None, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """One attack's row: the loss comparison, offenders named, honest peers kept training and their
    pace, checks."""
    if summary is None:
        return {
            "kind": kind,
            "met": None,
            "named": None,
            "kept_training": None,
            "kept_pace": None,
            "comparison": None,
        }
    offenders = summary.get("offenders") or []
    honest = summary.get("honest") or {}
    named = all(o.get("named") for o in offenders) if offenders else None
    anonymous = kind in ANONYMOUS
    kept = honest.get("kept_training")
    baseline_step = ((baseline or {}).get("honest") or {}).get("final_step")
    kept_pace = pace(honest.get("final_step"), baseline_step)
    cmp = compare(_points(baseline), _points(summary), tolerance)
    met: bool | None = (
        cmp["within"] is True and (anonymous or named is True) and kept is True and kept_pace is True
    )
    if cmp["within"] is None and named is not False and kept is not False and kept_pace is not False:
        met = None  # nothing to compare the loss with, and nothing else failed
    failed = [c["check"] for c in summary.get("checks", []) if c.get("passed") is False]
    return {
        "kind": kind,
        "met": met,
        "comparison": cmp,
        "named": "anonymous" if anonymous else named,
        "offenders": [_offender(o) for o in offenders],
        "kept_training": kept,
        "kept_pace": kept_pace,
        "final_step": honest.get("final_step"),
        "baseline_final_step": baseline_step,
        "checks_failed": failed,
        "scenario_passed": summary.get("passed"),
    }


COST_LINE = re.compile(
    r"attack (?P<kind>[\w-]+) so far: (?P<keys>\d+) keys, (?P<stores>\d+) records stored "
    r"\((?P<bytes>\d+) bytes sent\), (?P<connections>\d+) connections"
)


def attacker_costs(run: Path, adversaries: Sequence[int]) -> dict[str, int] | None:
    """What the hostile peers spent, summed over them, from the last running count each logged (the
    attacks through fresh keys log one: ``p2ptrain.testing.sybils``); None when none logged any."""
    total = {"keys": 0, "stores": 0, "bytes": 0, "connections": 0}
    found = False
    for i in adversaries:
        try:
            text = (run / "nodes" / f"peer-{i}" / "node.log").read_text(errors="replace")
        except OSError:
            continue
        matches = list(COST_LINE.finditer(text))
        if matches:
            last = matches[-1]
            found = True
            for k in total:
                total[k] += int(last[k])
    return total if found else None


def cost_text(c: dict[str, int] | None) -> str:
    if not c:
        return "its own id"
    parts = [f"{c['keys']} keys"] if c["keys"] else []
    if c["stores"]:
        parts.append(f"{c['stores']} records, {c['bytes'] / 1e6:.1f} MB")
    if c["connections"]:
        parts.append(f"{c['connections']} connections")
    return ", ".join(parts) or "its own id"


def _offender(o: dict[str, Any]) -> dict[str, Any]:
    return {k: o.get(k) for k in OFFENDER_KEYS} | {"examples": (o.get("examples") or [])[:2]}


# ---- the table -------------------------------------------------------------------------------------


def _loss(v: Any, step: Any) -> str:
    return "-" if v is None else f"{v:.4f} (step {step})"


def _yes(v: Any) -> str:
    return {True: "yes", False: "NO", None: "-"}.get(v, str(v))


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in report.get("results", []):
        c = r.get("comparison") or {}
        rel = c.get("relative")
        rows.append(
            [
                r["kind"],
                r.get("status", "-"),
                _loss(c.get("loss"), c.get("step")),
                _loss(c.get("baseline_loss"), c.get("baseline_step")),
                "-" if rel is None else f"{100 * rel:+.1f}%",
                _yes(c.get("within")),
                _yes(r.get("named")),
                _yes(r.get("kept_training")),
                f"{r.get('final_step', '-')} / {r.get('baseline_final_step', '-')}",
                _yes(r.get("kept_pace")),
                ", ".join(r.get("checks_failed") or []) or ("all pass" if r.get("scenario_passed") else "-"),
                cost_text(r.get("attacker_cost")),
                {True: "met", False: "NOT met", None: "-"}[r.get("met")],
            ]
        )
    return rows


def format_table(report: dict[str, Any]) -> str:
    head = [
        "attack",
        "run",
        "honest val loss",
        "no-attack val loss",
        "diff",
        f"<= +{100 * report['tolerance']:g}%",
        "offender named",
        "kept training",
        "steps / no attack",
        f">= {100 * STEPS_FLOOR:g}%",
        "checks failed",
        "attackers spent",
        "target",
    ]
    lines = [head, *table_rows(report)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    base = report.get("baseline") or {}
    text.append(
        f"{report['scenario']} ({report.get('mode') or 'sync'}): peers "
        f"{', '.join(map(str, report['adversaries']))} hostile, "
        f"{report['aggregation']} aggregation, audit {'on' if report['audit'] else 'off'}, "
        f"{report['duration_s']:g} s per run; no-attack run: {base.get('status', '-')}, "
        f"final step {base.get('final_step', '-')}"
    )
    text.append(f"report folders (report.md, plots, node logs): {report['workdir']}")
    return "\n".join(text)


# ---- running ---------------------------------------------------------------------------------------


def run_one(scenario: Scenario, out: Path) -> tuple[str, dict[str, Any] | None, float]:
    """Run one scenario; (status, its summary.json or None, seconds)."""
    from simulations.replay.runner import RunOptions, run_scenario

    began = time.monotonic()
    try:
        run_scenario(scenario, RunOptions(out=out, quiet=True))
    except ConfigError as e:
        return f"could not run: {e}", None, round(time.monotonic() - began, 1)
    seconds = round(time.monotonic() - began, 1)
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError) as e:
        return f"no summary: {e}", None, seconds
    return ("interrupted" if summary.get("interrupted") else "ok"), summary, seconds


def reanalyse_one(out: Path, kind: str | None) -> tuple[str, dict[str, Any] | None, float]:
    """Analyse a run folder again (its logs are scanned again too); (status, summary.json, seconds)."""
    from simulations.replay.report import load_run, render

    if not (out / "run.json").exists():
        return f"no run in {out}", None, 0.0
    data = load_run(out)
    data["scenario"] = unnamed(data["scenario"], kind)
    render(data, out)
    summary = json.loads((out / "summary.json").read_text())
    return ("interrupted" if summary.get("interrupted") else "ok"), summary, float(summary.get("seconds", 0))


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if "all" in kinds:
        return ADVERSARIES
    bad = [k for k in kinds if k not in ADVERSARIES]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ADVERSARIES)} (comma-separated) or all")
    return kinds


def command(
    peers: int, kinds: Sequence[str], quick: bool, duration: float | None, mode: str | None = None
) -> str:
    cmd = f"python -m {MODULE} --peers {peers} --kinds {','.join(kinds)}"
    if mode is not None:
        cmd += f" --mode {mode}"
    if duration is not None:
        cmd += f" --duration {duration:g}"
    return cmd + (" --quick" if quick else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", type=parse_kinds, help="comma list (default all)")
    parser.add_argument("--peers", type=int, choices=sorted(SCENARIOS), default=4)
    parser.add_argument("--mode", choices=("sync", "diloco"), help="training mode (default: the scenario's)")
    parser.add_argument("--duration", type=float, help="seconds per run (default: the scenario's)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_S:g} s per run (a smoke check)")
    parser.add_argument("--json", metavar="PATH", help="report (default simulations/results/hostile.json)")
    parser.add_argument("--workdir", metavar="DIR", help="report folders (default: a new temp folder)")
    parser.add_argument(
        "--reanalyse",
        metavar="DIR",
        help="run nothing: analyse again the report folders an earlier run left in DIR (its --workdir)",
    )
    args = parser.parse_args(argv)
    if args.reanalyse:
        args.workdir = args.reanalyse
        found = tuple(k for k in ADVERSARIES if (Path(args.reanalyse) / k / "run.json").exists())
        args.kinds = args.kinds or found
    args.kinds = args.kinds or ADVERSARIES
    try:
        base = load_scenario(SCENARIOS_DIR / f"{SCENARIOS[args.peers]}.toml")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    duration = args.duration if args.duration is not None else (QUICK_S if args.quick else None)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-hostile-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    averaging = (base.run_overrides.get("averaging") or {}) if base.run_overrides else {}
    report: dict[str, Any] = {
        "benchmark": "hostile",
        "command": command(args.peers, args.kinds, args.quick, args.duration, args.mode),
        "scenario": base.name,
        "mode": args.mode or base.mode,
        "scenario_file": str(Path(base.source).relative_to(REPO_ROOT)),
        "peers": len(base.peers),
        "adversaries": sorted(base.adversaries),
        "aggregation": averaging.get("aggregation", "mean"),
        "audit": bool(averaging.get("audit", False)),
        "duration_s": duration if duration is not None else base.duration,
        "quick": args.quick,
        "tolerance": TOLERANCE,
        "target": f"honest val loss <= +{100 * TOLERANCE:g}% of the no-attack run's, every offender named "
        f"in an honest peer's log, the honest peers keep training, and reach >= {100 * STEPS_FLOOR:g}% of "
        "the no-attack run's global step",
        "environment": environment(("p2ptrain", "torch", "numpy", "trio")),
        "workdir": str(workdir),
        "reanalysed": bool(args.reanalyse),
        "results": [],
    }
    signal.signal(signal.SIGTERM, _interrupt)  # between runs too: the report of what ran is still written
    complete = True
    try:
        baseline = _run(report, BASELINE, variant(base, None, duration, args.mode), workdir / "no-attack")
        report["baseline"] = baseline
        report["duration_s"] = (baseline.get("summary") or {}).get("duration_s", report["duration_s"])
        complete = baseline["status"] == "ok"
        for kind in args.kinds if complete else ():
            r = _run(report, kind, variant(base, kind, duration, args.mode), workdir / kind)
            summary = r.pop("summary")
            cost = {"attacker_cost": attacker_costs(workdir / kind, report["adversaries"])}
            report["results"].append(r | assess(kind, summary, baseline.get("summary")) | cost)
            if r["status"] != "ok":
                complete = False
                break
    except KeyboardInterrupt:
        complete = False
        report["interrupted"] = True
    if "baseline" in report:
        report["baseline"].pop("summary", None)
    default = default_json(args.peers, args.quick, args.mode)
    json_path = None if args.json == "-" else str(args.json or default)
    write_report(report, json_path, format_table(report))
    return 0 if complete else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(report: dict[str, Any], label: str, scenario: Scenario, out: Path) -> dict[str, Any]:
    if report["reanalysed"]:
        status, summary, seconds = reanalyse_one(out, None if label == BASELINE else label)
    else:
        what = f"running {report['scenario']}: {label} ({scenario.duration:g} s) ..."
        print(what, file=sys.stderr, flush=True)
        status, summary, seconds = run_one(scenario, out)
    honest = (summary or {}).get("honest") or {}
    result = {
        "status": status,
        "seconds": seconds,
        "report": str(out),
        "final_step": honest.get("final_step"),
        "kept_training": honest.get("kept_training"),
        "val_points": honest.get("val_points"),
        "summary": summary,
    }
    print(f"  {status} after {seconds:g} s", file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
