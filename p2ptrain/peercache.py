"""A node's cache of the peers it knew recently, kept on disk so that a restart can find its swarm again.

The DHT keeps the addresses of the peers it knew most recently (verified by a handshake: the routing
table's). A node writes them to ``peers.json`` in its data directory every ``SAVE_EVERY`` seconds and when
it stops, and reads them when it starts: whenever its routing table runs empty (every peer it knew left,
or it restarted), the DHT bootstraps again from its join addresses *and* these, so a peer whose only
join address is gone still finds the peers it trained with. The file is this node's own writing, but it
is read as untrusted input all the same (bounded in size, each address parsed, bad ones skipped).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from .net.address import PeerAddress

log = logging.getLogger(__name__)

VERSION = 1
MAX_PEERS = 32
MAX_BYTES = 64 * 1024
SAVE_EVERY = 30.0  # seconds between two writes while the node runs


def load(path: Path) -> list[PeerAddress]:
    """The addresses in the cache at ``path``, newest first: [] when there is none, and (with a
    warning) when it cannot be read or parsed."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("cannot read the peer cache %s: %s", path, e)
        return []
    try:
        if len(data) > MAX_BYTES:
            raise ValueError(f"over {MAX_BYTES} bytes")
        doc = json.loads(data)
        peers = doc.get("peers") if isinstance(doc, dict) else None
        if not isinstance(peers, list) or doc.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} peer cache")
    except ValueError as e:
        log.warning("ignoring the peer cache %s: %s", path, e)
        return []
    out: list[PeerAddress] = []
    for text in peers[:MAX_PEERS]:
        try:
            addr = PeerAddress.parse(text) if isinstance(text, str) else None
        except ValueError:
            addr = None
        if addr is not None and addr.peer_id is not None:  # a cached address names its peer
            out.append(addr)
    return out


def save(path: Path, peers: Sequence[PeerAddress]) -> None:
    """Write ``peers`` (newest first, at most ``MAX_PEERS``) to ``path`` atomically; a failure is a
    warning (the cache is a convenience, never a reason to stop)."""
    doc = {"version": VERSION, "peers": [str(p) for p in peers if p.peer_id is not None][:MAX_PEERS]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the peer cache %s: %s", path, e)
