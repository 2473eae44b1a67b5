"""A training state as fixed-size chunks: the layout, per-chunk hashes, and the digest that commits to them.

Theory of operation
-------------------
A state (model, optimizer state, ...) is a set of named tensors. Its *layout* lists them sorted by name,
each with its dtype, shape and ``[begin, end)`` byte range in one virtual data section where they lie
back to back, exactly like a safetensors data section (the header is a safetensors header without the
``__metadata__`` entry). The data section is cut into chunks of :data:`CHUNK` bytes (the last may be
shorter); a chunk may span several small tensors. Each chunk has a BLAKE2b hash.

The state's *root* digest commits to everything a joiner must be able to check on arrival:

    root = BLAKE2b-256("p2ptrain-state2": epoch, len(header), header, CHUNK, n, hash_0 .. hash_n-1)

Peers publish the root of the state they start each global step from (their progress records). A joiner
that knows which root to expect fetches a donor's header and hash list, recomputes the root, and from
then on checks every chunk against its hash the moment it arrives: a bad chunk is refetched from another
donor and its sender named, without waiting for the end of a multi-gigabyte transfer. Since the epoch is
inside the root, a verified state also says which global step it is; nobody's word is needed for that.

Hashing reads live tensors without copying them (a GPU tensor is copied to the host one chunk at a time)
and releases the GIL, so callers run it in a worker thread for large states; the caller guarantees that
nothing writes to the tensors meanwhile.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ...errors import LocalProtocolError
from . import codec
from .codec import Source, StateError

CHUNK = 1 << 20
"""Bytes per chunk: one channel record, so a chunk travels (and is decrypted) in one piece."""

HASH_BYTES = 32
MAX_CHUNKS = 1 << 22
"""Most chunks a state may have (4 TiB at 1 MiB each): bounds a hash list before it is read."""

_ROOT_PERSON = b"p2ptrain-state2"
_CHUNK_PERSON = b"p2ptrain-chunk1"


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Span:
    """Bytes ``[lo, hi)`` of ``entries[index]``, at ``offset`` within their chunk."""

    index: int
    lo: int
    hi: int
    offset: int


class Layout:
    """Where each tensor of a state lies in the chunked data section."""

    def __init__(self, entries: Sequence[Entry], header: bytes) -> None:
        self.entries = tuple(entries)
        self.header = header
        self.size = self.entries[-1].end if self.entries else 0
        self.chunks = -(-self.size // CHUNK)
        self._starts = [e.begin for e in self.entries]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of ``tensors`` (names sorted, tensors back to back)."""
        entries, offset, header = [], 0, {}
        for name in sorted(tensors):
            t = tensors[name]
            dtype_name = codec.dtype_name(t, name)
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(name, t.dtype, tuple(t.shape), offset, offset + nbytes))
            header[name] = {
                "dtype": dtype_name,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        return cls(entries, json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode())

    @classmethod
    def parse(cls, header: bytes, *, max_tensors: int = 100_000) -> Layout:
        """Validate a header from the network: strict JSON, known dtypes, offsets that tile the data
        section in name order. Raises :class:`StateError`."""
        if len(header) > codec.MAX_HEADER:
            raise StateError(f"state header is {len(header)} bytes, over {codec.MAX_HEADER}")
        doc = codec.parse_json(header, "state header")
        if not isinstance(doc, dict):
            raise StateError(f"state header is a JSON {type(doc).__name__}, not an object")
        if len(doc) > max_tensors:
            raise StateError(f"state declares {len(doc)} tensors, over the limit of {max_tensors}")
        entries = []
        cursor = 0
        for name in sorted(doc):
            begin, end, _, dtype, shape = codec.check_entry(codec.check_name(name), doc[name], 1 << 62)
            if begin != cursor:
                raise StateError(f"tensor {name!r} starts at byte {begin}, not {cursor}: out of name order")
            entries.append(Entry(name, dtype, tuple(shape), begin, end))
            cursor = end
        layout = cls(entries, bytes(header))
        if layout.chunks > MAX_CHUNKS:
            raise StateError(f"state of {layout.size} bytes has more than {MAX_CHUNKS} chunks")
        return layout

    def chunk_size(self, i: int) -> int:
        return min(CHUNK, self.size - i * CHUNK)

    def spans(self, i: int) -> Iterator[Span]:
        """The tensor byte ranges chunk ``i`` covers, in order."""
        lo, hi = i * CHUNK, min((i + 1) * CHUNK, self.size)
        k = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while k < len(self.entries) and self.entries[k].begin < hi:
            e = self.entries[k]
            a, b = max(lo, e.begin), min(hi, e.end)
            if b > a:
                yield Span(k, a - e.begin, b - e.begin, a - lo)
            k += 1

    def describe(self) -> str:
        return f"{len(self.entries)} tensors, {self.size / 1e6:.1f} MB in {self.chunks} chunks"


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (on its own device)."""
    t = tensor.detach()
    if not t.is_contiguous():
        raise LocalProtocolError("layout tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def chunk_pieces(
    layout: Layout, tensors: Sequence[torch.Tensor], i: int, source: Source | None = None
) -> list[memoryview | bytes | bytearray]:
    """Chunk ``i``'s bytes as host memoryviews (views of CPU tensors; GPU bytes copied, one span at a time;
    the tensors ``source`` owns read through it: file-backed ones, whose pages reading in place would map
    into the process).

    ``tensors`` are in layout order."""
    out: list[memoryview | bytes | bytearray] = []
    for span in layout.spans(i):
        t = tensors[span.index]
        if source is not None and source.owns(t):
            out.append(source.read(t, span.lo, span.hi))
            continue
        raw = _bytes_of(t)[span.lo : span.hi]
        if raw.device.type != "cpu":
            raw = raw.cpu()
        out.append(raw.numpy().data)
    return out


def hash_chunk(pieces: Sequence[memoryview | bytes | bytearray]) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_CHUNK_PERSON)
    for piece in pieces:
        h.update(piece)
    return h.digest()


HASH_THREADS_MAX = 8
"""The most threads one state's chunks are hashed on (blake2b runs at ~1.4 GB/s on one core: 8 GB of a
1B-parameter DiLoCo state took 6 s on one thread)."""
PARALLEL_CHUNKS = 64
"""States of fewer chunks are hashed on the calling thread alone."""


def hash_workers(count: int) -> int:
    """Threads to hash ``count`` chunks on: as many as torch computes on (the node's ``threads``: hashing
    takes no more cores than training was given), at most ``HASH_THREADS_MAX``; 1 below
    ``PARALLEL_CHUNKS`` chunks (hashlib releases the GIL while it hashes)."""
    return max(1, min(HASH_THREADS_MAX, torch.get_num_threads(), count // PARALLEL_CHUNKS))


def hash_chunks(layout: Layout, tensors: Sequence[torch.Tensor], source: Source | None = None) -> list[bytes]:
    """Every chunk's hash (reads the tensors in place; run it in a thread for large states), on
    :func:`hash_workers` threads: chunks are independent."""

    def one(i: int) -> bytes:
        return hash_chunk(chunk_pieces(layout, tensors, i, source))

    workers = hash_workers(layout.chunks)
    if workers == 1:
        return [one(i) for i in range(layout.chunks)]
    with ThreadPoolExecutor(workers, thread_name_prefix="p2ptrain-hash") as pool:
        return list(pool.map(one, range(layout.chunks)))


def hash_each(
    count: int, chunk: Callable[[int], bytes | bytearray], then: Callable[[int, bytes | bytearray], None]
) -> list[bytes]:
    """Chunks ``chunk(0)`` .. ``chunk(count - 1)`` made in order on the calling thread (a site assembles
    each on rank 0 from its ranks' shards, collectives in a fixed order), each hashed and handed to
    ``then(i, data)`` on :func:`hash_workers` threads meanwhile; their hashes, in order. At most two
    chunks per thread wait to be hashed."""
    workers = hash_workers(count)
    if workers == 1:
        out = []
        for i in range(count):
            data = chunk(i)
            out.append(hash_chunk([data]))
            then(i, data)
        return out

    def one(i: int, data: bytes | bytearray) -> bytes:
        then(i, data)
        return hash_chunk([data])

    with ThreadPoolExecutor(workers, thread_name_prefix="p2ptrain-hash") as pool:
        pending: list[Future[bytes]] = []
        for i in range(count):
            if i >= 2 * workers:
                pending[i - 2 * workers].result()  # (bounded: the oldest is done before the next is made)
            pending.append(pool.submit(one, i, chunk(i)))
        return [f.result() for f in pending]


def root(epoch: int, layout: Layout, hashes: Sequence[bytes]) -> bytes:
    """The digest peers publish: commits to the epoch, the layout and every chunk's hash."""
    if len(hashes) != layout.chunks:
        raise LocalProtocolError(f"{len(hashes)} chunk hashes for {layout.chunks} chunks")
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_ROOT_PERSON)
    h.update(struct.pack("<QQ", epoch, len(layout.header)))
    h.update(layout.header)
    h.update(struct.pack("<QQ", CHUNK, layout.chunks))
    for x in hashes:
        h.update(x)
    return h.digest()


def split_hashes(raw: bytes | memoryview, count: int) -> list[bytes]:
    if len(raw) != count * HASH_BYTES:
        raise StateError(f"hash list is {len(raw)} bytes, {count} chunks need {count * HASH_BYTES}")
    mv = memoryview(raw)
    return [bytes(mv[i * HASH_BYTES : (i + 1) * HASH_BYTES]) for i in range(count)]


def empty_like(layout: Layout) -> list[torch.Tensor]:
    """Fresh CPU tensors to receive a state of this layout (pages untouched until written)."""
    return [torch.empty(e.shape, dtype=e.dtype) for e in layout.entries]


def place(layout: Layout, tensors: Sequence[torch.Tensor], i: int, data: memoryview) -> None:
    """Copy chunk ``i``'s bytes into ``tensors`` (CPU, layout order)."""
    for span in layout.spans(i):
        dst = _bytes_of(tensors[span.index])[span.lo : span.hi]
        dst.numpy().data[:] = data[span.offset : span.offset + span.hi - span.lo]


def check_bool_entries(layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
    """BOOL tensors must hold 0 or 1 (other bytes are not valid torch booleans)."""
    for e, t in zip(layout.entries, tensors, strict=True):
        if e.dtype == torch.bool and t.numel() and bool((t.view(torch.uint8) > 1).any()):
            raise StateError(f"tensor {e.name!r}: BOOL bytes must be 0 or 1")


def as_dict(layout: Layout, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {e.name: t for e, t in zip(layout.entries, tensors, strict=True)}
