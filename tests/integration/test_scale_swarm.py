"""The scale simulator as a test tool: the real node (host, DHT, relays, averager, collaborative
optimizer) at 8 peers on the message-level network, a minute of virtual time, with NATs and crashes; the
invariants hold (no fork: every step's parameters are the same bits on every peer that took it, so
every committed round was identical on its members)."""

from __future__ import annotations

import pytest

from simulations.scale.model import Churn
from simulations.scale.swarm import DROP_CAUSES, SwarmSpec, run

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


def test_thirty_two_peers_over_two_keys_with_nats_and_crashes_hold_the_scale_invariants() -> None:
    """32 peers for a minute of virtual time (about a minute of CPU), a fifth behind NATs, crashes
    (about six), the records over two keys: no fork, steps taken, most live peers in each committed
    round, and no node sending over ten times the median node's control bytes (the issue's hot-spot
    bound; 1.3 to 1.7 times here).

    Measured (runs differ in the order of tasks ready at one instant; "A member dead as its group
    formed" and "Results lost with their reducer" in docs/scale.md): the window held 4 committed
    rounds in 29 of 34 runs before the fix of a member dead as its group formed, and in 17 of 19 after
    it. What held the others, and left 5 to 9 live peers out of two steps' rounds in some, was a
    reducer killed with its partition's result: members waited for it until the gather deadline (fixed
    since: they give it up within seconds). A reducer killed after the decision still costs its round
    (an abort, and a second group of the step some 8 s later), which this 30-second window may not
    hold: hence the bounds here, which catch a swarm that stops or splits, not those losses."""
    spec = SwarmSpec(
        peers=32,
        duration=60.0,
        warmup=30.0,
        join_spread=8.0,
        batches_per_step=4,
        nat_share=0.2,
        churn=Churn(kill=20.0),
        seed=3,
        buckets=2,
    )
    report = run(spec)
    assert report["forks"] == 0, report["fork_epochs"]
    assert report["global_steps"] >= 2, report
    assert report["share_in_committed_round_mean"] >= 0.75, report
    assert report["max_node_control_over_median"] <= 10.0, report
    # every forgotten replica set is counted under a named cause (what the ``dropped`` lookups follow)
    drops = report["replicas_dropped_per_peer_per_step"]
    assert set(drops) <= set(DROP_CAUSES.values()), drops
    assert drops.get("a replica failed a read", 0) > 0, drops  # (crashed replicas)
    assert report["sim"]["churn_events"].get("kill", 0) >= 1
    assert "relay.connect" in report["control_by_method_per_peer_per_step"]
