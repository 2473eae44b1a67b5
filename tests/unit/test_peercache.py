"""The peer cache on disk: what is saved is read back, and a damaged or hostile file is ignored."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from p2ptrain import peercache
from p2ptrain.identity import Identity
from p2ptrain.net.address import PeerAddress


def addr(n: int) -> PeerAddress:
    peer = Identity.from_seed(bytes([n + 1]) * 32).peer_id
    return PeerAddress.parse(f"/ip4/198.18.0.{n + 1}/tcp/31337/p2p/{peer}")


def test_saved_peers_are_read_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "data" / "peers.json"  # (its folder is made when missing)
    peers = [addr(n) for n in range(40)]
    peercache.save(path, peers)
    assert peercache.load(path) == peers[: peercache.MAX_PEERS]
    assert not list(path.parent.glob(".*.tmp"))  # written through a temporary file, renamed


def test_no_cache_is_no_peers(tmp_path: Path) -> None:
    assert peercache.load(tmp_path / "peers.json") == []


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps([str(addr(0))]),  # not the document
        json.dumps({"version": 99, "peers": []}),
        json.dumps({"version": 1, "peers": "x"}),
        " " * (peercache.MAX_BYTES + 1),
    ],
)
def test_a_damaged_cache_is_ignored_with_a_warning(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "peers.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, "p2ptrain.peercache"):
        assert peercache.load(path) == []
    assert "ignoring the peer cache" in caplog.text


def test_bad_entries_are_skipped_the_good_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "peers.json"
    good = str(addr(1))
    bad = [3, "198.18.0.9:31337", "/ip4/nowhere/tcp/1", None]  # no peer id, not an address, not text
    path.write_text(json.dumps({"version": 1, "peers": [*bad, good]}))
    assert peercache.load(path) == [addr(1)]
