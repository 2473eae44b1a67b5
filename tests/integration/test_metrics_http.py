"""The metrics and health endpoints over real HTTP on loopback."""

from __future__ import annotations

from typing import Any

import trio

from p2ptrain.metrics import MAX_REQUEST_HEAD, serve_http


async def request(port: int, raw: bytes) -> tuple[str, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), body


async def test_metrics_health_and_refusals(nursery: trio.Nursery) -> None:
    state: dict[str, Any] = {"state": "starting", "traffic": {"bytes_sent": 5}}
    with trio.fail_after(20):
        port = await nursery.start(serve_http, "127.0.0.1", 0, lambda: state)
        line, body = await request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert line == "HTTP/1.1 503 Service Unavailable" and body == b"starting\n"
        state["state"] = "running"
        line, body = await request(port, b"GET /healthz HTTP/1.1\r\n\r\n")
        assert line == "HTTP/1.1 200 OK" and body == b"ok\n"
        line, body = await request(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert line == "HTTP/1.1 200 OK" and b"p2ptrain_sent_bytes_total 5\n" in body
        assert (await request(port, b"GET /secrets HTTP/1.1\r\n\r\n"))[0] == "HTTP/1.1 404 Not Found"
        assert (await request(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0].startswith("HTTP/1.1 405")
        assert (await request(port, b"garbage\r\n\r\n"))[0] == "HTTP/1.1 400 Bad Request"
        huge = b"GET /" + b"a" * (4 * MAX_REQUEST_HEAD) + b" HTTP/1.1\r\n\r\n"
        try:  # the server reads a bounded head, answers and hangs up (the rest may reset the socket)
            line, _ = await request(port, huge)
            assert line.startswith("HTTP/1.1 4")
        except trio.BrokenResourceError:
            pass
        assert (await request(port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] == "HTTP/1.1 200 OK"
        # A client that sends nothing does not hold up the others.
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        assert (await request(port, b"GET /healthz HTTP/1.1\r\n\r\n"))[0] == "HTTP/1.1 200 OK"
        await silent.aclose()
