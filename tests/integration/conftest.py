"""Fixtures for the in-process integration tests: real Hosts over a MemoryNetwork or loopback TCP.

Test modules get everything through fixtures (no ``from conftest import``), so this layer does not
depend on how pytest names conftest modules:

- ``kit``: the test vocabulary (message classes, methods, ``payload()``, ``digest()``);
- ``memnet``: a fresh :class:`MemoryNetwork`;
- ``mem_cluster`` / ``tcp_cluster``: start Hosts in the test's nursery (``await cluster.start()``);
- ``cluster``: parametrized over both transports, for behaviour that must not depend on the transport.

Each started host serves a :class:`Service` (``tests/harness/hosts.py``, where all of this is built),
whose handlers report what happened to them (entered, cancelled, at what virtual time) so tests can
assert on the serving side as well.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from p2ptrain.net import MemoryNetwork
from tests.harness.hosts import (
    BIG,
    CHUNK,
    ECHO,
    FAIL,
    FIRST,
    HOLD,
    RUN_ID,
    SINK,
    SLEEP,
    SOURCE,
    Cluster,
    Digest,
    Size,
    Text,
    digest,
    payload,
)


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        RUN_ID=RUN_ID,
        CHUNK=CHUNK,
        Text=Text,
        Size=Size,
        Digest=Digest,
        ECHO=ECHO,
        SLEEP=SLEEP,
        FAIL=FAIL,
        SINK=SINK,
        SOURCE=SOURCE,
        HOLD=HOLD,
        FIRST=FIRST,
        BIG=BIG,
        payload=payload,
        digest=digest,
    )


@pytest.fixture
def memnet() -> MemoryNetwork:
    return MemoryNetwork(seed=1)


@pytest.fixture
async def mem_cluster(nursery: trio.Nursery, memnet: MemoryNetwork) -> Cluster:
    return Cluster(nursery, "memory", memnet)


@pytest.fixture
async def tcp_cluster(nursery: trio.Nursery) -> Cluster:
    return Cluster(nursery, "tcp")


@pytest.fixture(params=["memory", "tcp"])
async def cluster(request: pytest.FixtureRequest, nursery: trio.Nursery, memnet: MemoryNetwork) -> Cluster:
    return Cluster(nursery, request.param, memnet if request.param == "memory" else None)
