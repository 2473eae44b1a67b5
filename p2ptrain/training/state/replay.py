"""Catching up by replay: a peer a few steps behind applies the missed steps' committed results.

Theory of operation. Every chunk of the state changes in a global step (the parameters, Adam's moments,
DiLoCo's outer momentum), so a state download is obsolete the moment the swarm steps again: a peer whose
download takes about as long as a step would download at every step and never average. What changes the
state in a step is small and deterministic, though: every member applies the same committed result (the
averaged gradient in sync mode, the averaged pseudo-gradient of the step's fragment in DiLoCo) with the
same optimizer, and the states stay bit-identical. So each peer keeps the results of its last
``statesync.replay_steps`` global steps (:class:`ResultStore`: in an unnamed spill file, losslessly in
fp16 or bf16 when the round's compression made every value one of those, and in int8's or top-k's own
form, see ``result_codec``) and serves them by step; a peer
``k <= replay_steps`` steps behind fetches the ``k`` results (:class:`ResultFetcher`: all steps at once,
and each step's result piece by piece from every holder of it at once, see ``result_pieces``) and
applies them in order, between two batches.

The invariant: *a peer k <= K steps behind reaches the swarm's step by applying the missed steps'
results, each verified against the digest chain of trusted records, with bytes proportional to k
results, not to the state.* It holds by construction:

- A replay starts only from a state whose digest the trusted records of its step name (else: a download).
- A result is fetched only from an entry whose ``after`` digest is the one trusted records publish for the
  next step, and whose ``before`` is the chain so far; its slots, dtype and size must be exactly those of
  this peer's own parameters for that step (nothing else is read), its values finite and within the
  R1 bound (``averaging.bounds``: ``BOUND`` times the size of the last result this peer applied itself).
- Every piece of a result matches the piece hashes of one holder, the step's *reference* (a holder whose
  own pieces contradict its own hashes is blamed at once).
- After each result is applied the state is hashed and compared with the trusted digest of that step.
  A mismatch names the reference (it is blamed: nothing more is fetched from it) and, the state being off
  the chain now, the peer downloads the state (``download``), once. A match blames the holders whose
  pieces differed from the reference's (their bytes differed from bytes now proven right).
- Nothing is believed because several ids say it: entries only say where to fetch; the trusted digests
  alone decide what is applied.

A steps-behind count above ``K``, a start from an unvouched state, or no peer serving a step's result all
lead to the full download, as before.

The wire protocol (``train.results_info``, ``train.result_pieces``, ``train.result_data``; the holder's
side is :class:`ResultStore`) is in ``protocol``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import trio

from ...averaging.bounds import BOUND, SLACK, Scale
from ...averaging.spill import SPILL_BYTES, Spilled, SpillFile
from ...errors import CallRefused, P2PError, PeerUnavailable, RemoteProtocolError
from ...identity import PeerID
from ...net.connection import Connection
from ...net.host import Host
from ...net.rpc import CallContext, RpcRegistry
from ...net.slots import ServingSlots
from ...net.streams import RpcStream
from ..optimizer.progress import PeerProgress
from . import result_codec
from .protocol import (
    MAX_KEPT,
    RECORD,
    RESULT_DATA,
    RESULT_PIECES,
    RESULTS_INFO,
    ResultEntry,
    ResultPieces,
    ResultReq,
    ResultsInfo,
    ResultsReq,
    StreamDone,
    hash_pieces,
    piece_bytes,
)
from .result_pieces import Refuted, fetch_pieces

log = logging.getLogger("p2ptrain.training.state.replay")

MAX_ASKED = 8  # peers asked what they hold, per catch-up
DIGEST_TRIES = 10  # asks for the results this many times while the digests they lead to are unknown...
DIGEST_WAIT = 1.0  # ...this many seconds apart
HASH_INLINE = 1 << 20  # a result this small is hashed on the event loop, a larger one in a thread
PIECE_LEAST = 4 << 20  # the smallest piece a holder hashes a result in (a smaller result is one piece)
WINDOW = 1 << 22  # elements of a result kept or checked at a time
SEND_WINDOW = 4 << 20  # bytes of a result a data stream reads and holds at a time
READ_INLINE = 1 << 20  # a spilled result's window this small is read on the event loop, a larger in a thread
# Results that hold fewer bytes than this in all are replayed whatever the state's size: under a second on
# a 10 Mbit/s link, and a replay keeps what the peer computed meanwhile.
REPLAY_SLACK = 1 << 20
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def flat_of(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values`` as one 1-D CPU tensor, in order: a view, with no copy, where they are consecutive views
    of one storage (a contribution's flat buffer, a site's wire buffer in a mapped file); else a copy."""
    if not values:
        return torch.empty(0)
    first = values[0].detach()
    at, total = first.storage_offset(), 0
    storage = first.untyped_storage().data_ptr()
    for v in values:
        if (
            v.device.type != "cpu"
            or v.dtype != first.dtype
            or not v.is_contiguous()
            or v.untyped_storage().data_ptr() != storage
            or v.storage_offset() != at + total
        ):
            return torch.cat([v.detach().reshape(-1).to("cpu") for v in values])
        total += v.numel()
    return first.as_strided((total,), (1,), at)


def windows(flat: torch.Tensor, size: int = 0) -> Iterator[torch.Tensor]:
    """``flat`` in consecutive views of at most ``size`` (``WINDOW``) elements (work over a result a window
    at a time: no temporary as large as the result)."""
    size = size or WINDOW
    for at in range(0, flat.numel(), size):
        yield flat[at : at + size]


def compact_dtype(values: Sequence[torch.Tensor], candidates: Sequence[torch.dtype]) -> torch.dtype:
    """The first of ``candidates`` that holds every value exactly (a round compressed to fp16 or bf16
    leaves only such values), else the values' own dtype: results are kept and served losslessly.
    Checked a window at a time."""
    own = values[0].dtype if values else torch.float32
    for dtype in candidates:
        if dtype.itemsize < own.itemsize and all(
            torch.equal(w.to(dtype).to(own), w) for v in values for w in windows(v.detach().reshape(-1))
        ):
            return dtype
    return own


def write_raw(flat: torch.Tensor, dtype: torch.dtype) -> bytes | Spilled:
    """``flat`` as ``dtype`` bytes: in memory when small, else written to a spill file a window at a time
    (a site's result in its mapped wire buffer never has a model-sized copy on the heap)."""
    if flat.numel() * dtype.itemsize < SPILL_BYTES:
        return flat.to(dtype).view(torch.uint8).numpy().tobytes()
    file = SpillFile()
    try:
        for w in windows(flat):
            file.put(w.to(dtype).contiguous().view(torch.uint8).numpy().data)
    except BaseException:
        file.close()
        raise
    return Spilled(file, 0, file.size)


def spill_int8(flat: torch.Tensor) -> Spilled | None:
    """``result_codec.int8_form`` straight into a spill file: the codes written at their place as they
    come, a window at a time, then the head before them (room for the largest head is kept: what it does
    not fill takes no disk). None when the values are not of that form, or it is not smaller."""
    n = flat.numel()
    file = SpillFile()
    try:
        room = result_codec.int8_head_room(n)
        base = file.reserve(room + n)
        form = result_codec.int8_form(flat, lambda at, data: file.write_at(base + room + at, data))
        if form is None or form[1] >= 4 * n:
            file.close()
            return None
        head, size = form
        file.write_at(base + room - len(head), head)
    except BaseException:
        file.close()
        raise
    return Spilled(file, base + room - len(head), size)


def pack_spilled(flat: torch.Tensor, kinds: tuple[str, ...]) -> tuple[str, Spilled] | None:
    """``result_codec.pack`` for a large result: the smallest of ``kinds`` that holds ``flat`` exactly, in a
    spill file; int8's codes go there a window at a time (in memory they were about 10 bytes a value
    before the join: the codes as floats, their concatenation, then bytes)."""
    best: tuple[str, Spilled] | None = None
    for kind in kinds:
        got: Spilled | None = None
        if kind == result_codec.INT8:
            got = spill_int8(flat)
        elif kind == result_codec.SPARSE:
            data = result_codec.pack_sparse(flat)
            got = SpillFile().put(data) if data is not None else None
        if got is None:
            continue
        if best is None or got.length < best[1].length:
            if best is not None:
                best[1].file.close()
            best = (kind, got)
        else:
            got.file.close()
    return best


@dataclass
class Kept:
    epoch: int
    slots: range
    kind: str  # its form: a dtype's name ("float32", "float16", "bfloat16") or ``result_codec``'s
    data: bytes | Spilled  # a large result waits in a spill file (page cache, not process memory)
    scale: Scale
    before: bytes = b""
    after: bytes = b""
    pieces: ResultPieces | None = None  # its pieces' hashes, once a peer asked for them
    readers: int = 0  # calls reading it now (under the store's lock): its file stays open for them
    dropped: bool = False  # no longer kept: closed once its last reader is done

    @property
    def size(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.length

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its bytes (a raw form); a packed one (``result_codec``) has none: ValueError."""
        if self.kind not in DTYPES:
            raise ValueError(f"a {self.kind} result is packed: unpack it (result_codec.unpack)")
        return DTYPES[self.kind]

    def read(self, start: int = 0, stop: int | None = None) -> memoryview:
        """Bytes ``start .. stop`` of it (all by default); from a spill file, only those are read."""
        stop = self.size if stop is None else stop
        if isinstance(self.data, bytes):
            return memoryview(self.data)[start:stop]
        return memoryview(self.data.file.read(self.data.offset + start, stop - start))

    def close(self) -> None:
        if isinstance(self.data, Spilled):
            self.data.file.close()


class ResultStore:
    """The last ``keep`` committed results of this peer's steps, served to peers that are behind.

    ``digest_of(epoch)``: this peer's digest of its state at ``epoch`` (b"" when not known): an entry is
    listed once both of its digests are known."""

    def __init__(
        self,
        registry: RpcRegistry | None,
        keep: int,
        digest_of: Callable[[int], bytes],
        slots: ServingSlots | None = None,
    ) -> None:
        """``slots``: the node's bulk serving slots, which its data streams take (shared with its other
        bulk services; None: its own)."""
        self.keep_count = max(0, min(keep, MAX_KEPT))
        self.slots = slots or ServingSlots()
        self._digest_of = digest_of
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        # (a result is kept in a worker thread while the event loop serves what is kept: the map changes
        # under this lock, and is read under it)
        self._lock = threading.Lock()
        self.served_bytes = 0
        self.piece_least = PIECE_LEAST
        if registry is not None and self.keep_count:
            registry.add_unary(RESULTS_INFO, self._on_info)
            registry.add_stream(RESULT_DATA, self._on_data)
            registry.add_unary(RESULT_PIECES, self._on_pieces)

    def keep(
        self,
        epoch: int,
        slots: range,
        values: Sequence[torch.Tensor],
        compact: Sequence[torch.dtype],
        digests: tuple[bytes, bytes] = (b"", b""),
        packs: tuple[str, ...] = (),
    ) -> None:
        """Keep the result that takes the state of ``epoch`` to the next step (blocking: a model-sized copy;
        call it in a worker thread for a large model). ``values``: the parameters ``slots``' updates;
        ``digests``: the states' before and after, if known already (a replayed step's); ``packs``: the
        ``result_codec`` forms to try on float32 values (the round's compression: int8, top-k), the
        smallest exact one kept."""
        if not self.keep_count:
            return
        flat = flat_of(values)
        dtype = compact_dtype([flat], compact)
        kind = str(dtype).split(".")[-1]
        packed: tuple[str, bytes | Spilled] | None = None
        if packs and dtype == torch.float32:
            try:
                packed = pack_spilled(flat, packs) if 4 * flat.numel() >= SPILL_BYTES else None
            except OSError as e:  # a full disk: kept in memory
                log.warning("cannot spill step %d's result (%s): keeping it in memory", epoch, e)
            packed = packed or result_codec.pack(flat, packs)
        data: bytes | Spilled
        if packed is not None:
            kind, data = packed
            if isinstance(data, Spilled) and data.length < SPILL_BYTES:  # (small once packed: in memory)
                small = bytes(data.read())
                data.file.close()
                data = small
        else:
            try:
                data = write_raw(flat, dtype)
            except OSError as e:  # a full disk: kept in memory
                log.warning("cannot spill step %d's result (%s): keeping it in memory", epoch, e)
                data = flat.to(dtype).view(torch.uint8).numpy().tobytes()
        scale = Scale.total(Scale.of(w.float()) for w in windows(flat))
        with self._lock:
            old = self._kept.pop(epoch, None)
            self._kept[epoch] = Kept(epoch, slots, kind, data, scale, *digests)
            dropped = [old] if old is not None else []
            while len(self._kept) > self.keep_count:
                dropped.append(self._kept.popitem(last=False)[1])
            for k in dropped:
                k.dropped = True
            closing = [k for k in dropped if not k.readers]  # (the others: by their last reader)
        for k in closing:
            k.close()

    @contextlib.asynccontextmanager
    async def _reading(self, kept: Kept) -> AsyncIterator[Kept]:
        """``kept`` held open while a call reads it: a result dropped meanwhile (a newer one kept) is
        closed by its last reader, never under one (its file's descriptor could be reused)."""
        with self._lock:
            kept.readers += 1
        try:
            yield kept
        finally:
            with self._lock:
                kept.readers -= 1
                close = kept.dropped and not kept.readers
            if close:
                kept.close()

    def get(self, epoch: int) -> Kept | None:
        kept = self._kept.get(epoch)
        if kept is not None:
            kept.before = kept.before or self._digest_of(epoch)
            kept.after = kept.after or self._digest_of(epoch + 1)
        return kept

    def scale(self) -> Scale | None:
        """The size of the newest result this peer applied (bounds what a replay may apply)."""
        with self._lock:
            return next(reversed(self._kept.values())).scale if self._kept else None

    def entries(self, first: int) -> list[ResultEntry]:
        out = []
        with self._lock:
            epochs = [e for e in self._kept if e >= first]
        for epoch in epochs:
            k = self.get(epoch)
            if k is not None and k.before and k.after:
                out.append(
                    ResultEntry(
                        epoch,
                        k.slots.start,
                        k.slots.stop,
                        k.kind,
                        k.size,
                        k.before,
                        k.after,
                    )
                )
        return out

    async def _on_info(self, ctx: CallContext, req: ResultsReq) -> ResultsInfo:
        return ResultsInfo(tuple(self.entries(req.first)))

    def _held(self, req: ResultReq) -> Kept:
        kept = self.get(req.epoch)
        if kept is None or kept.after != req.after:
            raise CallRefused("moved_on", f"this peer holds no result of step {req.epoch} with that digest")
        return kept

    async def _read(self, kept: Kept, start: int = 0, stop: int | None = None) -> memoryview:
        """Bytes ``start .. stop`` of ``kept`` (a range request reads its range only, not the result)."""
        stop = kept.size if stop is None else stop
        if isinstance(kept.data, bytes) or stop - start < READ_INLINE:
            return kept.read(start, stop)
        # a disk read of a large range may take a while: not on the event loop
        return await trio.to_thread.run_sync(kept.read, start, stop)

    async def _on_pieces(self, ctx: CallContext, req: ResultReq) -> ResultPieces:
        kept = self._held(req)
        if kept.pieces is None:
            piece = piece_bytes(kept.size, self.piece_least)
            async with self._reading(kept):
                if kept.size < HASH_INLINE:
                    hashes = hash_pieces(kept.read(), piece)
                else:  # (a piece read at a time: a spilled result is never read whole into memory)
                    hashes = await trio.to_thread.run_sync(self._hash_spilled, kept, piece)
            kept.pieces = ResultPieces(piece, hashes)
        return kept.pieces

    @staticmethod
    def _hash_spilled(kept: Kept, piece: int) -> bytes:
        return b"".join(
            hash_pieces(kept.read(at, min(at + piece, kept.size)), piece) for at in range(0, kept.size, piece)
        )

    async def _on_data(self, ctx: CallContext, req: ResultReq, stream: RpcStream) -> StreamDone:
        """A range of a kept result, read and sent a window at a time (``SEND_WINDOW``: what a stream
        holds in memory, whatever the range asked), in one of the node's bulk serving slots."""
        kept = self._held(req)
        stop = kept.size if req.length == 0 else req.offset + req.length
        if not req.offset <= stop <= kept.size:
            raise CallRefused("bad_range", f"its result of step {req.epoch} has {kept.size} bytes")
        with self.slots.taken(ctx.peer, ctx.remote_host):
            async with self._reading(kept):
                for window in range(req.offset, stop, SEND_WINDOW):
                    data = await self._read(kept, window, min(window + SEND_WINDOW, stop))
                    for at in range(0, len(data), RECORD):
                        await stream.send(data[at : at + RECORD], background=True)  # (control first)
                        self.served_bytes += min(RECORD, len(data) - at)
                    del data
            await stream.send_eof()
        return StreamDone(True)


class Mapped(Protocol):
    """Float32 values outside the heap (a mapped file): ``flat``."""

    flat: torch.Tensor


@dataclass(frozen=True)
class Fetched:
    """One step's result, fetched and checked in form and size (not yet against the digest: that needs it
    applied)."""

    epoch: int
    after: bytes  # the trusted digest of ``epoch + 1``'s state, which applying it must give
    slots: range
    values: torch.Tensor  # flat, in the parameters' dtype
    peer: PeerID  # the reference: every byte matched its piece hashes (see ``result_pieces``)
    size: int  # bytes that travelled
    senders: tuple[PeerID, ...] = ()  # the holders whose pieces were kept
    contradicted: frozenset[PeerID] = frozenset()  # holders whose pieces differed from the reference's
    buffer: Mapped | None = None  # what holds ``values`` (its first elements), when not the heap


@dataclass
class Replay:
    """The outcome of a replay fetch: the results of consecutive steps from ``first`` on."""

    first: int
    results: list[Fetched] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(r.size for r in self.results)


def check_bound(values: torch.Tensor, bound: Scale | None) -> str:
    """Why ``values`` may not be applied ('' if they may): non-finite, or beyond ``BOUND`` times the last
    result this peer applied itself (R1, see ``averaging.bounds``; no bound without such a result)."""
    scale = Scale.of(values)
    if not (math.isfinite(scale.sumsq) and math.isfinite(scale.absmax)):
        return "values that are not finite"
    if bound is None or bound.zero:
        return ""
    d = max(1, scale.count)
    norm = BOUND * bound.rms * math.sqrt(d) + SLACK * math.sqrt(d)
    if not scale.absmax <= BOUND * bound.absmax + SLACK:
        return f"a value of magnitude {scale.absmax:.4g}, over {BOUND:g}x the last result applied here"
    if not scale.norm <= norm:
        return f"a norm of {scale.norm:.4g}, over {BOUND:g}x the last result applied here"
    return ""


class ResultFetcher:
    """Fetches the results of the steps a peer missed (see the module docstring); keeps the peers that
    sent a result its digest refuted (``blamed``) out of later fetches."""

    def __init__(
        self, host: Host, *, chunk_timeout: float, allocate: Callable[[int], Mapped] | None = None
    ) -> None:
        """``allocate(n)``: ``n`` float32 zeros outside the heap; with it, a float32 result's bytes go
        there as they arrive, and its values are decoded there (a site's rank 0 holds no result whole
        on its heap), else into memory."""
        self.host = host
        self.chunk_timeout = chunk_timeout
        self.allocate = allocate
        self.blamed: set[PeerID] = set()
        self.failures: list[str] = []
        self._ahead: dict[int, Fetched] = {}  # results fetched ahead (``prefetch``), by step
        self._prefetching: trio.Event | None = None

    def _fail(self, peer: PeerID, why: str) -> None:
        log.info("replay from %s: %s", peer.short(), why)
        self.failures.append(f"{peer.short()}: {why}")

    async def fetch(
        self,
        donors: Callable[[], Sequence[PeerProgress]],
        *,
        first: int,
        last: int,
        start: bytes,
        expected: Callable[[int], bytes],
        layout: Callable[[int], tuple[range, int, torch.dtype]],
        bound: Scale | None,
        budget: int = 0,
    ) -> Replay:
        """The results of steps ``first .. last - 1``, the longest prefix that trusted digests vouch for
        and some donor serves. ``start``: this peer's own (vouched) digest of ``first``'s state;
        ``expected(e)``: the trusted digest of step ``e``'s state; ``layout(e)``: the parameter slots,
        element count and dtype that step ``e``'s result must have here. ``donors()``: the peers to
        ask, as the records read by now name them (read again at each try). Results fetched ahead
        (:meth:`prefetch`) are taken from there (a prefetch in flight is waited for: the same bytes).
        ``budget``: the bytes of the state this peer would download instead (0: no limit); results that
        are to be fetched and hold as many bytes or more are not (:class:`PeerUnavailable`; results of
        under ``REPLAY_SLACK`` bytes in all are): a peer catches up by the fewer bytes (at 151.5M, a
        site replayed 2 fp32 results, 1.2 GB, in 34 s and downloaded its state's 1.2 GB in 21 s)."""
        if self._prefetching is not None:
            await self._prefetching.wait()
        return await self._fetch(donors, first, last, start, expected, layout, bound, budget)

    async def prefetch(
        self,
        donors: Callable[[], Sequence[PeerProgress]],
        *,
        first: int,
        last: int,
        expected: Callable[[int], bytes],
        layout: Callable[[int], tuple[range, int, torch.dtype]],
        bound: Scale | None,
        budget: int = 0,
    ) -> None:
        """Fetch the results of steps ``first .. last - 1`` before they are needed (this peer downloads
        the state of ``first`` while the swarm steps on), from the trusted digest of ``first`` on; kept
        for the :meth:`fetch` that follows the download, checked there again against the trusted digests
        (and, once applied, against the state's). One prefetch at a time; a failure is only logged."""
        if self._prefetching is not None or all(e in self._ahead for e in range(first, last)):
            return
        done = self._prefetching = trio.Event()
        try:
            replay = await self._fetch(donors, first, last, expected(first), expected, layout, bound, budget)
            for r in replay.results:
                self._ahead[r.epoch] = r
            log.info(
                "fetched the results of steps %d-%d ahead (%.1f MB in %.1f s)",
                first,
                first + len(replay.results) - 1,
                replay.bytes / 1e6,
                replay.seconds,
            )
        except P2PError as e:
            log.info("could not fetch step %d's result ahead (%s)", first, e)
        finally:
            self._prefetching = None
            done.set()

    async def _fetch(
        self,
        donors: Callable[[], Sequence[PeerProgress]],
        first: int,
        last: int,
        start: bytes,
        expected: Callable[[int], bytes],
        layout: Callable[[int], tuple[range, int, torch.dtype]],
        bound: Scale | None,
        budget: int = 0,
    ) -> Replay:
        self.failures = []
        began = trio.current_time()
        for old in [e for e in self._ahead if e < first or e >= first + MAX_KEPT]:
            del self._ahead[old]
        ready: list[Fetched] = []  # (fetched ahead: each ended at the trusted digest of the next step)
        while first + len(ready) < last:
            r = self._ahead.get(first + len(ready))
            if r is None or r.after != expected(r.epoch + 1) or r.peer in self.blamed:
                break
            ready.append(r)
        at = first + len(ready)
        if ready:
            start = expected(at)
        asked = 0
        for _ in range(DIGEST_TRIES if at < last else 0):
            # Right after a step its digest is still being hashed (a large state, in a thread) and
            # published: the entry of the step before names no "after" yet. Ask again shortly, rather
            # than download the whole state for want of a digest; and ask the donors the records name
            # by then: those named as the catch-up began may have moved on, or have published no digest
            # yet (a home peer on 10 Mbit/s waited 10 s for a result, then downloaded the whole state).
            now = donors()
            asked = max(asked, len(now))
            try:
                replay = await self._attempt(now, at, last, start, expected, layout, bound, donors, budget)
            except P2PError:
                if ready:
                    break  # (the steps fetched ahead are applied; the rest, at the next catch-up)
                raise
            if replay is not None:
                ready += replay.results
                break
            await trio.sleep(DIGEST_WAIT)
        if ready:
            return Replay(first, ready, trio.current_time() - began)
        why = self._why()
        if not why:
            named = "" if expected(first + 1) else f"; no trusted record names step {first + 1}'s digest"
            why = f" (asked {asked} peer(s){named})"
        raise PeerUnavailable(f"no peer serves step {first}'s result" + why)

    async def _attempt(
        self,
        donors: Sequence[PeerProgress],
        first: int,
        last: int,
        start: bytes,
        expected: Callable[[int], bytes],
        layout: Callable[[int], tuple[range, int, torch.dtype]],
        bound: Scale | None,
        refresh: Callable[[], Sequence[PeerProgress]] = tuple,
        budget: int = 0,
    ) -> Replay | None:
        """One try of :meth:`fetch`; None when no step's result could be planned yet (digests unknown).
        ``refresh()``: the donors as the records read by now name them (holders that come to hold a
        step's result while it is fetched join in)."""
        asked = [d for d in donors if d.peer not in self.blamed][:MAX_ASKED]
        holders: dict[int, list[tuple[PeerProgress, Connection, ResultEntry]]] = {}

        async def ask(donor: PeerProgress) -> None:
            try:
                with trio.fail_after(2 * self.chunk_timeout):
                    conn = await self.host.connect(donor.record.addr)
                    if conn.peer != donor.peer:
                        raise RemoteProtocolError("its address leads to another peer")
                    info = await conn.call(RESULTS_INFO, ResultsReq(first), timeout=2 * self.chunk_timeout)
                for e in info.entries:
                    holders.setdefault(e.epoch, []).append((donor, conn, e))
            except trio.TooSlowError:
                self._fail(donor.peer, "no answer in time")
            except P2PError as e:
                self._fail(donor.peer, str(e))
            except ValueError as e:
                self._fail(donor.peer, f"unusable address: {e}")

        async with trio.open_nursery() as nursery:
            for donor in asked:
                nursery.start_soon(ask, donor)
        # The chain: each step's entry must start where the last one ended and end at the trusted digest.
        plan: list[tuple[int, bytes, list[tuple[PeerProgress, Connection, ResultEntry]]]] = []
        before = start
        for epoch in range(first, last):
            after = expected(epoch + 1)
            if not after:
                break  # no trusted record names that step's digest: nothing past it can be checked
            slots, count, dtype = layout(epoch)
            ok = []
            for donor, conn, e in holders.get(epoch, []):
                why = self._entry_problem(e, before, after, slots, count, dtype)
                if why:
                    self._fail(donor.peer, why)
                else:
                    ok.append((donor, conn, e))
            if not ok:
                break
            plan.append((epoch, after, ok))
            before = after
        if not plan:
            return None
        # (each step at its smallest form held: what the holders of that form send)
        cost = sum(min(e.size for _, _, e in sources) for _, _, sources in plan)
        if budget and cost >= max(budget, REPLAY_SLACK):
            raise PeerUnavailable(
                f"the results of steps {first}-{first + len(plan) - 1} hold {cost / 1e6:.1f} MB, no fewer "
                f"than the state's {budget / 1e6:.1f} MB"
            )
        got: dict[int, Fetched] = {}

        async def one(
            index: int, epoch: int, after: bytes, sources: list[tuple[PeerProgress, Connection, ResultEntry]]
        ) -> None:
            # Each holder in turn is the reference (its piece hashes decide what is kept); the pieces
            # come from every holder of the same form at once (``result_pieces``).
            _, count, dtype = layout(epoch)
            rotated = sources[index % len(sources) :] + sources[: index % len(sources)]
            for donor, conn, e in rotated:
                if donor.peer in self.blamed:
                    continue
                others = [
                    (d.peer, c)
                    for d, c, x in rotated
                    if d.peer != donor.peer
                    and d.peer not in self.blamed
                    and (x.dtype, x.size) == (e.dtype, e.size)
                ]
                mapped, into = self._into(e, dtype)
                try:
                    pieced = await fetch_pieces(
                        (donor.peer, conn),
                        others,
                        e,
                        after,
                        timeout=self.chunk_timeout,
                        failures=self.failures,
                        more=functools.partial(self._more_holders, refresh, e),
                        into=into,
                    )
                except Refuted as err:
                    self.blamed.add(err.peer)
                    self._fail(err.peer, str(err))
                    continue
                except (P2PError, trio.TooSlowError) as err:
                    self._fail(donor.peer, f"step {epoch}: {err or 'no progress'}")
                    continue
                try:
                    values, held = self._values(e, pieced.data, dtype, count, mapped)
                    why = check_bound(values, bound)
                except RemoteProtocolError as err:
                    why = str(err)
                if why:  # every byte matched the reference's hashes: it vouched for them
                    self.blamed.add(donor.peer)
                    self._fail(donor.peer, f"step {epoch}'s result has {why}")
                    continue
                got[epoch] = Fetched(
                    epoch,
                    after,
                    range(e.first, e.stop),
                    values,
                    donor.peer,
                    e.size,
                    senders=tuple(pieced.sent),
                    contradicted=frozenset(pieced.contradicted),
                    buffer=held,
                )
                return

        async with trio.open_nursery() as nursery:
            for index, (epoch, after, sources) in enumerate(plan):
                nursery.start_soon(one, index, epoch, after, sources)
        results = []
        for epoch, _, _ in plan:
            if epoch not in got:
                break
            results.append(got[epoch])
        if not results:
            raise PeerUnavailable(f"no peer delivered step {first}'s result" + self._why())
        return Replay(first, results)

    async def _more_holders(
        self, refresh: Callable[[], Sequence[PeerProgress]], like: ResultEntry, known: set[PeerID]
    ) -> list[tuple[PeerID, Connection]]:
        """The donors ``refresh()`` names besides ``known`` that hold a result just like ``like`` (its step,
        digests, slots and form): they join the fetch of its pieces."""
        fresh = [d for d in refresh() if d.peer not in known and d.peer not in self.blamed][:MAX_ASKED]
        found: list[tuple[PeerID, Connection]] = []

        async def ask(donor: PeerProgress) -> None:
            try:
                with trio.fail_after(2 * self.chunk_timeout):
                    conn = await self.host.connect(donor.record.addr)
                    if conn.peer != donor.peer:
                        return
                    info = await conn.call(
                        RESULTS_INFO, ResultsReq(like.epoch), timeout=2 * self.chunk_timeout
                    )
            except (trio.TooSlowError, P2PError, ValueError):
                return
            if like in info.entries:  # (every field the same: step, digests, slots, form, size)
                found.append((donor.peer, conn))

        async with trio.open_nursery() as nursery:
            for donor in fresh:
                nursery.start_soon(ask, donor)
        return found

    @staticmethod
    def _entry_problem(
        e: ResultEntry, before: bytes, after: bytes, slots: range, count: int, dtype: torch.dtype
    ) -> str:
        if e.after != after:
            return f"its result of step {e.epoch} leads to a state the trusted records do not name"
        if e.before != before:
            return f"its result of step {e.epoch} starts from another state than this peer's"
        if range(e.first, e.stop) != slots:
            return f"its result of step {e.epoch} updates other parameters than this step's"
        if e.dtype in result_codec.PACKED:
            if dtype != torch.float32:
                return f"its result of step {e.epoch} is packed ({e.dtype}) for parameters in {dtype}"
            if not 4 <= e.size <= result_codec.max_size(e.dtype, count):
                return f"its {e.dtype} result of step {e.epoch} is {e.size} bytes, for {count} values"
            return ""
        kind = DTYPES.get(e.dtype)
        if (
            kind is None
            or kind.itemsize > dtype.itemsize
            or (kind.is_floating_point != dtype.is_floating_point)
        ):
            return f"its result of step {e.epoch} is in {e.dtype!r}"
        if e.size != count * kind.itemsize:
            return f"its result of step {e.epoch} is {e.size} bytes, not {count * kind.itemsize}"
        return ""

    def _into(self, e: ResultEntry, dtype: torch.dtype) -> tuple[Mapped | None, memoryview | None]:
        """Where ``e``'s bytes go as they arrive: a mapped buffer of their size and a writable view of
        its bytes, when this fetcher allocates outside the heap (float32 parameters); else (None, None)."""
        if self.allocate is None or dtype != torch.float32:
            return None, None
        mapped = self.allocate(-(-e.size // 4))
        return mapped, mapped.flat.view(torch.uint8)[: e.size].numpy().data

    def _values(
        self,
        e: ResultEntry,
        buf: bytearray | memoryview,
        dtype: torch.dtype,
        count: int,
        mapped: Mapped | None,
    ) -> tuple[torch.Tensor, Mapped | None]:
        """A result's bytes as ``count`` values of ``dtype``, and the mapped buffer that holds them (None:
        the heap); RemoteProtocolError: a malformed packed one. Bytes fetched into ``mapped``: a float32
        result's values are those very bytes; any other is decoded into a new mapped buffer."""
        kind = DTYPES.get(e.dtype)
        if mapped is not None and self.allocate is not None:
            if kind == torch.float32:
                return mapped.flat[:count], mapped
            out = self.allocate(count)
            values = out.flat[:count]
            if kind is None:
                result_codec.unpack(e.dtype, buf, count, out=values)
            elif e.size:
                values.copy_(torch.frombuffer(buf, dtype=kind))
            return values, out
        if kind is None:  # (packed: checked in full, a malformed one raises)
            return result_codec.unpack(e.dtype, buf, count), None
        values = torch.frombuffer(buf, dtype=kind) if e.size else torch.empty(0, dtype=kind)
        return values.to(dtype), None

    def _why(self) -> str:
        return f" ({'; '.join(self.failures[-4:])})" if self.failures else ""
