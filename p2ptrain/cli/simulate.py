"""``p2ptrain simulate``: train with a local swarm of real node processes (see :mod:`p2ptrain.simulate`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import UsageError


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..simulate import SimulationOptions, run_simulation

    try:
        slowdown = tuple(float(x) for x in args.slowdown.split(",")) if args.slowdown else ()
    except ValueError:
        raise UsageError(
            f"--slowdown {args.slowdown!r}: expected numbers separated by commas, e.g. 1,1,2,4"
        ) from None
    opts = SimulationOptions(
        peers=args.peers,
        config=args.config,
        mode=args.mode,
        max_steps=args.max_steps,
        duration=args.duration,
        slowdown=slowdown,
        threads=args.threads,
        workdir=args.workdir,
        report=args.report,
        run_id=args.run_id,
        live=sys.stdout.isatty() and not args.no_live,
        private=args.private,
    )
    return run_simulation(opts)


def add_parsers(sub: Any) -> None:
    """The ``simulate`` command's parser, under ``sub`` (the command's subparsers)."""
    s = sub.add_parser(
        "simulate",
        help="train with a local swarm of real node processes, live, and write a report",
        description="Starts --peers `p2ptrain node` processes on this machine that train the run's model"
        " together (node 0 first, the others join it by its address), shows them live, and writes a report"
        " folder: per-peer JSON metrics, loss.png, summary.json.",
    )
    s.add_argument("--peers", type=int, default=4, help="number of nodes (default 4)")
    s.add_argument("--config", metavar="TOML", help="run file (default: the built-in tiny-gpt run)")
    s.add_argument("--mode", choices=["sync", "diloco"], help="override the run file's training.mode")
    s.add_argument(
        "--max-steps", type=int, default=40, help="global steps to train (default 40; 0: no limit)"
    )
    s.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (default: none)")
    s.add_argument("--slowdown", metavar="F,F,...", help="per-node compute slowdown, e.g. 1,1,2,4")
    s.add_argument("--threads", type=int, default=1, help="torch threads per node (default 1)")
    s.add_argument("--workdir", metavar="DIR", help="node folders (data, logs, status, metrics) go here")
    s.add_argument("--report", metavar="DIR", help="report folder (default WORKDIR/report)")
    s.add_argument("--run-id", help="default: the run file's")
    s.add_argument("--no-live", action="store_true", help="print the table every 10 s instead of live")
    s.add_argument(
        "--private",
        action="store_true",
        help="a private swarm: a throwaway authority and a certificate per node (top-k run files need one)",
    )
    s.set_defaults(func=cmd_simulate)
