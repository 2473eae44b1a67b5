"""A node's status as Prometheus metrics, through ``prometheus_client``.

:func:`render` turns what ``Node.status()`` returns (with its ``training`` section) into the Prometheus
text format; ``p2ptrain.web`` serves it on ``/metrics``. Metric names start with ``p2ptrain_``; per-peer
byte gauges carry a shortened peer id label. Values that are unknown or not finite are left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TRAINING: list[tuple[str, str, str, str]] = [
    # (status key, metric name, type, help)
    ("step", "p2ptrain_global_step", "gauge", "Global steps this node has reached"),
    ("loss", "p2ptrain_loss", "gauge", "Smoothed training loss"),
    ("val_loss", "p2ptrain_validation_loss", "gauge", "Last validation loss"),
    ("samples_here", "p2ptrain_samples_total", "counter", "Samples this node has processed"),
    ("samples_per_s", "p2ptrain_samples_per_second", "gauge", "This node's samples per second"),
    ("swarm_samples_per_s", "p2ptrain_swarm_samples_per_second", "gauge", "The swarm's samples per second"),
    ("swarm_peers", "p2ptrain_peers_on_step", "gauge", "Peers working on this node's step"),
    ("compute_utilization", "p2ptrain_compute_utilization", "gauge", "Time in compute over wall time"),
    ("lr", "p2ptrain_learning_rate", "gauge", "Current (inner) learning rate"),
]

Sample = tuple[Any, Sequence[str]]  # a value and its label values


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _family(
    name: str, kind: str, help_: str, samples: Sequence[Sample], labels: Sequence[str] = ()
) -> Metric | None:
    kept = [(v, ls) for value, ls in samples if (v := _number(value)) is not None]
    if not kept:
        return None
    family: CounterMetricFamily | GaugeMetricFamily
    if kind == "counter":
        family = CounterMetricFamily(name, help_, labels=labels)
    else:
        family = GaugeMetricFamily(name, help_, labels=labels)
    for value, ls in kept:
        family.add_metric(list(ls), value)
    return family


def families(status: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of one status."""

    def one(name: str, kind: str, help_: str, value: Any) -> Metric | None:
        return _family(name, kind, help_, [(value, ())])

    out: list[Metric | None] = [
        one("p2ptrain_up", "gauge", "1 while the node runs", 1 if status.get("state") == "running" else 0),
        one(
            "p2ptrain_uptime_seconds",
            "gauge",
            "Seconds since the node started",
            (status.get("updated_at") or 0) - (status.get("started_at") or 0),
        ),
        one(
            "p2ptrain_peers_known",
            "gauge",
            "Members of the run this node knows",
            len(status.get("members", [])),
        ),
        one("p2ptrain_connections", "gauge", "Open connections", len(status.get("connections", []))),
    ]
    traffic = status.get("traffic", {})
    out.append(
        one("p2ptrain_sent_bytes_total", "counter", "Bytes sent on the wire", traffic.get("bytes_sent"))
    )
    out.append(
        one("p2ptrain_received_bytes_total", "counter", "Bytes received", traffic.get("bytes_received"))
    )
    conns = status.get("connections", [])
    per_peer = [(c["bytes_sent"], (c["peer_id"][:12], "sent")) for c in conns]
    per_peer += [(c["bytes_received"], (c["peer_id"][:12], "received")) for c in conns]
    out.append(
        _family(
            "p2ptrain_connection_bytes",
            "gauge",
            "Bytes on each open connection",
            per_peer,
            ("peer", "direction"),
        )
    )
    dht = status.get("dht", {})
    out.append(one("p2ptrain_dht_contacts", "gauge", "Contacts in the routing table", dht.get("contacts")))
    out.append(one("p2ptrain_dht_records", "gauge", "Records stored here", dht.get("records")))
    training = status.get("training")
    if training:
        out += [one(name, kind, help_, training.get(key)) for key, name, kind, help_ in _TRAINING]
        rounds = training.get("rounds", {})
        outcomes = [(rounds.get(k), (k,)) for k in ("averaged", "alone", "aborted", "no_group", "synced")]
        out.append(
            _family(
                "p2ptrain_rounds_total",
                "counter",
                "Global steps and rounds by outcome",
                outcomes,
                ("outcome",),
            )
        )
        last = rounds.get("last", {})
        out += [
            one(
                "p2ptrain_last_round_seconds",
                "gauge",
                "Duration of the last averaging round",
                last.get("seconds"),
            ),
            one("p2ptrain_last_round_group_size", "gauge", "Members of the last round", last.get("group")),
            one("p2ptrain_banned_peers", "gauge", "Peers banned here", len(training.get("banned", {}))),
            one(
                "p2ptrain_last_round_excluded",
                "gauge",
                "Members left out of the last round",
                len(last.get("excluded", {})),
            ),
        ]
        sync = training.get("state_sync", {})
        out += [
            one(
                "p2ptrain_state_sync_bytes",
                "gauge",
                "Bytes of the state download in progress",
                sync.get("received"),
            ),
            one(
                "p2ptrain_state_sync_total_bytes",
                "gauge",
                "Size of the state being downloaded",
                sync.get("total"),
            ),
        ]
    yield from (f for f in out if f is not None)


class _Once:
    """A collector of one status (a registry per rendering: nothing is kept between scrapes)."""

    def __init__(self, status: Mapping[str, Any]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        return families(self.status)


def render(status: Mapping[str, Any]) -> str:
    """The status of a node (``Node.status()``) as Prometheus text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Once(status))
    return generate_latest(registry).decode()
