"""The scale simulator as a test tool: the real node (host, DHT, relays, averager, collaborative
optimizer) at 8 peers on the message-level network, a minute of virtual time, with NATs and crashes; the
invariants hold (no fork: every step's parameters are the same bits on every peer that took it, so
every committed round was identical on its members)."""

from __future__ import annotations

import pytest

from simulations.scale.model import Churn
from simulations.scale.swarm import SwarmSpec, run

pytestmark = pytest.mark.timeout(600)  # (a minute of CPU; the machine running the suite may be busy)


def test_peers_behind_nats_and_crashing_never_fork() -> None:
    spec = SwarmSpec(
        peers=8,
        duration=70.0,
        warmup=25.0,
        join_spread=8.0,
        batches_per_step=4,
        nat_share=0.3,
        churn=Churn(kill=30.0),
        seed=2,
    )
    report = run(spec)
    assert report["forks"] == 0, report["fork_epochs"]
    assert report["global_steps"] >= 2
    assert report["share_in_committed_round_mean"] >= 0.5
    assert report["sim"]["churn_events"].get("kill", 0) >= 1
    assert "relay.connect" in report["control_by_method_per_peer_per_step"]  # the NATted peers' circuits
