"""One step's result fetched from several holders at once, piece by piece, with exact blame.

Why. A peer catching up by replay (``state.replay``) fetches a result about the size of the model's
parameters (a 45M model in fp16: 86 MB). From one holder it arrives at that holder's spare uplink, and a
holder's uplink also carries its own rounds: a 45M joiner on 50 Mbit/s replayed at 49-52% of the link,
so the swarm stepped again meanwhile and it replayed twice. From every holder at once it arrives at the
sum of their spare uplinks.

The difficulty is blame. The only thing that proves a result right is the trusted digest of the state it
leads to, checked after it is applied: if bytes from several holders were mixed and the digest refutes
the mix, which holder lied? So one holder is the *reference*: it names how its result splits into
pieces and each piece's hash (``train.result_pieces``), and every piece, whoever sends it, is checked
against the reference's hash before it is kept. The invariant:

*Every byte applied is one the reference vouched for; so the digest check judges the reference alone.
A result the digest refutes blames the reference (and nobody else); a result the digest confirms blames
exactly the holders whose pieces contradicted it (their bytes differed from bytes now proven right).*

Nothing is believed because several ids say it: the reference is one holder, chosen in turn; a holder
whose own pieces contradict its own hashes is blamed at once (it said both); a piece that fails its
check is fetched again from another holder, and its sender sends nothing more for this result. At most
``MAX_HOLDERS`` holders serve one result, so a hundred ids that lie cost it no more than eight.

Pieces are handed out from a queue, so a holder with a faster uplink sends more of them; once the queue
is empty an idle holder fetches a piece another is still sending once that piece has taken twice the
median piece so far (at most two at a time; the first good copy wins), so one slow holder delays the
result by little more than one piece, and a link that is simply slow is not loaded with copies.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ...errors import P2PError, PeerUnavailable, RemoteCallError, RemoteProtocolError
from ...identity import PeerID
from ...net.connection import Connection
from ...net.slots import busy as is_busy
from .chunks import HASH_BYTES
from .protocol import (
    MAX_PIECES,
    RECORD,
    RESULT_DATA,
    RESULT_PIECES,
    ResultEntry,
    ResultPieces,
    ResultReq,
    hash_piece,
)

log = logging.getLogger("p2ptrain.training.state.result_pieces")

HASH_IN_THREAD = 1 << 20  # a piece this large is hashed in a worker thread
BUSY_BACKOFF = 1.0  # seconds before asking a holder that answered busy (its serving slots full) again
MAX_BUSY = 10  # busy answers from one holder, in one fetch, before it is given up
MAX_FETCHERS = 2  # holders fetching one piece at once (the second only once no piece waits...)
# Holders one result is fetched from, at most: ids are free, and each holder that lies costs a piece
# before it is dropped, so the waste of one fetch is bounded whatever the number of ids that hold it.
MAX_HOLDERS = 8
RECRUIT_EVERY = 2.0  # seconds between two looks for more holders of a result being fetched
HEDGE_AFTER = 2.0  # ... and the piece has taken this many times the median piece so far)


class Refuted(P2PError):
    """The reference's own bytes contradict its own hashes."""

    def __init__(self, peer: PeerID, why: str) -> None:
        super().__init__(why)
        self.peer = peer


@dataclass
class Pieced:
    """One result's bytes, every piece matching the reference's hash."""

    data: bytearray | memoryview
    reference: PeerID
    sent: dict[PeerID, int] = field(default_factory=dict)  # bytes each holder delivered
    contradicted: set[PeerID] = field(default_factory=set)  # holders whose piece differed from the hash


async def fetch_range(
    conn: Connection, entry: ResultEntry, after: bytes, offset: int, length: int, timeout: float
) -> bytearray:
    """Bytes ``offset .. offset + length`` of ``entry``'s result from the holder at ``conn``: exactly
    that many (else RemoteProtocolError); ``timeout`` bounds each wait for bytes."""
    buf = bytearray(length)
    filled = 0
    records = -(-length // RECORD)
    request = ResultReq(entry.epoch, after, offset, length)
    async with conn.open_stream(RESULT_DATA, request, timeout=timeout * (2 + records)) as stream:
        while filled < length:
            with trio.fail_after(timeout):
                got = await stream.receive_some()
            if not got:
                raise RemoteProtocolError(f"its result ended {length - filled} bytes early")
            if filled + len(got) > length:
                raise RemoteProtocolError("it sent more bytes than it was asked for")
            buf[filled : filled + len(got)] = got
            filled += len(got)
        with trio.fail_after(timeout):
            await stream.response()
    return buf


def checked_pieces(answer: ResultPieces, size: int) -> list[bytes]:
    """The piece hashes of ``answer`` for a result of ``size`` bytes; RemoteProtocolError if they are
    not one hash per piece."""
    count = -(-size // answer.piece)
    if count > MAX_PIECES or len(answer.hashes) != count * HASH_BYTES:
        raise RemoteProtocolError(
            f"it names {len(answer.hashes) // HASH_BYTES} piece hash(es) for {count} piece(s) of"
            f" {answer.piece} bytes"
        )
    return [answer.hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]


async def _hash(data: bytearray) -> bytes:
    if len(data) < HASH_IN_THREAD:
        return hash_piece(data)
    return await trio.to_thread.run_sync(hash_piece, data)


async def fetch_pieces(
    reference: tuple[PeerID, Connection],
    others: list[tuple[PeerID, Connection]],
    entry: ResultEntry,
    after: bytes,
    *,
    timeout: float,
    failures: list[str],
    more: Callable[[set[PeerID]], Awaitable[list[tuple[PeerID, Connection]]]] | None = None,
    into: memoryview | None = None,
) -> Pieced:
    """``entry``'s result, every piece checked against ``reference``'s hashes, fetched from the
    reference and ``others`` (holders of a result of the same form) at once. Raises :class:`Refuted`
    when the reference contradicts itself, P2PError when it names no usable pieces or no holder could
    deliver some piece; what went wrong with each holder is appended to ``failures``. ``more(known)``,
    called every ``RECRUIT_EVERY`` seconds until the result is in: holders of a result of the same
    form found since, besides ``known`` (they fetch pieces too). ``into``: where the result's bytes go
    (``entry.size`` writable bytes, e.g. a mapped file), else a new bytearray."""
    ref_peer, ref_conn = reference
    try:
        with trio.fail_after(2 * timeout):
            answer = await ref_conn.call(RESULT_PIECES, ResultReq(entry.epoch, after), timeout=2 * timeout)
    except trio.TooSlowError:
        raise PeerUnavailable("it named no piece hashes in time") from None
    hashes = checked_pieces(answer, entry.size)
    piece, size = answer.piece, entry.size
    if into is not None and (len(into) != size or into.readonly):
        raise ValueError(f"a result of {size} bytes goes into {size} writable bytes")
    out = Pieced(bytearray(size) if into is None else into, ref_peer)
    if not hashes:
        return out  # (an empty result)
    waiting: deque[int] = deque(range(len(hashes)))
    fetching: dict[int, dict[PeerID, trio.CancelScope]] = {}
    since: dict[int, float] = {}  # when the holders fetching a piece now began it
    took: list[float] = []  # seconds each piece took, so far
    done: set[int] = set()
    changed = trio.Event()
    sources = [reference, *[(p, c) for p, c in others if p != ref_peer]][:MAX_HOLDERS]

    def wake() -> None:
        nonlocal changed
        changed.set()
        changed = trio.Event()

    def overdue(i: int) -> float:
        """Seconds until piece ``i`` (in flight) is overdue: twice the median time a piece took."""
        if not took:
            return float("inf")
        return since[i] + HEDGE_AFTER * statistics.median(took) - trio.current_time()

    def pick(peer: PeerID) -> int | float:
        """The piece ``peer`` fetches next, or (a float) how long to wait before asking again."""
        if waiting:
            return waiting.popleft()
        spare = [i for i, f in fetching.items() if f and peer not in f and len(f) < MAX_FETCHERS]
        due = min(spare, key=overdue, default=None)
        if due is not None and overdue(due) <= 0:
            return due
        return overdue(due) if due is not None else float("inf")

    def give_back(i: int) -> None:
        if i not in done and not fetching.get(i) and i not in waiting:
            waiting.appendleft(i)

    async def holder(peer: PeerID, conn: Connection) -> None:
        busy = 0
        while len(done) < len(hashes):
            i = pick(peer)
            if isinstance(i, float):
                if not waiting and not any(fetching.values()) and more is None:
                    nursery.cancel_scope.cancel()  # (nothing to fetch, nobody fetching, nobody to come)
                    return
                with trio.move_on_after(i):
                    await changed.wait()
                continue
            at = i * piece
            data = None
            later = False  # (it answered busy: asked again after a pause)
            began = trio.current_time()
            if not fetching.get(i):
                since[i] = began
            with trio.CancelScope() as scope:
                fetching.setdefault(i, {})[peer] = scope  # (cancelled once another copy is in)
                try:
                    data = await fetch_range(conn, entry, after, at, min(piece, size - at), timeout)
                except RemoteCallError as e:
                    if is_busy(e) and busy < MAX_BUSY:  # (its slots are full now: later)
                        busy, later = busy + 1, True
                    else:
                        failures.append(f"{peer.short()}: piece {i} of step {entry.epoch}: {e}")
                except (P2PError, trio.TooSlowError) as e:
                    failures.append(f"{peer.short()}: piece {i} of step {entry.epoch}: {e or 'too slow'}")
                finally:
                    fetching.get(i, {}).pop(peer, None)
            if i in done:
                continue  # (another holder's copy came first)
            if later:
                give_back(i)
                wake()
                await trio.sleep(BUSY_BACKOFF)
                continue
            if data is None:
                give_back(i)
                wake()
                return
            if await _hash(data) != hashes[i]:
                if peer == ref_peer:  # (it said both: nothing more is fetched for this reference)
                    refuted.append(f"its piece {i} of step {entry.epoch} does not match its own hash")
                    nursery.cancel_scope.cancel()
                    return
                out.contradicted.add(peer)
                failures.append(f"{peer.short()}: piece {i} of step {entry.epoch} is not the reference's")
                give_back(i)
                wake()
                return
            out.data[at : at + len(data)] = data
            out.sent[peer] = out.sent.get(peer, 0) + len(data)
            took.append(trio.current_time() - began)
            done.add(i)
            for other in fetching.pop(i, {}).values():
                other.cancel()
            if len(done) == len(hashes):
                nursery.cancel_scope.cancel()  # (copies still in flight, and the recruiting, end)
            wake()

    refuted: list[str] = []
    started: set[PeerID] = set()
    alive = 0

    async def run(peer: PeerID, conn: Connection) -> None:
        nonlocal alive
        alive += 1
        try:
            await holder(peer, conn)
        finally:
            alive -= 1

    def start(peer: PeerID, conn: Connection) -> None:
        if peer not in started:
            started.add(peer)
            nursery.start_soon(run, peer, conn)

    async def recruit() -> None:
        # holders that came to hold the result since (their records arrived later, or they stepped
        # later): a prefetch begun as the first holder's record came in had that one holder alone
        while more is not None:
            await trio.sleep(RECRUIT_EVERY)
            if len(started) < MAX_HOLDERS:
                for peer, conn in (await more(started))[: MAX_HOLDERS - len(started)]:
                    start(peer, conn)
            if not alive:  # every holder gave up, and none came
                nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for peer, conn in sources:
            start(peer, conn)
        nursery.start_soon(recruit)
    if refuted:
        raise Refuted(ref_peer, refuted[0])
    if len(done) < len(hashes):
        missing = min(set(range(len(hashes))) - done)
        raise PeerUnavailable(f"no holder delivered piece {missing} of step {entry.epoch}'s result")
    log.debug(
        "step %d's result: %s",
        entry.epoch,
        ", ".join(f"{n / 1e6:.1f} MB from {p.short()}" for p, n in out.sent.items()),
    )
    return out
