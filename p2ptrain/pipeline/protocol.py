"""The pipeline's RPC vocabulary: a stage's forward, backward and commit, and the directory record.

Theory of operation: see docs/pipeline.md. ``pipeline_forward`` and ``pipeline_backward`` are streamed
calls: the header below, then the tensor's bytes (``codec``) in chunks under the transport's credit
window, answered by the output's bytes and a response header. ``pipeline_commit`` is unary: it adds
the pending gradients of the named micro-batches into the stage's sum (``keep``) or drops them.
Micro-batch ids are 16 random bytes the caller draws; a stage peer keys everything by the caller's
authenticated peer id and that id, so no caller can touch another's micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..net.rpc import Method
from ..wire.schema import Message, bounded

MB_ID_BYTES = 16
MAX_COMMITS = 256  # micro-batch ids per commit call


@dataclass(frozen=True)
class ForwardReq(Message):
    step: int = bounded(ge=0, le=2**62)
    stage: int = bounded(ge=0, le=63)
    mb: bytes = bounded(max_len=MB_ID_BYTES)
    shape: tuple[int, ...] = bounded(max_len=3)  # of the stage's input
    compression: str = bounded(max_len=16)
    # the last stage: the body is the input's bytes, then this many targets as little-endian int32
    targets: int = bounded(0, ge=0, le=2**31)


@dataclass(frozen=True)
class ForwardResp(Message):
    shape: tuple[int, ...] = bounded(max_len=3)  # the output's (the last stage: its input gradient's)
    loss: float = bounded(0.0, ge=0.0, le=1e6)  # the last stage: the micro-batch's mean loss


@dataclass(frozen=True)
class BackwardReq(Message):
    step: int = bounded(ge=0, le=2**62)
    stage: int = bounded(ge=0, le=63)
    mb: bytes = bounded(max_len=MB_ID_BYTES)
    shape: tuple[int, ...] = bounded(max_len=3)  # of the gradient for the stage's output
    compression: str = bounded(max_len=16)


@dataclass(frozen=True)
class BackwardResp(Message):
    shape: tuple[int, ...] = bounded(max_len=3)  # of the input gradient; () for the first stage


@dataclass(frozen=True)
class CommitReq(Message):
    step: int = bounded(ge=0, le=2**62)
    mbs: tuple[bytes, ...] = bounded(max_len=MAX_COMMITS)
    keep: bool = True  # False: drop them (a duplicated micro-batch's other peer)
    done: bool = False  # the caller sent every micro-batch of this step: it calls no more in it


@dataclass(frozen=True)
class CommitResp(Message):
    counted: int = bounded(ge=0, le=MAX_COMMITS)
    # the answering peer, as a caller, sent every micro-batch of the request's step (it told its "done"
    # to the stage peers it knew then: a peer that started serving after that never heard it)
    done: bool = False


FORWARD = Method("pipeline_forward", ForwardReq, ForwardResp, streaming=True)
BACKWARD = Method("pipeline_backward", BackwardReq, BackwardResp, streaming=True)
COMMIT = Method("pipeline_commit", CommitReq, CommitResp)

# Refusal codes a stage server answers with (RemoteCallError.code on the caller's side)
NOT_YET = "pipeline_not_yet"  # the server is still on an earlier step: ask again soon
STEP_CLOSED = "pipeline_closed"  # the server closed that step (it is averaging or moved on)
WRONG_STAGE = "pipeline_stage"  # the server does not serve the stage the caller thinks
BUSY = "pipeline_busy"  # too many micro-batches in flight here
UNKNOWN_MB = "pipeline_unknown"  # no forward state for that micro-batch (expired, or never sent)


@dataclass(frozen=True)
class StageRecord(Message, positional=True):
    """A stage peer's entry in the run's pipeline directory (an owner-signed DHT subkey)."""

    stage: int = bounded(ge=0, le=63)
    stages: int = bounded(ge=2, le=64)
    addresses: tuple[str, ...] = bounded((), max_len=8)
    throughput: float = bounded(0.0, ge=0.0, le=1e12)  # samples per second through this stage here
    queue: int = bounded(0, ge=0, le=1 << 20)  # micro-batches in flight here
    step: int = bounded(0, ge=0, le=2**62)
    published: float = bounded(0.0, ge=0.0)
    left: bool = False
    # not serving yet: waiting for the swarm to start, or downloading its stage's state (see ``trainer``)
    joining: bool = False
    digest: bytes = bounded(b"", max_len=16)  # of its stage's weights at the start of ``step``
    # bytes per second its stage server received request bodies at (its link, measured); 0: not yet
    bandwidth: float = bounded(0.0, ge=0.0, le=1e12)
