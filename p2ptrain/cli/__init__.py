"""The ``p2ptrain`` command: keygen, id, node, average, ping, peers, status, authority, simulate.

One module per group of commands, each with its commands and their parsers (``add_parsers``): ``keys``
(keygen, id), ``node`` (node, average; a training node is ``train``'s), ``query`` (ping, peers,
status), ``authority``, ``simulate``. What they share (the one-line usage error, reading a node's flags,
starting a node) is ``common``'s; they import that module and nothing of each other's, and the light
commands (``id``, ``keygen``, ``ping``, ``peers``, ``status``) start without torch.

Every failure a user can cause (bad flag, unreadable key, unreachable peer, refused handshake) ends
with one line on stderr that says what went wrong, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from ..errors import ConfigError, IdentityError, P2PError
from ..malloc import M_ARENA_MAX, mallopt
from ..version import __version__
from . import authority, keys, node, query, simulate
from .common import UsageError

_LOG_LEVELS = ["debug", "info", "warning", "error"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="p2ptrain", description="Decentralized peer-to-peer training.")
    p.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    p.add_argument("--log-level", choices=_LOG_LEVELS, help="default: info for node, else warning")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (keys, node, query, authority, simulate):
        group.add_parsers(sub)
    for command in sub.choices.values():  # also after the command: p2ptrain node --log-level debug
        command.add_argument(
            "--log-level",
            choices=_LOG_LEVELS,
            default=argparse.SUPPRESS,
            help="default: info for node, else warning",
        )
    return p


class JsonFormatter(logging.Formatter):
    """One JSON object per line: for log collectors (``--log-format json``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(level: str, fmt: str = "text") -> None:
    if fmt == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
        return
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _fewer_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives every thread that allocates its own heap (up to 8 per core); the compute, hashing
    and snapshot threads each grew one to the size of a model's tensors, and freed memory stayed
    spread over them: a 124M-parameter node peaked at 10.9x its fp32 parameter bytes, 8.2-8.9x with
    two arenas. Same as MALLOC_ARENA_MAX=2, which, if set, wins. No effect on other C libraries."""
    mallopt(M_ARENA_MAX, arenas, "MALLOC_ARENA_MAX")


def main(argv: Sequence[str] | None = None) -> int:
    _fewer_malloc_arenas()
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = args.command in ("node", "average", "simulate")
    _setup_logging(args.log_level or ("info" if verbose else "warning"), getattr(args, "log_format", "text"))
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"p2ptrain {args.command}: {e}", file=sys.stderr)
        return 2
    except (ConfigError, IdentityError) as e:
        print(f"p2ptrain {args.command}: {e}", file=sys.stderr)
        return 2
    except P2PError as e:
        print(f"p2ptrain {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"p2ptrain {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["UsageError", "build_parser", "main"]
