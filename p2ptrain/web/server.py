"""A node's HTTP endpoints, served by hypercorn's trio worker with a small ASGI app.

- ``GET /``: a page that shows the swarm as this node sees it (peers, steps, loss curves, samples/s,
  rounds, bytes, who reduced what share of the last round, bans) and updates itself every few seconds.
- ``GET /api/status``: what the page reads: the node's public status (``node.public_status``: no pid,
  no network addresses of its connections) and the history of a few numbers since the server started.
- ``GET /metrics``: Prometheus text (``p2ptrain.metrics``, through ``prometheus_client``).
- ``GET /healthz``: 200 while the node runs, 503 while it starts or stops.

Anything else gets 404, a method other than GET or HEAD 405. Nothing is read from a request but its
method and path: the server answers no input.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from importlib import resources
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ..metrics import CONTENT_TYPE, render
from ..nodebase import public_status

log = logging.getLogger(__name__)

StatusFn = Callable[[], Mapping[str, Any]]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

HISTORY_POINTS = 3600  # one a second by default: the last hour
SAMPLE_EVERY = 1.0


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class History:
    """A few numbers of the status, one point per sample, the last ``points`` of them."""

    FIELDS = ("step", "loss", "val_loss", "samples_per_s", "swarm_samples_per_s", "swarm_peers")

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=points)

    def sample(self, status: Mapping[str, Any]) -> None:
        training = status.get("training") or {}
        traffic = status.get("traffic") or {}
        point = {"t": status.get("updated_at")} | {k: training.get(k) for k in self.FIELDS}
        point |= {"sent": traffic.get("bytes_sent"), "received": traffic.get("bytes_received")}
        self.points.append(finite(point))

    def json(self) -> list[dict[str, Any]]:
        return list(self.points)


class WebApp:
    """The ASGI application (see the module's docstring)."""

    def __init__(self, status: StatusFn, history: History | None = None) -> None:
        self.status = status
        self.history = history or History()
        self.page = resources.files(__package__).joinpath("page.html").read_bytes()

    def respond(self, method: str, path: str) -> tuple[int, bytes, str]:
        if method not in ("GET", "HEAD"):
            return 405, b"GET only\n", "text/plain"
        if path == "/":
            return 200, self.page, "text/html; charset=utf-8"
        current = self.status()
        if path == "/metrics":
            return 200, render(current).encode(), CONTENT_TYPE
        if path == "/healthz":
            if current.get("state") == "running":
                return 200, b"ok\n", "text/plain"
            return 503, f"{current.get('state', 'unknown')}\n".encode(), "text/plain"
        if path == "/api/status":
            # (the public form is JSON already: NaN and infinities read back as None)
            shown = json.loads(public_status(dict(current)), parse_constant=lambda _: None)
            body = json.dumps({"status": shown, "history": self.history.json()})
            return 200, body.encode(), "application/json"
        return 404, b"try /, /metrics, /healthz or /api/status\n", "text/plain"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        code, body, kind = self.respond(scope["method"], scope["path"])
        headers = [(b"content-type", kind.encode()), (b"cache-control", b"no-store")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


async def serve_http(
    host: str,
    port: int,
    status: StatusFn,
    *,
    sample_every: float = SAMPLE_EVERY,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the page, /api/status, /metrics and /healthz on (host, port) until cancelled; reports the
    bound port (``port`` 0: any free one)."""
    app = WebApp(status)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 5.0
    config.h11_max_incomplete_size = 8192

    async def sampling() -> None:
        while True:
            app.history.sample(status())
            await trio.sleep(sample_every)

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve, app, config)
        bound = int(binds[0].rsplit(":", 1)[1])
        log.info(
            "swarm page on http://%s:%d/ (metrics on /metrics, health on /healthz)", host or "0.0.0.0", bound
        )
        nursery.start_soon(sampling)
        task_status.started(bound)
