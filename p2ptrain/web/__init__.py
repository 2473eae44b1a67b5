"""The node's HTTP side: a live swarm page, Prometheus metrics and a health check (see ``server``)."""

from .server import History, WebApp, serve_http

__all__ = ["History", "WebApp", "serve_http"]
