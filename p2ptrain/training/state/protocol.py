"""State sync's wire protocol: the methods a donor serves, their messages and their limits.

A state download (the donor's side is :mod:`.serve`, the joiner's :mod:`.download`; what the root
commits to is :mod:`.chunks`):

- ``train.state_info``: which state a donor offers (epoch, root digest, size, chunk count, header and
  metadata lengths), for the epoch the joiner asks for.
- ``train.state_manifest`` (stream): the layout header, the chunk hashes and the metadata of a snapshot
  named by its root.
- ``train.state_chunks`` (stream): a range of at most ``MAX_RANGE`` chunks of a snapshot named by its root.

A replay of the steps a peer missed (the holder's side is :mod:`.replay`'s ``ResultStore``, the fetching
peer's :mod:`.replay` and :mod:`.result_pieces`):

- ``train.results_info``: the results a peer holds from a step on (``ResultEntry``: step, slots, form,
  size, and its own digests of the state before and after).
- ``train.result_pieces``: how the holder splits one result into pieces, and each piece's hash.
- ``train.result_data`` (stream): a range of one result's bytes, the result named by its step and its
  ``after`` digest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ...net.rpc import Method
from ...wire.schema import Message, bounded
from .chunks import HASH_BYTES, MAX_CHUNKS
from .chunks import HASH_BYTES as DIGEST_BYTES

MAX_STATE_BYTES = 1 << 42
MAX_META_BYTES = 16 << 20
MAX_RANGE = 64  # chunks one request may ask for
MAX_KEPT = 64  # results one peer may hold (and list in one answer)
MAX_RESULT_BYTES = 1 << 40
MAX_PIECES = 256  # pieces one result is hashed in, at most (their hashes: 8 KB)
RECORD = 1 << 20  # bytes per stream record of a result
_PIECE_PERSON = b"p2pt-rpiece"


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


@dataclass(frozen=True)
class ResultEntry(Message):
    """One committed step's result a peer holds: it takes the state of ``epoch`` to ``epoch + 1``."""

    epoch: int = bounded(ge=0, le=2**53)
    first: int = bounded(ge=0, le=2**31)  # the parameters it updates: ``range(first, stop)``
    stop: int = bounded(ge=0, le=2**31)
    dtype: str = bounded(max_len=16)
    size: int = bounded(ge=0, le=MAX_RESULT_BYTES)  # bytes
    before: bytes = bounded(max_len=HASH_BYTES)  # the holder's digest of ``epoch``'s state
    after: bytes = bounded(max_len=HASH_BYTES)  # ... and of ``epoch + 1``'s


@dataclass(frozen=True)
class ResultsReq(Message):
    first: int = bounded(ge=0, le=2**53)  # the oldest step wanted


@dataclass(frozen=True)
class ResultsInfo(Message):
    entries: tuple[ResultEntry, ...] = bounded((), max_len=MAX_KEPT)


@dataclass(frozen=True)
class ResultReq(Message):
    epoch: int = bounded(ge=0, le=2**53)
    after: bytes = bounded(max_len=HASH_BYTES)
    offset: int = bounded(0, ge=0, le=MAX_RESULT_BYTES)  # (data) the bytes wanted: from ``offset``...
    length: int = bounded(0, ge=0, le=MAX_RESULT_BYTES)  # ... this many (0: to the end)


@dataclass(frozen=True)
class ResultPieces(Message):
    """How a holder splits one result into pieces, and each piece's hash: what a peer fetching the result
    from several holders checks each piece against (see ``result_pieces``)."""

    piece: int = bounded(ge=1, le=MAX_RESULT_BYTES)  # bytes per piece (the last may be shorter)
    hashes: bytes = bounded(max_len=MAX_PIECES * HASH_BYTES)


RESULTS_INFO = Method("train.results_info", ResultsReq, ResultsInfo)
RESULT_DATA = Method("train.result_data", ResultReq, StreamDone, streaming=True)
RESULT_PIECES = Method("train.result_pieces", ResultReq, ResultPieces)


def piece_bytes(size: int, least: int) -> int:
    """The piece size a holder hashes a result of ``size`` bytes in: ``least``, or larger where that many
    pieces' hashes would not fit one answer (``MAX_PIECES``)."""
    return max(1, least, -(-size // MAX_PIECES))


def hash_piece(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES, person=_PIECE_PERSON).digest()


def hash_pieces(data: bytes | memoryview, piece: int) -> bytes:
    """The hashes of ``data``'s pieces of ``piece`` bytes, one after the other."""
    view = memoryview(data)
    return b"".join(hash_piece(view[at : at + piece]) for at in range(0, len(view), piece))
