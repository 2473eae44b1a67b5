"""What a benchmark report records about the machine and the code it measured."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


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
