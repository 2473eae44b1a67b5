"""Prometheus text rendering of a node's status (pure, through ``prometheus_client``)."""

from __future__ import annotations

import math
import re

from p2ptrain.metrics import render

LINE = re.compile(r'^(# (HELP|TYPE) \w+ .+|\w+(\{(\w+="[^"\\]*(\\.[^"\\]*)*",?)+\})? -?[0-9.e+-]+|)$')

STATUS = {
    "state": "running",
    "started_at": 100.0,
    "updated_at": 160.5,
    "members": [{}, {}, {}],
    "connections": [
        {"peer_id": "ABCDEFGHIJKLMNOP", "bytes_sent": 10, "bytes_received": 20},
        {"peer_id": 'we"ird\\id', "bytes_sent": 1, "bytes_received": 2},
    ],
    "traffic": {"bytes_sent": 1000, "bytes_received": 2000},
    "dht": {"contacts": 5, "records": 7},
    "training": {
        "step": 12,
        "loss": 2.5,
        "val_loss": None,
        "samples_here": 640,
        "samples_per_s": 33.5,
        "swarm_samples_per_s": math.nan,
        "swarm_peers": 3,
        "compute_utilization": 0.93,
        "lr": 0.001,
        "rounds": {
            "averaged": 10,
            "alone": 1,
            "aborted": 2,
            "no_group": 0,
            "synced": 1,
            "last": {"seconds": 0.25, "group": 3, "excluded": {"x": "late"}},
        },
        "state_sync": {"received": 5, "total": 10},
    },
}


def test_every_line_is_valid_exposition_format_and_values_are_right() -> None:
    text = render(STATUS)
    assert text.endswith("\n")
    for line in text.splitlines():
        assert LINE.match(line), line
    values = {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    }
    assert values["p2ptrain_up"] == 1
    assert values["p2ptrain_uptime_seconds"] == 60.5
    assert values["p2ptrain_peers_known"] == 3
    assert values["p2ptrain_global_step"] == 12
    assert values["p2ptrain_samples_total"] == 640
    assert values['p2ptrain_rounds_total{outcome="aborted"}'] == 2
    assert values['p2ptrain_connection_bytes{direction="sent",peer="ABCDEFGHIJKL"}'] == 10
    assert values["p2ptrain_last_round_excluded"] == 1
    assert values["p2ptrain_state_sync_total_bytes"] == 10
    assert "# TYPE p2ptrain_samples_total counter" in text and "# TYPE p2ptrain_loss gauge" in text
    # Values that are unknown or not finite are left out rather than written as garbage.
    assert "p2ptrain_validation_loss" not in text and "p2ptrain_swarm_samples_per_second" not in text
    # Label values are escaped.
    assert 'peer="we\\"ird\\\\id"' in text


def test_a_stopped_node_without_training_renders_its_basics_only() -> None:
    text = render({"state": "stopped", "traffic": {}})
    assert "p2ptrain_up 0" in text
    assert "p2ptrain_global_step" not in text and "p2ptrain_sent_bytes_total" not in text
