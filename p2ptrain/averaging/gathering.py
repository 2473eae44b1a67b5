"""The gathering side of an all-reduce round: fetching every partition's result, and relays.

Theory of operation: after the decision every member fetches every partition (:meth:`Gatherer.gather`)
from its holder (the reducer, or the replacement the decision names), and once that fails or stalls for
``STALLED_AFTER`` seconds, from the other members too, who relay it once they hold it (a reducer that
serves some members and then hangs cannot split the group). In a pipelined round a member fetches each
partition's mean chunk by chunk while the scatter still runs (:meth:`Gatherer.fetch_early`), held once
its reducer confirms the chunks are the round's result; the early fetch of a failed reducer is void
(:meth:`Gatherer.void`). Every fetched chunk is checked (size, finite values, its size against this
member's own values and its contributors' signed scales, which come last: ``bounds``; in an audited
round the reducer's signed attestation) before the partition counts as held; in place, this member's
own values are saved first and go back if it is refused. Bytes that break the rules are the fault of
whoever served them (``RoundMachine.fault``): that partition is not fetched again, and the round aborts
for this member.

A member that answers ``ROUND_OVER`` (or ``LEFT_ROUND``) retired the round, or never took part: it
serves nothing of it again, so it is not asked again (:attr:`Gatherer.over`). A reducer retires a round
once every member fetched what it reduced, counted as it sends; a member whose copy was lost after that
(its connection broke before the last bytes arrived) asked its reducer again until the gather deadline
(0.9 of the round's timeout), each call waiting for a round that was gone. Now it asks the members that
may still relay the partition, and once none is left, the partition is given up at once: the round
ends for this member then, and it catches up as any member that missed a round.

A member is asked only while it may still serve: not once it said the round is over, nor once this
member could not connect to it at its last try (``RoundMachine.out_of_reach``: dead, or gone from where
it was), nor, for one partition, once it answered ``NOT_HELD`` (it lacks the result and cannot reach
the holder either: a relay that waited to hold it would wait for nothing). A holder out of reach is
then given up with the last relay, as one that retired is, and a refused ask moves on to the next relay
at once instead of after the stagger (to twice as many once a whole wave refused). (At 32 simulated
peers, a reducer killed after the decision left every member asking it every 2 s, and every other
member as a relay, each waiting to hold what nobody held, until the gather deadline: 27 of the round's
30 s, the whole swarm's step; and a reducer killed just after serving the others left two members doing
so while the rest retired.)
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch
import trio

from ..errors import P2PError, RemoteCallError, RemoteProtocolError
from ..net.connection import Connection
from ..net.host import Host
from ..net.streams import RpcStream
from . import spill
from .audit import new_hasher, open_attestation
from .bandwidth import RateMeter
from .bounds import ResultCheck
from .compression import Compression, all_finite, decode, encoded_chunk
from .partition import chunks
from .protocol import (
    FETCH,
    FETCH_EARLY,
    LEFT_ROUND,
    MAX_TABLE_ENVELOPE,
    NOT_HELD,
    RELAY_RESULT,
    ROUND_OVER,
    TABLES,
    Decision,
    FetchReq,
)
from .round_machine import STALLED_AFTER, RoundMachine
from .round_tensors import RoundTensors
from .signals import RoundSignals

log = logging.getLogger("p2ptrain.averaging.allreduce")  # (the round's lines, as before)

RELAY_RETRY = 0.25  # seconds between rounds of relay queries
RELAY_STAGGER = 0.25  # seconds between asking one relay of a partition and the next (see ``gather``)

__all__ = ["RELAY_RETRY", "Gatherer", "Malformed", "OutOfBounds", "ServedFault", "time_left"]


class ServedFault(RemoteProtocolError):
    """The bytes a member served as a partition's result break the rules: its fault, whoever it is."""


class Malformed(ServedFault):
    """Not a result at all: wrong sizes, bad encodings, values that are not finite, a bad attestation."""


class OutOfBounds(ServedFault):
    """A well-formed result larger than this member accepts against its own values (see ``bounds``)."""


ASK_TABLES_FROM = 3  # members a member that lacks signed tables asks for them, one after another (at most)
ASK_TABLES_TIMEOUT = 5.0  # seconds each of them may take


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` for a call's own timeout (an enclosing scope enforces the deadline)."""
    return max(1e-3, deadline - trio.current_time())


class Gatherer:
    """Fetches the round's partitions into this member's ``flat`` (handed the round's machine and memory)."""

    def __init__(
        self,
        host: Host,
        machine: RoundMachine,
        tensors: RoundTensors,
        signals: RoundSignals,
        meter: RateMeter,
    ) -> None:
        self.host, self.m, self.t, self.sig, self.meter = host, machine, tensors, signals, meter
        self.addrs = [mm.addr for mm in machine.manifest.members]
        self.early_done: dict[int, trio.Event] = {}  # partition -> its early fetch has ended
        self.early_scopes: dict[int, trio.CancelScope] = {}
        self.attestations: dict[int, bytes] = {}  # audited: partition -> its holder's signed attestation
        self.gather_scopes: dict[int, trio.CancelScope] = {}  # partition -> its gather (after the decision)
        self.over: set[int] = set()  # members that serve nothing of this round any more (see the docstring)
        self.lacking: dict[int, set[int]] = {}  # partition -> members that said they cannot relay it
        self._tables_lock = trio.Lock()  # (one ask for the signed tables this member lacks: ``tables_for``)
        self._tables_asked = False

    def start_early(self, nursery: trio.Nursery) -> None:
        """Pipelined rounds: fetch every other partition's mean early, in ``nursery`` (cancelled once the
        round is over for this member)."""
        for p in self.m.partitions:
            if p != self.m.me:
                self.early_done[p], self.early_scopes[p] = trio.Event(), trio.CancelScope()
                nursery.start_soon(self.fetch_early, p)

    async def void(self, p: int) -> None:
        """The early results of ``p`` are not the round's (its reducer failed): stop fetching them."""
        if p in self.early_scopes:
            self.early_scopes[p].cancel()
            await self.early_done[p].wait()

    def check_attestation(self, p: int, frm: int, data: bytes, result_hash: bytes) -> None:
        """The reducer's attestation fits the decision, the bytes it served, and this member's own
        commitment; RemoteProtocolError says what does not."""
        m = self.m
        decision = m.decision
        assert decision is not None
        try:
            att = open_attestation(data, m.peers[frm], m.digest, p, m.n)
        except RemoteProtocolError as e:
            raise Malformed(f"its attestation: {e}") from None
        if att.contributors != decision.contributors or att.weights != decision.weights:
            raise Malformed("its attestation names other contributors or weights than the decision")
        if att.result != result_hash:
            raise Malformed("the result it served is not the one it attested")
        # (Ed25519 signatures are deterministic: our commitment, made again, is the same bytes)
        if m.me in att.contributors and att.commits[att.contributors.index(m.me)] != self.t.pieces(p)[1]:
            raise Malformed("its attestation does not carry this member's commitment")
        self.attestations[p] = bytes(data)

    async def gather(self, p: int, holder: int) -> None:
        """Fetch partition ``p`` (or wait for it to be finalized, if we hold it) until the gather ends."""
        m, end = self.m, self.m.at.gather
        if holder == m.me:
            with trio.move_on_at(end):
                await self.sig.finalized(p).wait()
            return
        if m.faulty(p):  # its early result broke the rules: the round is over for this member
            return
        m.fetched(p, trio.current_time())
        if p in self.early_done:
            # The early fetch confirms once its reducer has the decision: wait while it makes progress.
            done = self.early_done[p]
            while holder == p and not done.is_set():
                stalled_at = min(m.stalled_at(p), end)
                if trio.current_time() >= stalled_at:
                    break
                with trio.move_on_at(stalled_at):
                    await done.wait()
            self.early_scopes[p].cancel()
            await done.wait()
            if p in m.held or m.faulty(p):
                return
        direct_failed = trio.Event()
        async with trio.open_nursery() as nursery:
            self.gather_scopes[p] = nursery.cancel_scope  # (cancelled once its result is at fault)
            nursery.start_soon(self._fetch_from_holder, nursery.cancel_scope, p, holder, direct_failed)
            # The others fetch from the holder too: once the direct fetch failed, or stalled (a reducer
            # that serves some members and then hangs), ask them as well; each answers once it holds it.
            with trio.move_on_at(end):
                while not direct_failed.is_set():
                    stalled_at = m.stalled_at(p)
                    if trio.current_time() >= stalled_at:
                        break
                    with trio.move_on_at(stalled_at):
                        await direct_failed.wait()
                while p not in m.held:
                    relays = self.relays(holder, p)
                    if not relays and (holder in self.over or holder in m.out_of_reach):
                        log.info("partition %d: no member serves it any more: given up", p)
                        break
                    # One relay after another, each a stagger after the last, starting at a place of
                    # this member's and the partition's own (so that the askers spread over the relays):
                    # the first that holds the result answers at once and the rest are never asked.
                    # Asked all at once, every member that lacked a partition whose reducer left asked
                    # every other member: at 128 simulated peers (groups of 100) that was ~10,000 relay
                    # streams per lost partition at one instant, 547 KB of relayed results per peer per
                    # step, and minutes of the simulator's CPU at one virtual moment.
                    # Refusals are quick and tiny, but one after another they cost a round trip each: in a
                    # group of 27 whose reducer died after the decision, 5 s to hear every relay refuse
                    # (a group of 248: 50 s). So each wave of asks that all refused before the stagger
                    # is followed by one twice as wide: a wave never holds more asks than the refusals
                    # heard so far plus one, and the relays of a group are all asked in log2(n) waves.
                    start = (m.me * 7919 + p) % len(relays) if relays else 0
                    order = relays[start:] + relays[:start]
                    # (its own name: the outer nursery, cancelled below, holds the fetch from the holder)
                    async with trio.open_nursery() as asking:
                        width = 1
                        while order:
                            wave, order = order[:width], order[width:]
                            ended = [trio.Event() for _ in wave]
                            for i, done in zip(wave, ended, strict=True):
                                asking.start_soon(self._relay_from, asking.cancel_scope, p, i, done)
                            with trio.move_on_after(RELAY_STAGGER):
                                for done in ended:
                                    await done.wait()
                            if all(done.is_set() for done in ended):  # (all refused: none holds it)
                                width *= 2
                    if p not in m.held:
                        await trio.sleep(RELAY_RETRY)  # every relay failed at once: they may be back
            nursery.cancel_scope.cancel()

    def relays(self, holder: int, p: int) -> list[int]:
        """The members that may still relay partition ``p``, which ``holder`` reduced: every other one
        that still serves the round, could be reached at the last try, and did not say it cannot."""
        m = self.m
        out = self.over | m.out_of_reach | m.signed_out | self.lacking.get(p, set())
        return [i for i, a in enumerate(self.addrs) if a and i not in (m.me, holder) and i not in out]

    async def _connect(self, i: int) -> Connection:
        """A connection to member ``i``, noting whether it could be reached (``m.out_of_reach``, which
        our own relay answers read: ``serving``)."""
        m = self.m
        try:
            conn = await self.host.connect(self.addrs[i])
        except P2PError:
            if i not in m.out_of_reach:
                m.out_of_reach.add(i)
                self.sig.changed.fire()
            raise
        m.out_of_reach.discard(i)
        return conn

    async def _fetch_from_holder(
        self, scope: trio.CancelScope, p: int, holder: int, failed: trio.Event
    ) -> None:
        """Fetch partition ``p`` from its reducer, again after a pause if that failed while it lives and
        still serves the round.

        A fetch that failed on a connection that broke (its reducer's process died while it served us:
        a reset, not a refused dial) proves nothing about reach, so the holder is tried again at once
        (``_probe``: refused, it is out of reach now). Counted out of reach only at the retry, the
        holder stayed askable here for ``STALLED_AFTER``, and this member, asked as a relay, held every
        other member's ask that long: at 32 simulated peers the whole group gave a lost partition up
        2.1 s after the decision, against 0.3 s where every member's dial was refused."""
        while trio.current_time() < self.m.at.gather:
            if await self._fetch(p, holder, FETCH):
                scope.cancel()
                return
            failed.set()
            if holder in self.m.gone or holder in self.over:
                return
            retry_at = trio.current_time() + STALLED_AFTER
            if holder not in self.m.out_of_reach:
                with trio.move_on_at(retry_at):
                    await self._probe(holder)
            await trio.sleep_until(retry_at)

    async def _probe(self, i: int) -> None:
        """Whether member ``i`` can be reached now (``m.out_of_reach`` says, see ``_connect``): the
        connection held to it answers a ping, or, broken (the ping fails with it), a fresh dial is
        tried. (The connection a reset broke may still look open for a moment: asked for a connection
        then, the host hands that one back.)"""
        for _ in range(2):
            try:
                conn = await self._connect(i)
                await conn.ping(timeout=STALLED_AFTER)
                return
            except P2PError:
                if i in self.m.out_of_reach:
                    return

    async def _relay_from(self, scope: trio.CancelScope, p: int, i: int, ended: trio.Event) -> None:
        try:
            if await self._fetch(p, i, RELAY_RESULT):
                scope.cancel()
        finally:
            ended.set()

    def _held(self, p: int, check: ResultCheck, scales: tuple[bytes, ...], tables: list[memoryview]) -> None:
        """Partition ``p``'s result is all here: held once it is within the limit its contributors'
        signed scales give (``scales``: their tables' tags; ``tables``: the tables its server sent,
        those this member lacked; ``bounds.result_limit``); else :class:`ServedFault`, and nothing of it
        counts (the caller undoes what landed in place)."""
        decision = self.m.decision
        assert decision is not None
        try:
            self.t.take_tables(tables, scales, decision)
            bound = self.t.result_limit(p, decision, scales)
        except RemoteProtocolError as e:
            raise Malformed(f"its contributors' signed scales: {e}") from None
        why = check.within(bound)
        if why:
            raise OutOfBounds(why)
        self.m.held.add(p)
        self.t.results[p] = check.seen
        self.t.scales[p] = scales
        self.sig.changed.fire()

    def _fault(self, p: int, frm: int, e: ServedFault, *, relay: bool = False) -> None:
        """``frm`` served partition ``p``'s result, and it broke the rules: never applied, not fetched
        again. Proven against ``frm`` when it computed what it served (a reducer: its result, or its
        early chunks), or when the bytes are malformed (an honest relay holds checked values only); a
        relayed result out of this member's bounds may be one the relay accepted within its own: that
        counts against the holder, unproven."""
        proven = not relay or isinstance(e, Malformed)
        line = self.m.fault(p, frm, str(e), proven=proven)
        if line:
            log.warning("round %s: %s", self.m.digest.hex()[:8], line)
        if p in self.early_scopes:
            self.early_scopes[p].cancel()
        if p in self.gather_scopes:
            self.gather_scopes[p].cancel()
        self.sig.changed.fire()

    async def _fetch(self, p: int, frm: int, method: object) -> bool:
        """Fetch partition ``p`` from member ``frm`` (its reducer, or a relay); True once held."""
        m, end = self.m, self.m.at.gather
        relay = method is RELAY_RESULT
        mode = Compression.NONE if relay else self.t.mode
        target = self.t.slice(p)
        spans = list(chunks(m.sizes[p], mode))
        decision = m.decision
        assert decision is not None  # (fetched after the decision; early fetches are fetch_early)
        check = ResultCheck(self.t.result_limit(p, decision, None))  # (NOTHING where nothing passes)
        if self.t.backup is not None and p not in self.t.saved:
            # In place: the result lands in the caller's tensor before its contributors' scales, which
            # come last, bound it; this member's own values go back there if it is refused.
            await self._save(p)
        try:
            with trio.fail_after(max(0.0, end - trio.current_time())):
                await self.tables_for(decision)
                conn = await self._connect(frm)
                async with conn.open_stream(
                    RELAY_RESULT if relay else FETCH,
                    FetchReq(m.digest, p, self.t.have()),
                    timeout=time_left(end),
                ) as stream:
                    hasher = new_hasher() if self.t.audit and not relay else None
                    for a, b in spans:
                        data = await stream.receive_some()
                        if not data:
                            ack = await stream.response()
                            raise RemoteProtocolError(ack.reason or "the stream ended early")
                        if p in m.held or m.faulty(p):  # another relay was faster; its bits are the same
                            return p in m.held
                        _store(target[a:b], data, mode, 0 if relay else m.n, check)
                        m.fetched(p, trio.current_time())
                        if hasher is not None:
                            hasher.update(data)
                    tables = await self._tables(stream)
                    ack = await stream.response()  # (its contributors' table tags: the result's bound)
                    if not ack.ok:
                        raise RemoteProtocolError(ack.reason or "the fetch was refused after its data")
                    if hasher is not None:  # held only once the reducer's signed attestation checks out
                        self.check_attestation(p, frm, ack.attestation, hasher.digest())
                        self._held(p, check, ack.scales, tables)
                        return True
                    self._held(p, check, ack.scales, tables)
                    self.meter.flow_done("download")
        except ServedFault as e:
            if p in m.held:  # (another relay was faster: these bytes landed nowhere)
                return True
            self.t.restore(p)
            self._fault(p, frm, e, relay=relay)
            return False
        except (P2PError, trio.TooSlowError) as e:
            if p in m.held:
                return True
            said = RELAY_RESULT.name if relay else FETCH.name  # (only ``frm``'s own answer says it is over)
            if isinstance(e, RemoteCallError) and e.method == said and e.code in (ROUND_OVER, LEFT_ROUND):
                self.over.add(frm)
            if isinstance(e, RemoteCallError) and relay and e.method == said and e.code == NOT_HELD:
                self.lacking.setdefault(p, set()).add(frm)
            if not relay:
                log.info("could not fetch partition %d from %s: %s", p, m.name(frm), e)
            return False
        self.sig.changed.fire()
        return True

    async def fetch_early(self, p: int) -> None:
        """Fetch partition ``p``'s mean from its reducer chunk by chunk while the scatter runs, into
        ``flat``; held once the reducer confirms the chunks are the round's result (else the gather
        fetches it again)."""
        m, t, end = self.m, self.t, self.m.at.gather
        target, spans = t.slice(p), list(chunks(m.sizes[p], t.mode))
        check = ResultCheck(None)  # (no decision yet: bounded once it is in, before it counts as held)
        got = 0
        try:
            with self.early_scopes[p], trio.fail_after(max(0.0, end - trio.current_time())):
                # (backed up before the stream opens: its chunks then all land in place, see land_in)
                if t.backup is not None and p not in t.saved and not await self._save(p):
                    return  # no backup, no early averages: the gather fetches them after the decision
                conn = await self._connect(p)
                async with conn.open_stream(
                    FETCH_EARLY, FetchReq(m.digest, p), timeout=time_left(end)
                ) as stream:
                    t.early_target(p)
                    if t.mode is Compression.NONE:  # decrypted straight into place: no copy
                        stream.land_in(target[a:b].numpy().data for a, b in spans)
                    for a, b in spans:
                        data = await stream.receive_some()
                        if not data:
                            break
                        _store(target[a:b], data, t.mode, m.n, check)
                        m.fetched(p, trio.current_time())
                        got += 1
                    tables: list[memoryview] = []
                    if got == len(spans):
                        self.meter.flow_done("download")
                        with trio.move_on_at(end):  # (its reducer has it: this member will, soon)
                            await self.sig.decided.wait()
                        if m.decision is not None:
                            await self.tables_for(m.decision)
                        # the tables it holds now (those of the slices it reduced itself are in): its
                        # reducer sends the others (none, if the early chunks are void: it answered)
                        with contextlib.suppress(P2PError):
                            await stream.send(t.have())
                            await stream.send_eof()
                        tables = await self._tables(stream)
                    ack = await stream.response()
                if ack.ok and got == len(spans) and m.decision is not None:
                    self._held(p, check, ack.scales, tables)
        except ServedFault as e:  # from its reducer: its own fault; what landed in place is undone
            t.restore(p)
            self._fault(p, p, e)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("no early result of partition %d from %s: %s", p, m.name(p), e)
        finally:
            self.early_done[p].set()

    async def tables_for(self, decision: Decision) -> None:
        """Before a fetch names the signed tables this member holds: where it lacks the table of a
        decided contributor (it reduced nothing, or that contributor's slice to it did not arrive), ask
        one member for all it lacks, once a round: the servers of its partitions, asked at the same
        time, would each send it every table it lacks (up to k^2 tables a round instead of k). Its other
        fetches wait for that ask; if it fails, each server sends what is still missing (``bounds``)."""
        m, t = self.m, self.t
        if not t.lacks(decision.contributors):
            return
        async with self._tables_lock:
            if self._tables_asked or not t.lacks(decision.contributors):
                return
            self._tables_asked = True
            servers = [i for i, a in enumerate(self.addrs) if a and i != m.me and i not in m.gone]
            start = int.from_bytes(m.peers[m.me].digest[:4], "big")
            for k in range(min(ASK_TABLES_FROM, len(servers))):
                i = servers[(start + k) % len(servers)]
                try:
                    with trio.fail_after(
                        max(0.0, min(ASK_TABLES_TIMEOUT, m.at.gather - trio.current_time()))
                    ):
                        conn = await self.host.connect(self.addrs[i])
                        req = FetchReq(m.digest, 0, t.have())
                        async with conn.open_stream(TABLES, req, timeout=time_left(m.at.gather)) as stream:
                            tables = await self._tables(stream)
                            ack = await stream.response()
                    if ack.ok:
                        t.take_tables(tables, ack.scales, decision)
                except (P2PError, trio.TooSlowError, ServedFault) as e:
                    log.info("could not get the signed scales this member lacks from %s: %s", m.name(i), e)
                if not t.lacks(decision.contributors):
                    return

    async def _tables(self, stream: RpcStream) -> list[memoryview]:
        """What a result's server sends after it, up to its end: the signed scale tables of its
        contributors that this member lacks (see ``bounds``), at most one per member."""
        out: list[memoryview] = []
        while data := await stream.receive_some():
            if len(out) >= self.m.n or len(data) > MAX_TABLE_ENVELOPE:
                raise Malformed("more signed scales than the round's members sign, or one too large")
            out.append(data)
        return out

    async def _save(self, p: int) -> bool:
        """In place: this member's values of partition ``p`` to the backup, before results overwrite them
        (in a worker thread when large; nothing writes into the partition meanwhile). False if the
        backup cannot be written (a full disk)."""
        assert self.t.backup is not None
        data = encoded_chunk(self.t.slice(p), Compression.NONE)
        try:
            saved = await spill.put(self.t.backup, data)
        except OSError as e:
            log.warning("cannot back partition %d up (%s): fetching its average after the decision", p, e)
            return False
        self.t.keep_saved(p, saved)
        return True


def _store(
    target: torch.Tensor, data: memoryview, mode: Compression, members: int, check: ResultCheck
) -> None:
    """Decode a fetched chunk (a reduced sum of ``members``: see ``compression.encode``) into its place,
    once ``check`` passed it; :class:`Malformed` if it is malformed or not finite, :class:`OutOfBounds`
    if it is beyond this member's bounds. Nothing lands of a chunk that fails, unless the stream
    decrypted it in place already (``RpcStream.land_in``: the caller then restores what was there)."""
    if mode is not Compression.NONE:
        try:
            values = decode(data, mode, target.numel(), members)
        except RemoteProtocolError as e:
            raise Malformed(str(e)) from None
        _check(check, values)
        target.copy_(values)
        return
    if len(data) != 4 * target.numel():
        raise Malformed(f"a chunk of {len(data)} bytes where {4 * target.numel()} were expected")
    place, raw = target.numpy(), np.frombuffer(data, dtype=np.float32)
    if raw.ctypes.data == place.ctypes.data:  # decrypted in place (RpcStream.land_in): check it there
        if not all_finite(target):
            raise Malformed("a reduced partition holds NaN or infinite values")
        _check(check, target)
        return
    if not np.isfinite(raw.min()) or not np.isfinite(raw.max()):
        raise Malformed("a reduced partition holds NaN or infinite values")
    _check(check, raw)
    place[:] = raw


def _check(check: ResultCheck, values: torch.Tensor | np.ndarray) -> None:
    why = check.add(values)
    if why:
        raise OutOfBounds(why)
