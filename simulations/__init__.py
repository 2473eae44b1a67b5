"""Benchmarks, scenario replays and network labs for p2ptrain, each run as ``python -m simulations...``.

Layout (arrows point down only: a benchmark may replay scenarios and use labs, a lab uses nothing here):

- ``benchmarks/``: one module per benchmark, each printing JSON and a table, and ``suite`` running them all
  (``python -m simulations bench``) into ``results/SUMMARY.md``; ``environment`` (what a report records
  about the machine) and ``training_runs`` (node processes and their metrics) are their shared helpers;
- ``replay/``: scenario files (``scenario``: the TOML format, pure), replaying one with real node
  processes (``runner``), and its report and plots (``report``, ``plots``): ``python -m simulations run``;
- ``labs/``: emulated networks: ``wan`` (a userspace WAN switch, no root), ``netns`` (network namespaces
  and ``tc tbf``, root), ``natlab`` (home peers behind MASQUERADE routers, root);
- ``scenarios/``: the shipped scenario files; ``results/``: committed benchmark results.

The commands quoted in the README and in ``results/`` keep their names: ``python -m
simulations.bench_allreduce`` and the like are short modules here that run their benchmark (see
:func:`forward`).
"""

from __future__ import annotations

import importlib
import runpy
import sys


def forward(target: str, name: str) -> None:
    """Make the module ``name`` a second name of the module ``target``.

    Run as a program (``python -m NAME``, so ``name == "__main__"``), it runs ``target`` as ``__main__``,
    exactly as ``python -m TARGET`` would; imported, ``sys.modules[name]`` becomes ``target`` itself, so
    both names see (and patch) the same module.
    """
    if name == "__main__":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.modules[name] = importlib.import_module(target)
