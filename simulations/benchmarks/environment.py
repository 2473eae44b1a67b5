"""What a benchmark report records about the machine and the code it measured, and where it goes."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def environment(packages: tuple[str, ...]) -> dict[str, Any]:
    """Python, platform, CPUs, the commit measured (and whether the code under test was dirty), versions."""
    commit = _git("rev-parse", "--short", "HEAD")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "git_commit": commit or None,
        # Uncommitted changes to the code under test make the commit alone not reproduce the numbers.
        "git_dirty": bool(_git("status", "--porcelain", "--", "p2ptrain")) if commit else None,
        "versions": {d: package_version(d) for d in packages},
    }


def write_report(report: dict[str, Any], json_path: str | None, table: str) -> None:
    """The JSON report to ``json_path`` (atomically: a reader never sees half a report) or to stdout,
    and the human table to stderr."""
    text = json.dumps(report, indent=2)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
    else:
        print(text)
    print(table, file=sys.stderr)
