"""The exception hierarchy: every error says whose fault it is.

- ``LocalProtocolError``: we were asked to do something the protocol forbids (a bug or bad user input
  on this side).
- ``RemoteProtocolError``: the remote peer broke the protocol (malformed frame, bad signature, wrong
  schema). The connection it came on is closed; nothing it sent is applied.
- ``PeerUnavailable``: the remote could not be reached or went away (refused, timed out, closed).
- ``HandshakeRefused``: the remote (or we) refused a handshake for a stated reason (run id, version,
  peer id, limits). ``code`` is machine-readable, the message is for humans.
- ``RemoteCallError``: an RPC reached the remote and the remote answered with an error.
- ``GroupFormationFailed``, ``RoundAborted``: an averaging round did not form, or was aborted on every
  member (each keeps its own tensors).
"""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error p2ptrain raises on purpose."""


class ConfigError(P2PError):
    """A user-supplied setting, file or command-line value is invalid."""


class IdentityError(P2PError):
    """A key file is missing, malformed, or has unsafe permissions."""


class LocalProtocolError(P2PError):
    """This side tried something the protocol does not allow."""


class RemoteProtocolError(P2PError):
    """The remote peer sent something the protocol does not allow."""


class InvalidSignature(RemoteProtocolError):
    """A signature does not verify, or was made by a key other than the claimed peer's."""


class PeerUnavailable(P2PError):
    """The remote peer could not be reached, did not answer in time, or closed the connection."""


class ConnectionClosed(PeerUnavailable):
    """The connection was closed (by either side) while an operation was in progress."""


class DeadlineExceeded(PeerUnavailable):
    """An operation did not complete before its deadline."""


class HandshakeRefused(P2PError):
    """A handshake was refused for a stated reason.

    Args:
        code: Names the reason, machine-readable (``run_id``, ``version``, ``peer_id``, ``membership``,
            ...).
        reason: The reason, for humans.
        by_remote: True when the remote refused us, False when we refused the remote.
    """

    def __init__(self, code: str, reason: str, *, by_remote: bool) -> None:
        self.code = code
        self.reason = reason
        self.by_remote = by_remote
        who = "remote refused the handshake" if by_remote else "handshake refused"
        super().__init__(f"{who} ({code}): {reason}")


class RemoteCallError(P2PError):
    """An RPC reached the remote, and the remote answered with an error.

    Args:
        peer: The remote peer's id, shortened.
        method: The method called.
        code: One of ``unknown_method``, ``bad_request``, ``refused``, ``busy``, ``deadline``,
            ``internal``, or an application-defined code raised with
            [`CallRefused`][p2ptrain.errors.CallRefused].
        message: The remote's message, for humans.
    """

    def __init__(self, peer: str, method: str, code: str, message: str) -> None:
        self.peer = peer
        self.method = method
        self.code = code
        self.message = message
        super().__init__(f"peer {peer} answered {method!r} with {code}: {message}")


class CallRefused(P2PError):
    """Raised by an RPC handler to refuse a call with an application error code and message.

    The caller gets a [`RemoteCallError`][p2ptrain.errors.RemoteCallError] with the same code and message.

    Args:
        code: The application's error code.
        message: What went wrong, for humans.
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class GroupFormationFailed(P2PError):
    """Matchmaking could not form a group in time."""


class RoundAborted(P2PError):
    """An averaging round was aborted on every member; each keeps its own tensors."""


class GroupTooSmall(GroupFormationFailed):
    """Fewer peers than the minimum group size were ready to average in time."""


class SchemaMismatch(GroupFormationFailed):
    """The peers ready to average hold tensors of other shapes, dtypes, or compression than ours."""


class RoundTimedOut(RoundAborted):
    """An averaging round reached its deadline before every partition arrived; nothing was applied."""


def passing(e: BaseException) -> bool:
    """Whether ``e`` is a failure a live peer gives that its own next moment may undo, so that a caller
    with time left tries again instead of taking the peer for gone: "busy" (a handshake refused so, as a
    node whose inbound slots are full answers; or a call answered so, over a connection's or a peer's
    call limits), or the connection closed under the call (a node over its slots closes an idle
    connection as a round's member arrives, and the call may have been on its way). Anything else (a
    dial that finds nobody, a deadline, another refusal) is not."""
    if isinstance(e, (HandshakeRefused, RemoteCallError)):
        return e.code == "busy"
    return isinstance(e, ConnectionClosed)
