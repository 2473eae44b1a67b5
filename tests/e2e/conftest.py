"""Fixtures of the end-to-end tests (what they build is in ``tests/harness/processes.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.processes import NodeProc


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., NodeProc]]:
    """``nodes(name, *extra)`` starts a :class:`NodeProc` in the test's folder; whatever is still
    running at the end is killed."""
    started: list[NodeProc] = []

    def start(name: str, *extra: str) -> NodeProc:
        started.append(NodeProc(tmp_path, name, *extra))
        return started[-1]

    yield start
    for node in started:
        node.kill()
