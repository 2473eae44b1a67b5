"""``python -m simulations``: replay scenarios, run the benchmark suite.

::

    python -m simulations list                                   # the shipped scenarios
    python -m simulations check simulations/scenarios/churn.toml # validate; print the peers and timeline
    python -m simulations run simulations/scenarios/lan-4.toml [--duration S] [--mode sync|diloco]
        [--emulation userspace|netns|none] [--out DIR] [--workdir DIR] [--quiet]
    python -m simulations report simulations/reports/lan-4-...     # analyse a run's folder again
    python -m simulations bench [--quick] [--only transport,dht,...] [--results DIR] [--table-only]
    python -m simulations bench --only scale,state-sync   # memory at 124M/350M; a late joiner's download
    python -m simulations bench --only bytes-per-token    # wire bytes per token: sync fp32 vs DiLoCo recipes

``run`` exits 0 when every check of the scenario passed, 1 when one failed (or the run was interrupted),
2 when the scenario is invalid or cannot run here. A scenario may also be named without its path
(``run churn``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from p2ptrain.errors import ConfigError
from simulations.replay.scenario import REPO_ROOT, SCENARIOS_DIR, Scenario, load_scenario

DEFAULT_REPORTS = REPO_ROOT / "simulations" / "reports"


def resolve(name: str) -> Path:
    path = Path(name)
    if path.exists() or path.suffix == ".toml" or "/" in name:
        return path
    return SCENARIOS_DIR / f"{name}.toml"


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    scenario = load_scenario(resolve(args.scenario))
    return scenario.with_changes(
        duration=getattr(args, "duration", None),
        mode=getattr(args, "mode", None),
        emulation=getattr(args, "emulation", None),
    )


def cmd_list(args: argparse.Namespace) -> int:
    for path in sorted(SCENARIOS_DIR.glob("*.toml")):
        try:
            s = load_scenario(path)
        except ConfigError as e:
            print(f"{path.stem:16} INVALID: {e}")
            continue
        print(f"{s.name:16} {len(s.peers):2} peers {s.duration:6g} s  {s.emulation:9} {s.description}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    s = scenario_from_args(args)
    print(f"{s.name}: {s.description}")
    print(f"  {s.duration:g} s, emulation {s.emulation}, run {s.run}, mode {s.mode or '(the run file)'}")
    for n in s.not_emulated():
        print(f"  not emulated: {n}")
    for p in s.peers:
        start = "at 0 s" if p.start_at == 0 else "by an event"
        print(
            f"  peer {p.index} {p.name}: slowdown {p.slowdown:g}, up {p.up_mbit:g} / down {p.down_mbit:g} "
            f"Mbit/s, latency {p.latency_ms:g} ms (jitter {p.jitter_ms:g}), cuts/min {p.cuts_per_min:g}, "
            f"starts {start}"
        )
    for e in s.events:
        print(f"  {e.describe()}  ({e.origin})")
    for e in s.dropped_events:
        print(f"  dropped (past the duration): {e.describe()}")
    print(f"  checks: {s.checks}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from simulations.replay.runner import RunOptions, run_scenario

    scenario = scenario_from_args(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else DEFAULT_REPORTS / f"{scenario.name}-{stamp}"
    options = RunOptions(
        out=out.resolve(), workdir=Path(args.workdir).resolve() if args.workdir else None, quiet=args.quiet
    )
    summary = run_scenario(scenario, options)
    print(
        f"\nscenario {scenario.name}: {'PASSED' if summary['passed'] else 'FAILED'}; "
        f"report in {out}/report.md"
    )
    for c in summary["checks"]:
        verdict = {True: "pass", False: "FAIL", None: "info"}[c["passed"]]
        print(f"  {verdict:4}  {c['check']}: {c['measured']}")
    for p in summary["problems"]:
        print(f"  problem: {p}")
    return 0 if summary["passed"] else 1


def cmd_report(args: argparse.Namespace) -> int:
    from simulations.replay.report import load_run, render

    folder = Path(args.folder)
    summary = render(load_run(folder), folder)
    print(f"{folder}/report.md written again: {'PASSED' if summary['passed'] else 'FAILED'}")
    return 0 if summary["passed"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from simulations.benchmarks.suite import main as suite_main

    return suite_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the shipped scenarios").set_defaults(fn=cmd_list)
    for name, fn, helptext in (
        ("check", cmd_check, "validate a scenario; print its peers and timeline"),
        ("run", cmd_run, "run a scenario with real node processes and write its report"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("scenario", help="a scenario file, or the name of a shipped one")
        p.add_argument("--duration", type=float, help="shorten (or lengthen) the scenario, seconds")
        p.add_argument("--mode", choices=("sync", "diloco"), help="override the training mode")
        p.add_argument("--emulation", choices=("userspace", "netns", "none"), help="override the emulation")
        p.set_defaults(fn=fn)
        if name == "run":
            p.add_argument(
                "--out", help="report folder (default simulations/reports/NAME-TIME; must be empty)"
            )
            p.add_argument("--workdir", help="node folders: logs, checkpoints (default OUT/nodes)")
            p.add_argument("--quiet", action="store_true", help="no progress lines")
    r = sub.add_parser("report", help="analyse a report folder again (after changing the analysis)")
    r.add_argument("folder")
    r.set_defaults(fn=cmd_report)
    from simulations.benchmarks.suite import add_arguments

    b = sub.add_parser("bench", help="run the benchmark suite; write simulations/results/ and SUMMARY.md")
    add_arguments(b)
    b.set_defaults(fn=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
