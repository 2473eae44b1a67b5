"""The node's HTTP side over real HTTP on loopback: metrics, health, the status API and the live swarm
page, which a real headless browser (Chromium, from the distribution's packages) loads and renders."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import pytest
import trio

from p2ptrain.net import MemoryNetwork
from p2ptrain.node import Node, NodeConfig
from p2ptrain.web import serve_http
from tests.harness.identities import identity

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")


async def request(port: int, raw: bytes) -> tuple[str, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


def node_status() -> dict[str, Any]:
    """A status as ``Node.status()`` returns it, with its training section (see ``Trainer.status``)."""
    return {
        "peer_id": "Abcdefghijklmnopqrstuvwxyz123456",
        "run_id": "demo",
        "state": "starting",
        "pid": 4242,
        "started_at": 0.0,
        "updated_at": 100.0,
        "traffic": {"bytes_sent": 12_345_678, "bytes_received": 2345},
        "connections": [
            {
                "peer_id": "Peer2bcdefghijklmnopq",
                "remote": "198.18.0.2:4001",
                "bytes_sent": 5,
                "bytes_received": 7,
            }
        ],
        "members": [
            {"peer_id": "Peer2bcdefghijklmnopq", "reachable": True, "throughput": 33.3, "last_seen": 95.0}
        ],
        "training": {
            "step": 0,
            "loss": 5.0,
            "val_loss": float("nan"),
            "samples_per_s": 10.0,
            "swarm_samples_per_s": float("inf"),
            "swarm_peers": 2,
            "banned": {"Badkey..9999": "sent values that are not finite"},
            "rounds": {
                "averaged": 3,
                "alone": 0,
                "aborted": 1,
                "no_group": 0,
                "synced": 0,
                "last": {
                    "epoch": 2,
                    "outcome": "averaged",
                    "group": 2,
                    "shares": {"Abcdef..3456": 600, "Peer2b..nopq": 400},
                },
            },
        },
    }


async def test_metrics_health_status_api_and_refusals(nursery: trio.Nursery) -> None:
    state = node_status()
    with trio.fail_after(30):
        port = await nursery.start(serve_http, "127.0.0.1", 0, lambda: state)
        line, body = await request(port, get("/healthz"))
        assert line == "HTTP/1.1 503 " or line.startswith("HTTP/1.1 503"), line
        assert body == b"starting\n"
        state["state"] = "running"
        line, body = await request(port, get("/healthz"))
        assert line.startswith("HTTP/1.1 200") and body == b"ok\n"
        line, body = await request(port, get("/metrics?x=1"))
        assert line.startswith("HTTP/1.1 200") and b"p2ptrain_sent_bytes_total 1.2345678e+07\n" in body
        line, body = await request(port, get("/api/status"))
        assert line.startswith("HTTP/1.1 200")
        shown = json.loads(body)  # strict JSON: the NaN and the infinity became null
        assert shown["status"]["training"]["val_loss"] is None
        assert shown["status"]["training"]["swarm_samples_per_s"] is None
        # what anyone may read: no pid, no network address of a connection
        assert "pid" not in shown["status"] and "remote" not in shown["status"]["connections"][0]
        assert shown["history"] and shown["history"][0]["step"] == 0 and shown["history"][0]["loss"] == 5.0
        line, body = await request(port, get("/"))
        assert line.startswith("HTTP/1.1 200") and b"<title>p2ptrain swarm</title>" in body
        assert (await request(port, get("/secrets")))[0].startswith("HTTP/1.1 404")
        post = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        assert (await request(port, post))[0].startswith("HTTP/1.1 405")
        assert (await request(port, b"garbage\r\n\r\n"))[0].startswith("HTTP/1.1 400")
        huge = b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n"
        try:  # the server reads a bounded head, answers and hangs up (the rest may reset the socket)
            line, _ = await request(port, huge)
            assert line.startswith("HTTP/1.1 4"), line
        except trio.BrokenResourceError:
            pass
        # A client that sends nothing does not hold up the others.
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        assert (await request(port, get("/healthz")))[0].startswith("HTTP/1.1 200")
        await silent.aclose()


async def test_the_page_lists_this_node_once_at_the_rate_it_trains_now(nursery: trio.Nursery) -> None:
    """The peer list of the page is the run's, as the DHT holds it; there, this node's own entry is the
    record it last announced, at first one from before it trained (0 samples/s), replaced a minute or
    more later. Its row on the page says what it does now, and it has one row."""
    net = MemoryNetwork(seed=3)

    def node(name: str, **kw: Any) -> Node:
        config = NodeConfig(run_id="web", listen=((name, 1),), members_interval=0.2, **kw)
        return Node(identity(name), config, transport=net.transport(name), clock=trio.current_time)

    with trio.fail_after(30):
        other = await nursery.start(node("web0").run)
        me = await nursery.start(node("web1", join=(other.addresses[0],), metrics=("127.0.0.1", 0)).run)
        while len(me.members) < 2:  # noqa: ASYNC110  # both announced before they trained, and read back
            await trio.sleep(0.05)
        me.report_throughput(25.0)  # it trains now (what the trainer tells the node)
        line, body = await request(me.metrics_port, get("/api/status"))
    assert line.startswith("HTTP/1.1 200")
    rows = sorted((m["peer_id"], m["throughput"]) for m in json.loads(body)["status"]["members"])
    assert rows == sorted([(str(me.peer_id), 25.0), (str(other.peer_id), 0.0)])


@pytest.mark.skipif(BROWSER is None, reason="no Chromium here (.ci/run installs chromium-headless-shell)")
async def test_a_browser_renders_the_live_page_and_its_updates(nursery: trio.Nursery) -> None:
    """Chromium loads the page; its script polls /api/status and renders what the node reports, the
    curves from the history, then the next poll's changes (``--virtual-time-budget`` runs its timers)."""
    state = node_status()
    state["state"] = "running"
    with trio.fail_after(90):
        port = await nursery.start(
            lambda task_status: serve_http(
                "127.0.0.1", 0, lambda: state, sample_every=0.02, task_status=task_status
            )
        )
        for step in range(1, 8):  # a node that trains: the history records each step's loss
            state["training"] |= {"step": step, "loss": 5.0 - 0.25 * step}
            state["updated_at"] += 1.0
            await trio.sleep(0.05)
        assert BROWSER is not None
        shown = await trio.run_process(
            [
                BROWSER,
                "--no-sandbox",
                "--disable-gpu",
                "--virtual-time-budget=5000",
                "--dump-dom",
                f"http://127.0.0.1:{port}/",
            ],
            capture_stdout=True,
            capture_stderr=True,
        )
    dom = shown.stdout.decode()
    assert re.search(r'<body[^>]*data-rendered="([2-9]|\d\d+)"', dom), "the page did not poll again"
    assert '<b id="step">7</b>' in dom and '<b id="loss">3.2500</b>' in dom
    assert '<b id="val-loss">-</b>' in dom  # (unknown: NaN on the node)
    assert '<b id="bytes">12.3 MB / 2.3 kB</b>' in dom
    curve = re.search(r'<polyline class="series" data-name="training loss"[^>]* points="([^"]+)"', dom)
    assert curve is not None and len(set(curve.group(1).split())) >= 7  # one point per step seen
    assert re.search(r'data-name="the swarm"', dom) is None  # (an infinite swarm rate is not drawn)
    assert (
        '<tr data-peer="Peer2bcdefghijklmnopq">' in dom and "33.3" in dom and "12 s ago" in dom
    )  # (seen at 95, the status of 107)
    assert '<tr data-peer="Abcdef..3456">' in dom and '<tr data-peer="Peer2b..nopq">' in dom
    assert "sent values that are not finite" in dom
    assert 'id="error"></span>' in dom
