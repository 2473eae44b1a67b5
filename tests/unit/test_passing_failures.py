"""Which failures a caller with time left tries again (``errors.passing``): those a live peer gives
that its own next moment may undo, and nothing that says the peer is gone or refused for good."""

from __future__ import annotations

import pytest

from p2ptrain.errors import (
    ConnectionClosed,
    DeadlineExceeded,
    HandshakeRefused,
    PeerUnavailable,
    RemoteCallError,
    RemoteProtocolError,
    passing,
)


@pytest.mark.parametrize(
    ("error", "passes"),
    [
        (HandshakeRefused("busy", "too many connections; try later", by_remote=True), True),
        (RemoteCallError("ab..cd", "avg.part", "busy", "too many calls from this peer"), True),
        (ConnectionClosed("connection to ab..cd closed: remote closed: evicted: over 48"), True),
        (ConnectionClosed("connection lost while sending: connection reset"), True),
        (HandshakeRefused("run_id", "another run", by_remote=True), False),
        (HandshakeRefused("banned", "this peer is banned", by_remote=True), False),
        (RemoteCallError("ab..cd", "avg.part", "left_round", "it left the round"), False),
        (RemoteCallError("ab..cd", "avg.part", "refused", "no"), False),
        (PeerUnavailable("cannot reach 198.18.0.1:2000: connection refused"), False),
        (DeadlineExceeded("avg.part to ab..cd timed out after 12 s"), False),
        (RemoteProtocolError("a malformed frame"), False),
        (ValueError("not a network failure"), False),
    ],
)
def test_only_what_a_live_peer_undoes_passes(error: BaseException, passes: bool) -> None:
    assert passing(error) is passes
