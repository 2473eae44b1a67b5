"""State download's wire protocol: the three methods a donor serves, their messages and their limits.

- ``train.state_info``: which state a donor offers (epoch, root digest, size, chunk count, header and
  metadata lengths), for the epoch the joiner asks for.
- ``train.state_manifest`` (stream): the layout header, the chunk hashes and the metadata of a snapshot
  named by its root.
- ``train.state_chunks`` (stream): a range of at most ``MAX_RANGE`` chunks of a snapshot named by its root.

The donor's side is :mod:`.serve`, the joiner's :mod:`.download`; what the root commits to is
:mod:`.chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...net.rpc import Method
from ...wire.schema import Message, bounded
from .chunks import HASH_BYTES as DIGEST_BYTES
from .chunks import MAX_CHUNKS

MAX_STATE_BYTES = 1 << 42
MAX_META_BYTES = 16 << 20
MAX_RANGE = 64  # chunks one request may ask for


@dataclass(frozen=True)
class StateInfoReq(Message):
    epoch: int = bounded(0, ge=0, le=2**53)  # the epoch the joiner wants, if the donor still holds it


@dataclass(frozen=True)
class StateInfo(Message):
    epoch: int = bounded(ge=0, le=2**53)
    root: bytes = bounded(max_len=DIGEST_BYTES)
    size: int = bounded(ge=0, le=MAX_STATE_BYTES)
    chunks: int = bounded(ge=0, le=MAX_CHUNKS)
    header: int = bounded(ge=0, le=16 << 20)  # header bytes
    meta: int = bounded(ge=0, le=MAX_META_BYTES)  # metadata bytes


@dataclass(frozen=True)
class ManifestReq(Message):
    root: bytes = bounded(max_len=DIGEST_BYTES)


@dataclass(frozen=True)
class ChunksReq(Message):
    root: bytes = bounded(max_len=DIGEST_BYTES)
    first: int = bounded(ge=0, le=MAX_CHUNKS)
    count: int = bounded(ge=1, le=MAX_RANGE)


@dataclass(frozen=True)
class StreamDone(Message):
    ok: bool = True


STATE_INFO = Method("train.state_info", StateInfoReq, StateInfo)
STATE_MANIFEST = Method("train.state_manifest", ManifestReq, StreamDone, streaming=True)
STATE_CHUNKS = Method("train.state_chunks", ChunksReq, StreamDone, streaming=True)
