"""Prometheus metrics and a health endpoint over plain HTTP, for operators and orchestrators.

``serve_http`` answers ``GET /metrics`` (Prometheus text format 0.0.4) and ``GET /healthz`` (200 while the
node runs, 503 while it starts or stops) on its own port. The server is deliberately tiny: one request
per connection, a bounded request head read under a timeout, no keep-alive; anything else gets 404 or
400. It exposes only what the status file holds: no keys, no addresses of other peers' private files.

Metric names start with ``p2ptrain_``; per-peer byte counters carry a shortened peer id label.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT = 5.0

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


def _line(name: str, value: Any, labels: Mapping[str, str] | None = None) -> str | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value):
        return None
    label = ""
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        label = "{" + inner + "}"
    return f"{name}{label} {value:g}" if isinstance(value, float) else f"{name}{label} {value}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(status: Mapping[str, Any]) -> str:
    """The status of a node (``Node.status()``, with its ``training`` section) as Prometheus text."""
    out: list[str] = []

    def metric(
        name: str, kind: str, help_: str, samples: Sequence[tuple[Any, Mapping[str, str] | None]]
    ) -> None:
        lines = [line for v, labels in samples if (line := _line(name, v, labels)) is not None]
        if lines:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

    metric(
        "p2ptrain_up",
        "gauge",
        "1 while the node runs",
        [(1 if status.get("state") == "running" else 0, None)],
    )
    uptime = (status.get("updated_at") or 0) - (status.get("started_at") or 0)
    metric("p2ptrain_uptime_seconds", "gauge", "Seconds since the node started", [(uptime, None)])
    metric(
        "p2ptrain_peers_known",
        "gauge",
        "Members of the run this node knows",
        [(len(status.get("members", [])), None)],
    )
    metric("p2ptrain_connections", "gauge", "Open connections", [(len(status.get("connections", [])), None)])
    traffic = status.get("traffic", {})
    metric(
        "p2ptrain_sent_bytes_total", "counter", "Bytes sent on the wire", [(traffic.get("bytes_sent"), None)]
    )
    metric(
        "p2ptrain_received_bytes_total", "counter", "Bytes received", [(traffic.get("bytes_received"), None)]
    )
    per_peer = [
        (c["bytes_sent"], {"peer": c["peer_id"][:12], "direction": "sent"})
        for c in status.get("connections", [])
    ]
    per_peer += [
        (c["bytes_received"], {"peer": c["peer_id"][:12], "direction": "received"})
        for c in status.get("connections", [])
    ]
    metric("p2ptrain_connection_bytes", "gauge", "Bytes on each open connection", per_peer)
    dht = status.get("dht", {})
    metric("p2ptrain_dht_contacts", "gauge", "Contacts in the routing table", [(dht.get("contacts"), None)])
    metric("p2ptrain_dht_records", "gauge", "Records stored here", [(dht.get("records"), None)])
    training = status.get("training")
    if training:
        for key, name, kind, help_ in _TRAINING:
            metric(name, kind, help_, [(training.get(key), None)])
        rounds = training.get("rounds", {})
        outcomes = [
            (rounds.get(k), {"outcome": k}) for k in ("averaged", "alone", "aborted", "no_group", "synced")
        ]
        metric("p2ptrain_rounds_total", "counter", "Global steps and rounds by outcome", outcomes)
        last = rounds.get("last", {})
        metric(
            "p2ptrain_last_round_seconds",
            "gauge",
            "Duration of the last averaging round",
            [(last.get("seconds"), None)],
        )
        metric(
            "p2ptrain_last_round_group_size",
            "gauge",
            "Members of the last round",
            [(last.get("group"), None)],
        )
        metric(
            "p2ptrain_banned_peers", "gauge", "Peers banned here", [(len(training.get("banned", {})), None)]
        )
        excluded = last.get("excluded", {})
        metric(
            "p2ptrain_last_round_excluded",
            "gauge",
            "Members left out of the last round",
            [(len(excluded), None)],
        )
        sync = training.get("state_sync", {})
        metric(
            "p2ptrain_state_sync_bytes",
            "gauge",
            "Bytes of the state download in progress",
            [(sync.get("received"), None)],
        )
        metric(
            "p2ptrain_state_sync_total_bytes",
            "gauge",
            "Size of the state being downloaded",
            [(sync.get("total"), None)],
        )
    return "\n".join(out) + "\n"


StatusFn = Callable[[], Mapping[str, Any]]


async def serve_http(
    host: str, port: int, status: StatusFn, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve /metrics and /healthz on (host, port) until cancelled; reports the bound port."""
    listeners = await trio.open_tcp_listeners(port, host=host or None)
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics on http://%s:%d/metrics, health on /healthz", host or "0.0.0.0", bound)
    task_status.started(bound)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            async with stream:
                with trio.move_on_after(REQUEST_TIMEOUT):
                    code, body, kind = _respond(await _read_head(stream), status)
                    head = (
                        f"HTTP/1.1 {code}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n"
                    )
                    await stream.send_all(head.encode() + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away: nothing to tell it

    await trio.serve_listeners(handle, listeners)


async def _read_head(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data and len(data) < MAX_REQUEST_HEAD:
        chunk = await stream.receive_some(MAX_REQUEST_HEAD)
        if not chunk:
            break
        data += chunk
    return data[:MAX_REQUEST_HEAD]


def _respond(head: bytes, status: StatusFn) -> tuple[str, bytes, str]:
    line = head.split(b"\n", 1)[0].decode("latin-1").strip().split()
    if len(line) != 3 or not line[2].startswith("HTTP/"):
        return "400 Bad Request", b"bad request\n", "text/plain"
    method, path = line[0], line[1].split("?", 1)[0]
    if method != "GET":
        return "405 Method Not Allowed", b"GET only\n", "text/plain"
    current = status()
    if path == "/metrics":
        return "200 OK", render(current).encode(), "text/plain; version=0.0.4; charset=utf-8"
    if path == "/healthz":
        if current.get("state") == "running":
            return "200 OK", b"ok\n", "text/plain"
        return "503 Service Unavailable", f"{current.get('state', 'unknown')}\n".encode(), "text/plain"
    return "404 Not Found", b"try /metrics or /healthz\n", "text/plain"
