"""State download, the joiner's side: many donors at once, every chunk checked on arrival, resumable.

Theory of operation: :class:`Fetcher` downloads one state (named by its root digest) and keeps what it
has across attempts, so a broken connection or a failed attempt never costs a byte already received.

1. *Offers*: every candidate donor is asked (concurrently) what it offers for the wanted epoch; an offer
   names its step and the root digest of the state it serves. An offer counts only if its epoch is at
   least the wanted one, its size fits what this model could need, and its root is the digest the
   swarm's trusted progress records report for that epoch (``expected``). Among the acceptable roots the
   one already partly downloaded wins, then the newest epoch, then the one most donors offer. A donor
   that stepped since the records were read offers a step no record names yet: when no offer is
   acceptable, such an offer is downloaded all the same (its chunks are checked against its own root as
   always), and the state is handed over only once the trusted records name that root for its step
   (``confirm``: the records catch up within a progress interval or two; a root they refute is
   dropped and its donors are blamed; one still unnamed after ``CONFIRM_WAIT`` is kept, complete, for
   the next attempt). Nothing is applied that trusted records do not name, and no attempt fails and
   starts over just because the swarm stepped meanwhile.
2. *Manifest*: the layout header, the chunk hashes and the metadata, from one donor of that root; the
   root is recomputed from them (it commits to the epoch, the layout and every hash), so a donor cannot
   change any of it. Destination tensors are allocated from the layout (pages untouched until written).
   The chunks the peer's own state already holds (same layout, same hash at the same place: after a
   streaming step, all but one fragment's) are copied from it and checked again (:func:`fill_from`).
3. *Chunks*: each donor of the root gets ``STREAMS_PER_DONOR`` workers that take runs of missing chunks
   from one shared queue (fast donors simply take more), stream them, hash each chunk the moment it is
   complete and copy it into the destination tensors. A donor that goes ``chunk_timeout`` seconds
   without completing a chunk, fails, or sends a chunk whose hash is wrong (it is named in the log) is
   dropped, and its unfinished chunks go back to the queue for the others. No deadline bounds the whole
   transfer: a slow link that keeps delivering is never cut.

When every donor is gone with chunks still missing, :class:`PeerUnavailable` is raised and the next
attempt (same root) resumes where this one stopped. Nothing is applied here: the caller restores the
verified tensors (and the epoch the root commits to).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch
import trio

from ...errors import P2PError, PeerUnavailable, RemoteCallError, RemoteProtocolError
from ...identity import PeerID
from ...net.connection import Connection
from ...net.host import Host
from ...net.slots import TURN, busy
from ...net.streams import RpcStream
from ..optimizer.progress import PeerProgress
from . import chunks as lay
from . import codec
from .chunks import HASH_BYTES, Layout
from .protocol import (
    MAX_META_BYTES,
    STATE_CHUNKS,
    STATE_INFO,
    STATE_MANIFEST,
    ChunksReq,
    ManifestReq,
    StateInfo,
    StateInfoReq,
)
from .serve import LiveState

log = logging.getLogger(__name__)

MAX_ASKED = 16  # donors asked for an offer per attempt
STREAMS_PER_DONOR = 2  # two ranges in flight per donor hide the gap between requests
RANGE = 16  # chunks per request
BUSY_BACKOFF = 1.0  # seconds before asking a busy donor again
MAX_BUSY = max(30, int(2 * TURN / BUSY_BACKOFF))  # busy answers in a row before a donor is given up
UNKNOWN_WAIT = 1.0  # seconds between looks at the records while a step no record names yet is confirmed
CONFIRM_WAIT = 60.0  # seconds a downloaded state waits for the trusted records to name its root

ProgressFn = Callable[[int, int], None]
"""Called with (bytes received, bytes expected) as a download proceeds."""


class BadChunk(RemoteProtocolError):
    """A donor sent a chunk whose hash is not the one its state's root commits to."""


@dataclass
class Offer:
    donor: PeerProgress
    conn: Connection
    info: StateInfo
    delivered: int = 0


@dataclass
class Partial:
    """A download in progress: what is known of the state and which chunks are in."""

    epoch: int
    root: bytes
    layout: Layout
    hashes: list[bytes]
    metadata: dict[str, str]
    tensors: list[torch.Tensor]
    have: bytearray
    received: int = 0
    reused: int = 0  # of ``received``: bytes copied from this peer's own state (see ``fill_from``)
    sources: dict[PeerID, int] = field(default_factory=dict)  # checked bytes from each donor
    finished: float = 0.0  # when the last chunk came in (trio's clock: virtual in simulations)

    @property
    def complete(self) -> bool:
        return self.received == self.layout.size


@dataclass(frozen=True)
class Downloaded:
    epoch: int  # the epoch the verified root commits to
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    donors: tuple[PeerID, ...]  # the donors that delivered chunks, most bytes first
    delivered: dict[PeerID, int] = field(default_factory=dict)  # checked bytes from each, this attempt
    seconds: float = 0.0
    layout: Layout | None = None  # the state's chunk layout, and each chunk's hash, every one checked:
    hashes: tuple[bytes, ...] = ()  # a state restored from these bytes needs no hashing again
    root: bytes = b""  # the digest they make, the one the trusted records named

    @property
    def donor(self) -> PeerID:
        return self.donors[0]


@dataclass
class _Queue:
    """Missing chunks not being fetched, sorted; woken whenever chunks come back or a worker ends."""

    missing: list[int]
    busy: int = 0  # ranges in flight
    changed: trio.Event = field(default_factory=trio.Event)
    dropped: set[PeerID] = field(default_factory=set)

    def take(self, most: int) -> list[int]:
        if not self.missing:
            return []
        run = [self.missing[0]]
        while len(run) < most and len(run) < len(self.missing) and self.missing[len(run)] == run[-1] + 1:
            run.append(self.missing[len(run)])
        del self.missing[: len(run)]
        return run

    def put_back(self, chunks: Sequence[int]) -> None:
        for i in chunks:
            bisect.insort(self.missing, i)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


class _Reader:
    """Exact-size reads from a stream, through one reusable chunk buffer when a read spans records."""

    def __init__(self, stream: RpcStream) -> None:
        self._stream = stream
        self._left = memoryview(b"")
        self._buf = bytearray(lay.CHUNK)

    async def read(self, n: int) -> memoryview:
        if not self._left:
            self._left = await self._stream.receive_some()
        if len(self._left) >= n:  # the usual case: one chunk, one record
            out, self._left = self._left[:n], self._left[n:]
            return out
        buf = self._buf if n <= len(self._buf) else bytearray(n)
        filled = 0
        while filled < n:
            if not self._left:
                self._left = await self._stream.receive_some()
                if not self._left:
                    raise RemoteProtocolError(f"stream ended {n - filled} bytes early")
            take = min(n - filled, len(self._left))
            buf[filled : filled + take] = self._left[:take]
            self._left = self._left[take:]
            filled += take
        return memoryview(buf)[:n]


class Sink:
    """Where a download's verified chunks go: by default tensors of the whole state, allocated from the
    layout. A peer that does not hold its state whole (a sharded site) puts each chunk where it belongs
    instead (``place`` may wait until that is safe)."""

    def allocate(self, layout: Layout) -> list[torch.Tensor]:
        return lay.empty_like(layout)

    async def place(self, layout: Layout, tensors: list[torch.Tensor], i: int, data: memoryview) -> None:
        lay.place(layout, tensors, i, data)

    def finish(self, layout: Layout, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        lay.check_bool_entries(layout, tensors)
        return lay.as_dict(layout, tensors)


class Fetcher:
    """Downloads the swarm's state for one peer; keeps partial progress across :meth:`fetch` calls."""

    def __init__(
        self,
        host: Host,
        *,
        max_size: int,
        chunk_timeout: float,
        max_donors: int,
        on_progress: ProgressFn | None = None,
        sink: Sink | None = None,
    ) -> None:
        self.host = host
        self.sink = sink or Sink()
        self.max_size = max_size
        self.chunk_timeout = chunk_timeout
        self.max_donors = max_donors
        self.on_progress = on_progress or (lambda got, total: None)
        self.partial: Partial | None = None
        self.failures: list[str] = []
        self.blamed: set[PeerID] = set()  # donors that sent a chunk their own manifest refutes

    def _fail(self, peer: PeerID, why: str) -> None:
        log.warning("state download from %s: %s", peer.short(), why)
        self.failures.append(f"{peer.short()}: {why}")

    async def fetch(
        self,
        donors: Sequence[PeerProgress],
        *,
        want_epoch: int,
        expected: Callable[[int], bytes],
        reuse: Callable[[Partial], Awaitable[None]] | None = None,
        roots: Callable[[int], frozenset[bytes]] | None = None,
    ) -> Downloaded:
        """Download the state of an epoch >= ``want_epoch`` whose root is ``expected(epoch)``: the root
        most trusted records name; or, given ``roots``, any root that ``roots(epoch)`` holds (a swarm
        split into regions, whose regions each hold a state of their own of a step: every trusted
        record's is one, and held to the majority's, a peer refused its trusted donors of the other
        regions and retried until one of the majority's served it). ``reuse`` fills a new download's
        chunks that are at hand (see :func:`fill_from`) before any is fetched."""

        def named(epoch: int) -> frozenset[bytes]:
            if roots is not None:
                return roots(epoch)
            root = expected(epoch)
            return frozenset((root,)) if root else frozenset()

        self.failures = []
        began = trio.current_time()
        partial = self.partial
        if partial is not None and partial.complete and partial.epoch >= want_epoch:
            # complete already, waiting for the records to name it (see ``confirm``)
            await self.confirm(partial, named)
            return self._done(partial, began)
        offers = await self._offers(donors, want_epoch)
        chosen = self._choose(offers, want_epoch, named)
        if not chosen:
            chosen = self._unnamed(offers, want_epoch, named)
        if not chosen:
            raise PeerUnavailable("no peer offered the swarm's state" + self._why())
        if partial is None or partial.root != chosen[0].info.root:
            self.partial = None  # a state nobody serves any more: its memory goes
            partial = await self._manifest(chosen)
            self.partial = partial
            if reuse is not None:
                await reuse(partial)
        await self._chunks(partial, chosen[: self.max_donors])
        if not partial.complete:
            missing = partial.layout.chunks - sum(partial.have)
            raise PeerUnavailable(
                f"{missing} of {partial.layout.chunks} chunks still missing; kept the rest" + self._why()
            )
        await self.confirm(partial, named)
        return self._done(partial, began, chosen)

    async def confirm(self, partial: Partial, named: Callable[[int], frozenset[bytes]]) -> None:
        """Wait until the trusted records name ``partial``'s root for its step (``named``: the roots they
        name; at most ``CONFIRM_WAIT`` seconds); raise if they name others only (its donors are blamed,
        the state dropped) or none yet (the complete state is kept for the next attempt)."""
        with trio.move_on_after(CONFIRM_WAIT):
            while not named(partial.epoch):  # noqa: ASYNC110  (the records change on their own)
                await trio.sleep(UNKNOWN_WAIT)
        vouched = named(partial.epoch)
        if partial.root in vouched:
            return
        if not vouched:
            raise PeerUnavailable(
                f"step {partial.epoch}'s state is in, but no trusted record names its digest yet; kept it"
            )
        self.partial = None
        self.blamed.update(partial.sources)
        raise PeerUnavailable(
            f"step {partial.epoch}'s state from {', '.join(p.short() for p in partial.sources)} is not the"
            " one the trusted records name; dropped, and its donors blamed"
        )

    def _done(self, partial: Partial, began: float, chosen: Sequence[Offer] = ()) -> Downloaded:
        self.partial = None
        tensors = self.sink.finish(partial.layout, partial.tensors)
        # this attempt's donors (a state completed in an earlier attempt: that one's)
        delivered = {o.donor.peer: o.delivered for o in chosen if o.delivered} or dict(partial.sources)
        used = sorted(delivered, key=lambda p: -delivered[p])
        took = max(0.0, (partial.finished or trio.current_time()) - began)
        fetched = partial.layout.size - partial.reused
        log.info(
            "downloaded step %d's state (%.1f MB%s) from %d donor(s) in %.1f s (%.1f MB/s): %s",
            partial.epoch,
            fetched / 1e6,
            f"; {partial.reused / 1e6:.1f} MB more were already here" if partial.reused else "",
            len(used),
            took,
            fetched / 1e6 / max(took, 1e-9),
            ", ".join(f"{p.short()} {delivered[p] / 1e6:.1f} MB" for p in used),
        )
        return Downloaded(
            partial.epoch,
            tensors,
            partial.metadata,
            tuple(used),
            delivered,
            took,
            partial.layout,
            tuple(partial.hashes),
            partial.root,
        )

    def _why(self) -> str:
        return f" ({'; '.join(self.failures[-4:])})" if self.failures else ""

    # ---- offers and manifest ----

    async def _offers(self, donors: Sequence[PeerProgress], want_epoch: int) -> list[Offer]:
        offers: list[Offer] = []

        async def ask(donor: PeerProgress) -> None:
            try:
                # A donor takes its snapshot before it answers: that may take a while for a large state.
                with trio.fail_after(2 * self.chunk_timeout):
                    conn = await self.host.connect(donor.record.addr)
                    if conn.peer != donor.peer:
                        raise RemoteProtocolError("its address leads to another peer")
                    info = await conn.call(
                        STATE_INFO, StateInfoReq(want_epoch), timeout=2 * self.chunk_timeout
                    )
                offers.append(Offer(donor, conn, info))
            except trio.TooSlowError:
                self._fail(donor.peer, "no offer in time")
            except P2PError as e:
                self._fail(donor.peer, str(e))
            except ValueError as e:  # an address from its record that does not parse
                self._fail(donor.peer, f"unusable address: {e}")

        async with trio.open_nursery() as nursery:
            for donor in [d for d in donors if d.peer not in self.blamed][:MAX_ASKED]:
                nursery.start_soon(ask, donor)
        return offers

    def _choose(
        self, offers: list[Offer], want_epoch: int, named: Callable[[int], frozenset[bytes]]
    ) -> list[Offer]:
        ok = []
        for o in offers:
            i = o.info
            if i.epoch < want_epoch:
                self._fail(o.donor.peer, f"offers step {i.epoch}, older than step {want_epoch}")
            elif i.size > self.max_size:
                self._fail(o.donor.peer, f"offers {i.size} bytes, more than this model could need")
            elif not (vouched := named(i.epoch)):
                pass  # a step no trusted record names yet (see ``_unnamed``)
            elif i.root not in vouched:
                self._fail(
                    o.donor.peer, f"offers a state for step {i.epoch} that most peers did not start from"
                )
            else:
                ok.append(o)
        if not ok:
            return []
        roots: dict[bytes, list[Offer]] = {}
        for o in ok:
            roots.setdefault(o.info.root, []).append(o)
        if self.partial is not None and self.partial.root in roots:
            return roots[self.partial.root]
        return max(roots.values(), key=lambda group: (group[0].info.epoch, len(group)))

    def _unnamed(
        self, offers: list[Offer], want_epoch: int, named: Callable[[int], frozenset[bytes]]
    ) -> list[Offer]:
        """The offers of the newest step that no trusted record names yet (the donors stepped since the
        records were read), most offered root first: downloaded, then confirmed (see ``confirm``)."""
        roots: dict[bytes, list[Offer]] = {}
        for o in offers:
            i = o.info
            if i.epoch >= want_epoch and i.size <= self.max_size and not named(i.epoch):
                roots.setdefault(i.root, []).append(o)
        if not roots:
            return []
        group = max(roots.values(), key=lambda g: (g[0].info.epoch, len(g)))
        log.info(
            "step %d's state is offered before any trusted record names it: downloading it, to apply once"
            " they do",
            group[0].info.epoch,
        )
        return group

    async def _manifest(self, offers: list[Offer]) -> Partial:
        for offer in offers:
            try:
                return await self._manifest_from(offer)
            except (P2PError, trio.TooSlowError) as e:
                self._fail(offer.donor.peer, f"manifest: {e or 'no progress'}")
        raise PeerUnavailable("no donor delivered the state's manifest" + self._why())

    async def _manifest_from(self, offer: Offer) -> Partial:
        i = offer.info
        if i.header > codec.MAX_HEADER or i.meta > MAX_META_BYTES or i.chunks != -(-i.size // lay.CHUNK):
            raise RemoteProtocolError(f"implausible manifest sizes {i.header}/{i.chunks}/{i.meta}")
        total = i.header + i.chunks * HASH_BYTES + i.meta
        async with offer.conn.open_stream(
            STATE_MANIFEST, ManifestReq(i.root), timeout=self.chunk_timeout * (2 + total // lay.CHUNK)
        ) as stream:
            reader = _Reader(stream)
            parts = []
            for size in (i.header, i.chunks * HASH_BYTES, i.meta):
                got = bytearray()
                while len(got) < size:
                    with trio.fail_after(self.chunk_timeout):
                        got += await reader.read(min(lay.CHUNK, size - len(got)))
                parts.append(bytes(got))
            await stream.response()
        layout = Layout.parse(parts[0])
        if layout.size != i.size:
            raise RemoteProtocolError(f"layout of {layout.size} bytes, {i.size} announced")
        hashes = lay.split_hashes(parts[1], layout.chunks)
        if lay.root(i.epoch, layout, hashes) != i.root:
            raise RemoteProtocolError("its manifest does not match the state's digest")
        meta = codec.parse_json(parts[2], "state metadata")
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise RemoteProtocolError("state metadata must be an object of strings")
        log.info("downloading step %d's state: %s", i.epoch, layout.describe())
        tensors = self.sink.allocate(layout)
        return Partial(i.epoch, i.root, layout, hashes, meta, tensors, bytearray(layout.chunks))

    # ---- chunks ----

    async def _chunks(self, partial: Partial, offers: list[Offer]) -> None:
        queue = _Queue([i for i in range(partial.layout.chunks) if not partial.have[i]])
        self.on_progress(partial.received, partial.layout.size)
        async with trio.open_nursery() as nursery:
            for offer in offers:
                for _ in range(STREAMS_PER_DONOR):
                    nursery.start_soon(self._worker, partial, offer, queue)

    async def _worker(self, partial: Partial, offer: Offer, queue: _Queue) -> None:
        peer = offer.donor.peer
        busied = 0  # busy answers in a row
        while peer not in queue.dropped:
            run = queue.take(RANGE)
            if not run:
                if not queue.busy:
                    return
                await queue.changed.wait()
                continue
            queue.busy += 1
            backoff = False
            try:
                await self._range(partial, offer, run)
                busied = 0
            except RemoteCallError as e:
                backoff = busy(e) and busied < MAX_BUSY
                busied += 1
                if not backoff:
                    self._drop(queue, peer, str(e))
            except trio.TooSlowError:
                self._drop(queue, peer, f"no chunk for {self.chunk_timeout:g} s")
            except BadChunk as e:
                self.blamed.add(peer)
                self._drop(queue, peer, f"{e}; its chunks go to others")
            except P2PError as e:
                self._drop(queue, peer, str(e))
            finally:
                queue.busy -= 1
                queue.put_back([i for i in run if not partial.have[i]])
                queue.notify()
            if backoff:
                await trio.sleep(BUSY_BACKOFF)

    def _drop(self, queue: _Queue, peer: PeerID, why: str) -> None:
        queue.dropped.add(peer)
        self._fail(peer, f"{why} (dropped)")

    async def _range(self, partial: Partial, offer: Offer, run: list[int]) -> None:
        peer = offer.donor.peer
        timeout = self.chunk_timeout * (len(run) + 1)  # never reached before a chunk stalls
        request = ChunksReq(partial.root, run[0], len(run))
        async with offer.conn.open_stream(STATE_CHUNKS, request, timeout=timeout) as stream:
            reader = _Reader(stream)
            for i in run:
                size = partial.layout.chunk_size(i)
                with trio.fail_after(self.chunk_timeout):
                    data = await reader.read(size)
                if partial.have[i]:
                    continue  # fetched meanwhile by another worker (not expected: ranges are disjoint)
                if lay.hash_chunk([data]) != partial.hashes[i]:
                    raise BadChunk(f"sent a corrupted chunk {i} of step {partial.epoch}'s state")
                await self.sink.place(partial.layout, partial.tensors, i, data)
                partial.have[i] = 1
                partial.received += size
                offer.delivered += size
                partial.sources[peer] = partial.sources.get(peer, 0) + size
                if partial.complete:
                    partial.finished = trio.current_time()
                self.on_progress(partial.received, partial.layout.size)
            with trio.fail_after(self.chunk_timeout):
                await stream.response()


def fill_from(partial: Partial, live: LiveState) -> int:
    """Copy into ``partial`` the chunks this peer's own state already holds, and return their bytes: a
    chunk whose hash the verified manifest lists at the same place of the same layout. After a streaming
    step only one fragment's chunks (and its momentum's) differ, so a peer left out of that step fetches
    those alone. Each copied chunk is hashed again (the local state must still be what its hashes say);
    one that does not match is left to the donors. Reads the live tensors: run it while they are held."""
    if live.hashes is None or live.layout.header != partial.layout.header:
        return 0
    reused = 0
    for i, want in enumerate(partial.hashes):
        if partial.have[i] or live.hashes[i] != want:
            continue
        data = b"".join(lay.chunk_pieces(live.layout, live.tensors, i, live.source))
        if lay.hash_chunk([data]) != want:
            continue
        lay.place(partial.layout, partial.tensors, i, memoryview(data))
        partial.have[i] = 1
        size = partial.layout.chunk_size(i)
        partial.received += size
        partial.reused += size
        reused += size
    return reused
