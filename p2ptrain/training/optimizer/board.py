"""The progress board: this peer's progress records out, the swarm's in, and what they decide.

Theory of operation: every peer publishes a signed progress record (its epoch, samples, rate, state
digest, averager address; see ``progress``) under its owned subkey of the run's progress key, at once
when it changed much and at least once a heartbeat (half the record's ``ttl``), and offers each
new record directly to the partners it trains with (``_offer_to``), so that their reads in between
need ask nobody: a read asks the DHT's replicas once a record's life, and whenever this peer's view is
unsure (none yet, alone, behind, a partner's record late). Every read, of the replicas or of what it
holds, first pulls from one of those partners in turn the newer records it holds (``DHT.pull``,
``DHT.get(via=...)``): news spreads from reader to reader, and the replicas send only what no partner
had, so that the key's closest nodes do not serve every reader every changed record. A run of many
peers spreads the records over several keys (``progress.buckets``, see ``buckets``): each peer's go
under its bucket's key, and a read reads them all, so that each key's replicas serve a part of the
swarm's records, and no key approaches the DHT's cap on a key's bytes. What it reads
becomes the ``SwarmView`` (``progress.swarm_view``) that decides when the epoch's target is reached
and who is on it; only the records of the peers this one trusts (:meth:`ProgressBoard.trusted`) may
move it to another state, and only the digest they vouch for is downloaded
(:meth:`ProgressBoard.vouched_digest`).
The same records bound the weight a peer may count for in a round (:meth:`ProgressBoard.claim`,
:meth:`ProgressBoard.weight_cap`: the averager caps the members of this peer's rounds with it).

:class:`ProgressBoard` owns the records read, the view, and the loop that publishes and reads; it reads
this peer's position from the ``Tally`` and its digest from the ``SharedState``, and tells the rules of
steps alone (``solo``) what each read showed. The swarm's ban records are read on the same loop's
schedule (``bans``).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import trio

from ...averaging.agreement import WEIGHT_SLACK
from ...config import RunConfig
from ...dht.records import Entry, owned_subkey
from ...dht.spread import bucket_of
from ...errors import P2PError, RemoteProtocolError
from ...identity import PeerID
from ...net.address import PeerAddress
from ...node import Node
from ...waits import either
from ...wire.codec import pack, unpack
from .bans import BAN_READ_INTERVAL, BanBook
from .bookkeeping import Tally
from .buckets import Regions, SampledBuckets, progress_keys, region_buckets
from .progress import (
    SPREAD,
    PeerProgress,
    ProgressRecord,
    SwarmView,
    must_publish,
    plausible_samples,
    rate_claimed,
    record_horizon,
    sent_addr,
    spread_cap,
    swarm_view,
    vouched_digest,
    vouched_roots,
    with_author,
)
from .shared_state import SharedState
from .solo import StepAlone
from .wake import Wake

log = logging.getLogger("p2ptrain.training.collaborative")  # (the optimizer's lines, as before)

PUBLISHING = 2  # overdue records sent in the background at once (see ``ProgressBoard._send``)
FAR_CLAIM = 8  # an untrusted record this many steps past the trusted peers' is refused out loud
MAX_REFUSED = 1024
MAX_OFFERS = 32  # partners a new record goes to directly (the others read it from the DHT)
PULL_SOURCES = 8  # fellow readers a peer's pulls take in turn, at least (see ``_pull_from``)
MAX_SAID = 256  # superseded records kept for their step's digest (see ``said_on``)
# A record that arrives here wakes the loop (a trusted peer's view reached the target: look for a group
# now, not at the next read, seconds later), at most once per this many seconds
ARRIVAL_PAUSE = 0.25
LEAD_SMOOTHING = 0.3  # how fast the expected time to form a group follows what groups took
SWARM_RATE_READS = 5  # a split swarm's estimate of the swarm's rate: about the last this many reads


def turned(via: list[PeerAddress], i: int) -> list[PeerAddress]:
    """``via`` turned by ``i`` places: the pulls of a read's keys, each taking the partners in turn from
    another one, ask as many partners as there are keys (up to all of them), not one for every key."""
    if not via:
        return via
    i %= len(via)
    return via[i:] + via[:i]


@dataclass
class RegionClaims:
    """What the records of a peer's region say of its group of a step (``ProgressBoard._region_claims``):
    how many are past the step and on it, whether one on it or arriving says it may lead (``led``), and
    whether one past it says it came there by a round (``taken``)."""

    past: int = 0
    here: int = 0
    led: bool = False
    taken: bool = False


class ProgressBoard:
    """Publishing this peer's progress records and reading the swarm's."""

    def __init__(
        self,
        node: Node,
        config: RunConfig,
        *,
        fingerprint: bytes,
        tally: Tally,
        state: SharedState,
        alone: StepAlone,
        bans: BanBook,
        wake: Wake,
        clock: Callable[[], float],
    ) -> None:
        """``wake`` is set by whatever changes this peer's record (the board then publishes at once)."""
        self.node, self.config, self.fingerprint, self.clock = node, config, fingerprint, clock
        self.tally, self.state, self.alone, self.bans, self.wake = tally, state, alone, bans, wake
        # The records' keys: one per bucket of peers (``progress.buckets``), all read; this peer's
        # records go under its own bucket's (``key``), and a record under any other is not read
        self.spread = progress_keys(node.config.run_id, config.progress.buckets.bit_length() - 1)
        self.bits, self.keys = self.spread.bits, list(self.spread.keys)
        self.key = self.key_of(node.peer_id)
        # A step's swarm split into regions (``progress.regions``): this peer's view of a step counts the
        # records of its region at that step alone (``region_records``)
        self.regions = Regions.of(config.progress.buckets, config.progress.regions)
        self.bucket = bucket_of(node.peer_id.digest, self.bits)
        # the buckets of the read in progress (``reading``), and the pool of the sampled ones
        self._read_buckets = len(self.keys)
        self._sampled = SampledBuckets(random.Random(node.peer_id.digest), period=config.progress.ttl)
        # a split swarm: the swarm's samples per second, smoothed over reads (``note_read``)
        self._swarm_rate: float | None = None
        self.region_behind = False  # a split swarm: the last view's region alone says this peer is behind
        # a split swarm: the step its trusted peers say to be on, in its region or the swarm (the last
        # view's, taken as it is: see ``CollaborativeOptimizer._keeps_pace``)
        self.swarm_newest = 0
        self.view: SwarmView | None = None
        self._records: list[PeerProgress] = []
        self._by_peer: dict[PeerID, PeerProgress] = {}  # each peer's record in ``records``
        self.leaving = False
        self.lead = 0.5  # seconds a group takes to form: matchmaking starts that long before the target
        self.met_swarm = False  # records were read once the DHT had bootstrapped (see StepAlone)
        self._said: dict[tuple[PeerID, int], ProgressRecord] = {}  # see ``said_on``
        self.counting: dict[PeerID, ProgressRecord] = {}  # see refresh()
        # Each subkey's record as last read, parsed: every read returns every record, most unchanged
        # (parsing them all again was most of a read's cost to a peer of a swarm of dozens)
        self._parsed: dict[bytes, tuple[bytes, PeerProgress]] = {}
        # the last record read of each member of this peer's round, kept past its expiry until a read of
        # the replicas says more (``progress.swarm_view``'s ``expired``)
        self._members_read: dict[PeerID, PeerProgress] = {}
        self._refused: set[PeerID] = set()  # peers whose far-off step claims were refused (said once)
        self._arrived = trio.Event()  # a record arrived (see ``_progress_loop``)
        self._published: ProgressRecord | None = None  # the last record that went out
        self._publishing = 0  # overdue records being sent in the background (see ``_send``)
        self._records_read = trio.Event()
        self._asked_at = -math.inf  # when the replicas were last read (see asks_replicas)
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish progress and read the swarm's, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._progress_loop)
            nursery.start_soon(self._heartbeats)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @property
    def records(self) -> list[PeerProgress]:
        """The swarm's records as last read (one a peer)."""
        return self._records

    @records.setter
    def records(self, records: list[PeerProgress]) -> None:
        self._records = records
        self._by_peer = {}
        for r in records:
            self._by_peer.setdefault(r.peer, r)

    def _rate_cap(self) -> float:
        """The most one record's rate counts for in a split swarm's rates (``rate_claimed``): ``SPREAD``
        times the lower median of this peer's and its trusted peers' rates, on any step."""
        trusted, me = self.trusted(), self.node.peer_id
        if trusted is None:
            return math.inf
        vouched = [r.record.rate for r in self._records if r.peer in trusted and r.peer != me]
        return spread_cap([self.tally.rate.rate, *vouched], SPREAD)

    def note_read(self, records: list[PeerProgress]) -> None:
        """The records of a read of the replicas (every key ``reading`` named, each whole): they are the
        swarm's records now, and a split swarm's peer folds them into its estimate of the swarm's samples
        per second (every live record read, on any step, each capped by ``_rate_cap``, scaled from the
        buckets read to all of them), smoothed over about ``SWARM_RATE_READS`` reads. (A read of what
        this peer holds is not one: it may hold none of a sampled key's records.)

        A region's share of the target is its rate over this (``_view``). Taken from one read's records
        on the step alone, as before, peers of one region computed targets up to twice apart (the
        sampled buckets differ from read to read and from peer to peer), and a region whose step the
        rest of the swarm had left saw the swarm's rate shrink to its own and its target rise to twice
        its share: 64 simulated peers over 8 regions, one region's targets of a step ranged from 830
        to 1,280 samples, and a region a step late took its next step with twice the target."""
        self.records = records
        if not self.regions.split:
            return
        me = self.node.peer_id
        others = [r for r in records if r.peer != me]
        run, work = self.fingerprint, self.config.run.id_work
        claimed = rate_claimed(others, run=run, min_work=work, cap=self._rate_cap())
        total = (self.tally.rate.rate + claimed) * len(self.keys) / max(1, self._read_buckets)
        if self._swarm_rate is None or self._swarm_rate <= 0:
            self._swarm_rate = total
        else:
            self._swarm_rate += (total - self._swarm_rate) / SWARM_RATE_READS

    def note_arrival(self) -> None:
        """A record arrived (stored here as a replica, or offered): the loop reads what it holds."""
        self._arrived.set()

    def key_of(self, peer: PeerID) -> bytes:
        """The key ``peer``'s records go under: its bucket's (the run's one progress key with one)."""
        return self.spread.key_of(peer)

    def reading(self) -> list[bytes]:
        """The bucket keys a read asks for. With one region, every key. A swarm split into regions: this
        peer's region's keys at its step and at the next (the records its views, quorums and groups
        count), a newcomer's join peers' buckets (its only trusted peers: their records say which step
        to be on), and ``SAMPLED`` others drawn at each read from a pool that moves on by one
        bucket a record's life (``buckets.SampledBuckets``: the swarm's rate, which its region's share of
        the target follows, ``_view``): at most ``2^(span+1) + joins + SAMPLED`` keys of about ``N /
        buckets`` records each, whatever the swarm's size, instead of all of them.
        Its partners' buckets are not read: after a turn of regions its partners are in its own bucket
        and each bucket one dimension away, ``bits + 1`` more keys (every key but one of 8)."""
        if not self.regions.split:
            self._read_buckets = len(self.keys)
            return self.keys
        wanted = self._followed() | set(self._sampled.read(self.bucket, self.bits, self.clock()))
        self._read_buckets = len(wanted)
        return [self.keys[b] for b in sorted(wanted)]

    def _regions_now_and_next(self) -> set[int]:
        """A split swarm's peer's region's buckets at its step and at the next."""
        epoch, bits, span = self.tally.epoch, self.bits, self.regions.span
        return set(region_buckets(self.bucket, bits, epoch, span)) | set(
            region_buckets(self.bucket, bits, epoch + 1, span)
        )

    def _followed(self) -> set[int]:
        """The buckets whose records a split swarm's peer follows between reads of the replicas: its
        region's at its step and at the next, and while it is a newcomer (not ``anchored``: its join
        peers are all it trusts), its join peers' (see ``reading``).

        Followed for good, a join peer's bucket was read at every read by every peer that joined
        through it, and a swarm's well-known address is most joiners' join peer: its bucket's key had
        O(N) readers, and its closest replica was the busiest node of every simulated run (the first
        peer's bucket, ``progress 17/32`` at 512 peers: 345 KB of replies a step, 4.3x the median; and
        ``34/64`` at 1,024). A peer with partners has them as its anchors, in its region or offering it
        their records (``_offer_to``); its join peers' records still count when a read brings them."""
        # (its partners of other regions offer it their new records: see ``_offer_to``; counted a step
        # less there, they say little its region's records do not: see ``_view``)
        followed = self._regions_now_and_next()
        if not self.anchored:
            followed |= {bucket_of(p.digest, self.bits) for p in self.node.join_peers}
        return followed

    def ban_buckets(self) -> list[int] | None:
        """The buckets whose ban records a read asks for (``BanBook.read``: accusations go under the
        accused's bucket's key): those of the peers this one may average with. A split swarm's peer,
        its region's at its step and at the next, ``2^(span+1)`` keys at most whatever the swarm's size;
        None (every bucket) with one region, whose groups may hold anyone."""
        return sorted(self._regions_now_and_next()) if self.regions.split else None

    def pulling(self) -> list[bytes]:
        """The keys pulled from partners between reads of the replicas: with one region, every key; a
        split swarm's peer, ``reading``'s less the sampled ones. Those stand for the swarm's rate, which
        only reads of the replicas update (``note_read``): pulled at every read interval (a sampled key
        read once stays in the read cache), then drawn anew each read, they were 4 of the 9 or so keys a
        peer of 256 simulated ones pulled, 16 records a key, that nothing between two reads looks at."""
        if not self.regions.split:
            return self.keys
        return [self.keys[b] for b in sorted(self._followed())]

    async def _pull(self, via: list[PeerAddress]) -> None:
        """Pull the followed keys' newer records from a partner (``DHT.pull``, each key at once, each
        from another partner: see :func:`turned`)."""
        async with trio.open_nursery() as nursery:
            for i, key in enumerate(self.pulling()):
                nursery.start_soon(self.node.dht.pull, key, turned(via, i))

    async def _read_keys(self) -> dict[bytes, dict[bytes, Entry]] | None:
        """Every key's records from the replicas, read at once, each pulled first from a partner;
        None when any read failed (the view is then left as it was: a view missing a bucket would
        count a part of the swarm out)."""
        via = self._pull_from()
        read: dict[bytes, dict[bytes, Entry]] = {}
        failed: list[P2PError] = []

        async def one(i: int, key: bytes) -> None:
            try:
                read[key] = await self.node.dht.get(key, quorum=3, via=turned(via, i), written=True)
            except P2PError as e:
                failed.append(e)

        async with trio.open_nursery() as nursery:
            for i, key in enumerate(self.reading()):
                nursery.start_soon(one, i, key)
        if failed:
            log.info("could not read progress records: %s", failed[0])
            return None
        return read

    def group_took(self, seconds: float) -> None:
        """A group formed after ``seconds``: matchmaking starts about that long before the target."""
        self.lead += LEAD_SMOOTHING * (seconds - self.lead)

    async def _progress_loop(self) -> None:
        await self.node.dht.bootstrapped.wait()
        interval = self.config.progress.interval
        next_bans = self.clock()
        now, next_read = True, trio.current_time()
        for key in self.keys:
            self.node.dht.watch(key, self.note_arrival)
        while True:
            self.wake.renew()
            record = self.record()
            tolerance = max(self.config.training.target_batch_size / 16, 1.0)
            if now or must_publish(self._published, record, self._heartbeat, tolerance):
                await self.publish(record)
            # Woken by a record that arrived (stored here as a replica, or offered): it is held already,
            # and the reads that may ask the replicas keep their own pace.
            due = now or trio.current_time() >= next_read
            network = due and self.asks_replicas()
            if due and not network:  # (a read of the replicas pulls first itself)
                await self._pull(self._pull_from())
            await self.refresh(network=network)
            soon = trio.current_time() + self._next_read(interval)
            next_read = soon if due else min(next_read, soon)
            # Only audited rounds convict (a ban names a round whose proof the accuser holds), and a
            # peer averages only with peers under the same rules: a run without audits has no ban of
            # anyone it may meet. (A read of a key nobody wrote asks every replica.)
            if self.config.averaging.audit and self.clock() >= next_bans:
                await self.bans.read(self.ban_buckets())
                next_bans = self.clock() + BAN_READ_INTERVAL
            arrived = self._arrived = trio.Event()
            with trio.move_on_at(min(next_read, self._next_beat(interval))):
                # After an arrival, the next one waits a moment (a round's members' records come
                # together: one read for them); this peer's own new record does not.
                if not due:
                    with trio.move_on_after(ARRIVAL_PAUSE):
                        await self.wake.wait()
                if not self.wake.is_set():
                    await either(self.wake.event, arrived)
            now = self.wake.is_set()

    async def _heartbeats(self) -> None:
        """Send this peer's record in the background once its heartbeat is overdue by a read interval:
        the loop waits for its stores' replies and for its reads, and those queue behind whatever this
        peer's link carries (see ``_send``). A loop that keeps up publishes every heartbeat itself."""
        interval = self.config.progress.interval
        while True:
            last = self._published
            if last is None:  # (the loop sends the first record, and one after a failure)
                await trio.sleep(interval)
                continue
            due = last.time + self._heartbeat + interval
            await trio.sleep(max(0.0, due - self.clock()))
            if self._published is last and self.clock() >= due:
                self._send(self.record())
                await trio.sleep(interval)  # (at most one a read interval, sent or not: ``PUBLISHING``)

    def _next_beat(self, interval: float) -> float:
        """When (trio time) this peer's heartbeat is due: its last record's time plus a heartbeat, at
        least ``interval`` from now (a store that failed is tried again, not at once). Woken only for
        reads, the heartbeat went out up to a read's wait late: records lived twice a heartbeat."""
        if self._published is None:
            return math.inf
        due = self._published.time + self._heartbeat - self.clock()
        return trio.current_time() + max(due, interval)

    def _next_read(self, interval: float) -> float:
        """Seconds until the next read of the swarm's records: every ``interval`` near the target (and
        while behind, or with no rate measured yet); a quarter of the time left until the target when
        that is longer, up to a heartbeat (what the others' records change meanwhile, they publish at
        once: a step, a round landing, leaving)."""
        view = self.view
        if view is None or view.behind or not math.isfinite(view.eta):
            return interval
        return min(max(interval, (view.eta - self.lead) / 4), self._heartbeat)

    def asks_replicas(self) -> bool:
        """Whether the next read asks the DHT's replicas, or reads what this peer holds: its last read,
        and the records its partners offered it since (each peer sends its new records to the peers
        it trains with, see ``_offer_to``). The replicas are asked once a record's life (``ttl``: a
        newcomer offers its records to the peers it read, so they hear of it before), and whenever this
        peer's view is unsure (none yet, alone, behind), for peers it does not know yet and for offers
        that did not arrive: a partner's record older than its heartbeats allow was not offered."""
        view, now = self.view, self.clock()
        if view is None or view.behind or view.peers <= 1 or now - self._asked_at >= self.config.progress.ttl:
            return True
        late = self._heartbeat + 2 * self.config.progress.interval  # (a loop's wait past a heartbeat)
        offered = {a.peer_id for a in self._offer_to()}  # (this run's, trusted, not leaving: they offer)
        return any(now - r.record.time > late for r in self.records if r.peer in offered)

    def _record_addrs(self) -> Iterator[tuple[PeerID, PeerAddress]]:
        """The averager addresses of this run's peers whose records were read, newest records first:
        this peer, peers leaving, and addresses that name another peer left out."""
        for r in sorted(self.records, key=lambda r: -r.record.time):
            rec = r.record
            if r.peer == self.node.peer_id or rec.leaving or rec.run != self.fingerprint or not rec.addr:
                continue
            try:
                addr = PeerAddress.parse(rec.addr)
            except ValueError:
                continue
            if addr.peer_id == r.peer:
                yield r.peer, addr

    def _offer_to(self) -> list[PeerAddress]:
        """Where this peer's new records go directly: the averagers of the partners whose records it
        read (trusted ones only, where it trusts some), newest records first, at most ``MAX_OFFERS``."""
        trusted = self.trusted()
        out: list[PeerAddress] = []
        for peer, addr in self._record_addrs():
            if trusted is None or peer in trusted:
                out.append(addr)
                if len(out) >= MAX_OFFERS:
                    break
        return out

    def _pull_from(self) -> list[PeerAddress]:
        """Where this peer's pulls go, each in turn: its partners (``_offer_to``), and while those are
        fewer than ``PULL_SOURCES``, other peers of the run whose records it read, in an order of its
        own (a hash of both ids), so that readers that share their few partners spread their pulls. A
        pull takes only newer versions, signed by their owners, of the records a read brought
        (``DHT.pull``): a fellow reader needs no trust to serve one, and one that serves nothing or
        junk costs a pull's wait. With partners alone, a swarm's start made its first peer (everyone's
        join peer, so everyone's one partner) the source of every pull: at 256 simulated peers it sent
        18.9 MB of pulls a step, 46 times the median node's control bytes.

        A split swarm's peer pulls from the peers of its region at its step alone, in that order: they
        read the keys it reads most (its region's), and its partners of other regions and its join
        peers (which every newcomer names: at 128 simulated peers over four regions the first peer sent
        1.1 MB of pulls a step, 4.2x the median) are no better sources than any of them."""
        me = self.node.peer_id.digest
        if self.regions.split:
            region = {r.peer for r in self.region_records(self.tally.epoch)}
            ordered = sorted(
                (
                    (hashlib.blake2b(me + peer.digest, digest_size=8).digest(), addr)
                    for peer, addr in self._record_addrs()
                    if peer in region
                ),
                key=lambda o: o[0],
            )
            return [addr for _, addr in ordered[:PULL_SOURCES]]
        out = self._offer_to()
        if len(out) >= PULL_SOURCES:
            return out
        have = {a.peer_id for a in out}
        others = [
            (hashlib.blake2b(me + peer.digest, digest_size=8).digest(), addr)
            for peer, addr in self._record_addrs()
            if peer not in have
        ]
        others.sort(key=lambda o: o[0])
        return out + [addr for _, addr in others[: PULL_SOURCES - len(out)]]

    @property
    def _heartbeat(self) -> float:
        """The longest a record of this peer goes without a successor (see ``progress.must_publish``):
        half its life, so that its successor reaches the replicas and partners with half a life to
        spare. (Each heartbeat is a store on every replica: a steady peer's most frequent record.)"""
        return self.config.progress.ttl / 2

    @property
    def _horizon(self) -> float:
        """How long others' records are extrapolated (``progress.record_horizon``)."""
        return record_horizon(self.config.progress)

    def record(self) -> ProgressRecord:
        addr = sent_addr(self.node.averager.address(), self.node.peer_id)
        return ProgressRecord(
            epoch=self.tally.epoch,
            samples=self.tally.samples,
            rate=self.tally.rate.rate,
            time=self.clock(),
            digest=self.state.digest,
            addr=addr,
            run=self.fingerprint,
            landing=self.tally.landing,
            leaving=self.leaving,
            since=self.tally.since,
            work=self.node.host.work or b"",
            ready=self._reached(),
            toward=self.toward(),
            anchored=self.anchored,
            averaged=self.tally.averaged,
        )

    def _reached(self) -> bool:
        """What this peer's record says of its step (``ready``): its view reached the target, or, a
        peer that leads its region by what every record says (``leads_by_heard``), that did."""
        view = self.view
        if view is None or view.epoch != self.tally.epoch:
            return False
        return view.ready or (view.heard >= view.target and self.leads_by_heard(view))

    @property
    def anchored(self) -> bool:
        """Whether this peer trusts more than its join peers: it has averaged with peers it verified, or
        it has no join peers (the swarm's first peer). A newcomer is not: see ``RoundRunner._form_group``."""
        node = self.node
        return bool(node.averager.partners) or not node.join_peers

    def toward(self) -> int:
        """The step this peer is catching up to (its record's ``toward``): the one after a round joined
        ahead of its step, else the one its replay in flight lands it on; 0: none."""
        if self.tally.ahead is not None:
            return self.tally.ahead + 1
        flight = self.state.download
        return flight.target if flight is not None and flight.replaying else 0

    def _send(self, record: ProgressRecord) -> None:
        """Publish ``record`` in the background (:meth:`_heartbeats`). A store's requests reach the
        replicas at once, but their replies queue behind whatever else this peer's link carries: a
        home peer whose replay of a step filled its downlink for 3.6 s waited that long for each store's
        replies and each read, published its next record only then, and its record (3 s of life)
        expired at the others meanwhile; they sized the step's group without it and gave its place to
        a peer they knew. Stores sent so are bounded (``PUBLISHING`` in flight); a later store always
        wins over an earlier one still in flight (its expiry is later)."""
        if self._nursery is None or self._publishing >= PUBLISHING:
            return
        self._published, self._publishing = record, self._publishing + 1
        self._nursery.start_soon(self._publish_sent, record)

    async def _publish_sent(self, record: ProgressRecord) -> None:
        try:
            await self.publish(record)
        finally:
            self._publishing -= 1

    async def publish(self, record: ProgressRecord | None = None) -> None:
        """Store ``record`` (this peer's current one if None) on the replicas, offered to the partners."""
        record = record or self.record()
        try:
            await self.node.dht.store(
                self.key,
                pack(record.to_obj()),
                ttl=self.config.progress.ttl,
                subkey=owned_subkey(self.node.peer_id),
                sign=True,
                offer_to=self._offer_to(),
            )
        except P2PError as e:
            log.warning("could not publish progress: %s", e)
            if self._published is record:
                self._published = None  # (the loop's next turn publishes again)
        else:
            if self._published is None or self._published.time <= record.time:
                self._published = record

    async def refresh(self, *, network: bool = True) -> None:
        """Read the swarm's progress records, every bucket's (signatures checked by the DHT; malformed
        ones skipped); ``network=False``: those this peer holds (see ``asks_replicas``), asking nobody."""
        if network:
            # first the newer records a partner holds, then the replicas (what is left)
            read = await self._read_keys()
            if read is None:
                return
            self._asked_at = self.clock()
        else:
            read = {key: self.node.dht.held(key) for key in self.reading()}
        # only owned subkeys (the DHT checked that the peer named signed it), each under its owner's
        # bucket: a peer counts once, and filling a bucket takes ids of that bucket
        entries = self.spread.owned(read)
        records = []
        banned = self.node.averager.auditor.banned
        vouched = self.trusted()
        failed_us = self.node.averager.groups.leaders.excluded_peers(self.clock())
        for subkey, (peer, entry) in entries.items():
            if peer in banned or (peer in failed_us and vouched is not None and peer not in vouched):
                # A peer banned here, or a stranger that failed this peer as a leader (it held us and
                # delivered nothing), counts for nothing: counting it toward the step's peers would
                # hold every group to its leader's deadline, each step, while it never joins one.
                continue
            parsed = self._parsed.get(subkey)
            if parsed is None or parsed[0] != entry.value:  # (a record read again: parsed once)
                try:
                    rec = ProgressRecord.from_obj(unpack(entry.value))
                except RemoteProtocolError:
                    continue
                parsed = self._parsed[subkey] = (entry.value, PeerProgress(peer, with_author(rec, peer)))
            records.append(parsed[1])
        if network:
            self.note_read(records)
        else:
            self.records = records
        cohort = self.cohort()
        kept = {} if network else self._members_read  # (a read of the replicas says who is still there)
        self._members_read = {p: r for p, r in kept.items() if p in cohort} | {
            r.peer: r for r in records if r.peer in cohort
        }
        if len(self._parsed) > 2 * len(entries) + MAX_OFFERS:  # (the records of peers gone)
            self._parsed = {k: v for k, v in self._parsed.items() if k in entries}
        # Only what could vouch later: the trusted peers' records of this run (a hundred free ids
        # writing records would otherwise push the trusted ones out of the history).
        trusted = self.trusted()
        for r in records:
            if (
                r.record.digest
                and r.record.run == self.fingerprint
                and (trusted is None or r.peer in trusted)
            ):
                self._said.pop((r.peer, r.record.epoch), None)
                self._said[(r.peer, r.record.epoch)] = r.record
        while len(self._said) > MAX_SAID:
            del self._said[next(iter(self._said))]
        # What each peer last said about the samples of an epoch it was still counting: once it hands
        # them to the epoch's round, its records count toward the next one (``landing``).
        counting: dict[PeerID, ProgressRecord] = {}
        for r in records:
            if not r.record.landing:
                counting[r.peer] = r.record
            elif r.peer in self.counting:
                counting[r.peer] = self.counting[r.peer]
        self.counting = counting
        self.met_swarm = self.met_swarm or self.node.dht.bootstrapped.is_set()
        self.update_view()
        self._reach_directly()
        self._records_read.set()
        self._records_read = trio.Event()

    def _reach_directly(self) -> None:
        """Behind a NAT: dial the other NATed peers at the relayed addresses their records give, so that
        hole punches (``net.punch``) connect them directly before a round needs it."""
        host = self.node.host
        if self.node.dht.reachable is not False or not host.punch.enabled or self._nursery is None:
            return
        for r in self.records:
            try:
                addr = PeerAddress.parse(r.record.addr) if r.record.addr else None
            except ValueError:
                continue
            if addr is not None and addr.relay is not None and addr.peer_id == r.peer != self.node.peer_id:
                self._nursery.start_soon(host.punch.reach, addr)

    def region_records(self, epoch: int) -> list[PeerProgress]:
        """The records read last of the peers in this peer's region at ``epoch`` (all of them with one
        region): what its view of that step counts, and what a group of it is held to."""
        regions = self.regions
        if not regions.split:
            return self._records
        mine = regions.of_peer(self.node.peer_id, epoch)
        return [r for r in self._records if regions.of_peer(r.peer, epoch) == mine]

    @property
    def target(self) -> int:
        """The samples a step of this peer's region takes: the run's target batch, its region's share of
        it where the swarm is split (each region steps on its own, with about its share of the peers)."""
        target = self.config.training.target_batch_size
        return max(1, math.ceil(target * self.regions.share)) if self.regions.split else target

    def _view(
        self,
        epoch: int,
        *,
        spectator: bool = False,
        cohort: frozenset[PeerID] = frozenset(),
        expired: Iterable[PeerProgress] = (),
    ) -> SwarmView:
        """``swarm_view`` of ``epoch`` over the records read last (``spectator``: a step past this
        peer's, see :meth:`view_of`).

        A split swarm's (``progress.regions``) counts the step's peers, samples and quorum among the
        records of this peer's region at ``epoch`` (``region_records``), against the region's share of
        the target. Which step to be on (``newest``, ``overtaken``) is what its trusted peers say
        wherever they are (those of other regions a step less: see below): counted in the region alone,
        a joiner whose join peers were in another region saw nobody it trusted ahead, stayed on the
        step the swarm had left, and formed a second group of it with the other late joiners of its
        region (16 simulated peers). The donors of a state are the trusted peers wherever they are
        (asked in the region alone, a peer a step behind found none with a newer state). And there is
        no digest to diverge from: the peers of a region on a step come from different regions of the
        step before, so hold different states, and their round averages those states
        (``RoundRunner.states``); downloading another state would only trade one for another. The
        region's own verdict on whether this peer is behind is kept in ``region_behind``."""
        trusted = self.trusted()
        me, mine, now = self.node.peer_id, self.record(), self.clock()
        met = None if trusted is None else frozenset(self.node.host.connected_peers())

        def view_over(records: list[PeerProgress], target: int) -> SwarmView:
            return swarm_view(
                me,
                mine,
                records,
                now=now,
                target=target,
                horizon=self._horizon,
                trusted=trusted,
                min_work=self.config.run.id_work,
                cohort=cohort,
                met=met,
                epoch=epoch if spectator else None,
                expired=expired,
            )

        if not self.regions.split:
            return view_over(self._records, self.target)
        swarm = view_over(self._records, self.config.training.target_batch_size)
        region = self.region_records(epoch)
        # The region's target: its share of the swarm's, by rate (each region steps about when the
        # swarm as a whole would: a region of fewer peers than its buckets' share, 5 of 16 simulated
        # peers, took its steps at a third of the others' pace, and the regions a step pairs waited on
        # it), within half to twice its buckets' share (rates are claims: k ids move it no further).
        # The region's rate counts its peers on the step and those arriving from the one before (a
        # late half of a region is waited for, not left out by a target of the early half's); the
        # swarm's is what every record read says on any step, smoothed over reads (``note_read``).
        # Each record's rate is capped against the trusted ones' as ever.
        # (The target first, then the region's one view: a view of the buckets' share thrown away for
        # one of the rate's was a third of the views' cost, on every record that arrived.)
        swarm_rate = self._swarm_rate or 0.0
        others = [r for r in region if r.peer != me]
        region_rate = mine.rate + rate_claimed(
            others,
            run=self.fingerprint,
            min_work=self.config.run.id_work,
            cap=self._rate_cap(),
            epochs=(epoch - 1, epoch),
        )
        target = self.target
        if swarm_rate > 0 and region_rate > 0:
            share = region_rate / swarm_rate
            share = min(max(share, self.regions.share / 2), min(1.0, 2 * self.regions.share))
            target = max(1, math.ceil(self.config.training.target_batch_size * share))
        view = view_over(region, target)
        # A trusted peer of another region one step past this one's took its region's step, not this
        # one's: it says the swarm did the step before (counted as on it, this peer's region saw its
        # peers behind whenever the other region committed first, and followed it by replays instead
        # of averaging). A newcomer (it has averaged with nobody: its trusted peers are its join peers,
        # anywhere) counts them so only while its region may still take the step with it
        # (``_region_waits``); else it takes their step as it is: its region took the step without it,
        # or nobody there can lead (it only follows where it trusts nobody: ``RoundRunner._form_group``).
        # Always counted as a step less, late joiners whose regions had left their step stayed on it
        # until the swarm was two past it, chasing it, and at a swarm's start, where only its first peer
        # has anyone to lead with, the other regions formed no group (16 simulated peers).
        # A trusted peer of this region of the step that came past it by a round took the region's step:
        # a group of it formed here would be a second state of it that this peer could have known of
        # (64 simulated peers over 8 regions: a group of three committed a region's step 4 s after
        # two peers they trusted had; neither majority of its leader's trusted peers held the other's).
        # The view says the step is behind: the look ends, and this peer keeps the swarm's pace alone
        # or catches up (``CollaborativeOptimizer._keeps_pace``). Only trusted records say so.
        if view.newest == epoch and self._region_taken(region, epoch, trusted) is not None:
            view = dataclasses.replace(view, newest=epoch + 1, overtaken=True)
        ahead = 1 if self.anchored or self._region_waits(region, epoch) else 0
        newest = max(view.newest, swarm.newest - ahead)
        if not spectator:
            self.region_behind = view.behind  # (its region's trusted peers took its step without it)
            self.swarm_newest = max(view.newest, swarm.newest)
        return dataclasses.replace(
            view,
            newest=newest,
            overtaken=view.overtaken or newest > view.epoch,
            donors=swarm.donors,  # (the trusted peers at the swarm's step: any region's state is one)
            swarm_rate=swarm.swarm_rate * len(self.keys) / max(1, self._read_buckets),
            majority=b"",
        )

    def _region_taken(
        self, region: list[PeerProgress], epoch: int, trusted: frozenset[PeerID] | None
    ) -> PeerID | None:
        """A peer of this peer's region at ``epoch`` (``region``) that it trusts (``trusted``, the
        view's: None, every peer) and that says it came to the step after by a round (``averaged``):
        the region's step was taken (None: none says so)."""
        me = self.node.peer_id
        for r in region:
            if (
                r.peer != me
                and (trusted is None or r.peer in trusted)
                and r.record.epoch == epoch + 1
                and r.record.averaged
                and r.record.run == self.fingerprint
            ):
                return r.peer
        return None

    def taken_elsewhere(self, epoch: int, group: Iterable[PeerID]) -> PeerID | None:
        """Where the swarm is split: a peer this one trusts, of its region at ``epoch`` and no member of
        ``group`` (a committed round's, about to be applied), that says it came to the step after by a
        round: another group of the region took the step first (None: no record read says so).

        A member that applies its round anyway leaves the region's step with a second state that it
        could have known of: a fork (``simulations.scale``'s ``forks``). At a swarm's first step, where
        every peer is a newcomer trusting only its join peers and several groups of a region form at
        once, a group of ten landed 4 s after a group holding one of its member's join peers (128
        simulated peers, 2e59f8f): the look-time check (``_view``, "taken") had passed, as the two
        rounds ran at once. So the member checks again as it lands: its copy is not applied (it costs
        that member alone, as any member's own discard: it catches up to the trusted peer's state),
        and the others of its group are untouched. Only trusted records count, as at look time: free
        ids' records change nothing; a trusted peer that lies can make this peer drop a round, as it
        could make it skip one. Two rounds that land within a read of each other are not caught
        here (neither record is read yet): the landing member then asks (``taken.TakenSteps``)."""
        if not self.regions.split:
            return None  # (one region: a step's groups are held apart by their quorums)
        members = set(group)
        region = [r for r in self.region_records(epoch) if r.peer not in members]
        return self._region_taken(region, epoch, self.trusted())

    def landing_witnesses(
        self, epoch: int, group: Iterable[PeerID]
    ) -> list[tuple[PeerID, PeerAddress | None]]:
        """Whom a member of a split swarm asks whether its region's step ``epoch`` was taken by another
        group as its round (``group``'s) lands (``taken.TakenSteps.elsewhere``): every peer it trusts,
        of its region at ``epoch`` (which its id gives) and outside ``group``, whatever its record read
        last says or whether one was read; each with the averager address its record gives (None: no
        record names one; it is asked over a connection held with it, if any). Those whose records put
        them on the step or past it first, then those without a record, then those behind, newest
        records first. None where the swarm is not split (a step's groups are held apart by their
        quorums), nor free ids: their answers could make it drop any round (in a private swarm, whose
        members the authority vouches for, every peer of the region whose record was read).

        Not only those whose records put them on the step or the one before, as it was: a peer that
        took the step in another group moves on, and its new record, under its next step's keys, is
        not the one read here (or none of it is, for a newcomer whose reads are few). At 128 simulated
        peers with 48 slots a node, a member of a group of 2 landed 5 s after a group of 14 holding the
        one peer of its region it trusted, asked nobody, and applied its round: a fork. Each member of
        two groups must ask the other for the pair to hear of each other's round."""
        if not self.regions.split:
            return []
        regions, me, members = self.regions, self.node.peer_id, set(group)
        records = {r.peer: r.record for r in self._records if r.record.run == self.fingerprint}
        trusted = self.trusted()  # (None, a private swarm: every peer whose record was read)
        mine = regions.of_peer(me, epoch)
        ours = {
            p
            for p in (records if trusted is None else trusted)
            if p != me and p not in members and regions.of_peer(p, epoch) == mine
        }
        addrs = dict(self._record_addrs())

        def order(peer: PeerID) -> tuple[int, float, bytes]:
            rec = records.get(peer)
            if rec is None:
                return 1, 0.0, peer.digest
            return (0 if rec.epoch >= epoch - 1 else 2), -rec.time, peer.digest

        return [(peer, addrs.get(peer)) for peer in sorted(ours, key=order)]

    def region_unled(self, epoch: int) -> bool:
        """A newcomer's hint of whether nobody of its region at ``epoch`` may lead the region's group of
        it but newcomers: no record of the region on the step or arriving says it is anchored, and none
        past it says it came there by a round (``averaged``: the region took the step).

        A hint, and one that only lets a newcomer lead last (``RoundRunner._form_group``): free ids that
        say "anchored" or "taken" keep it following, as every newcomer did before; ids that say nothing
        leave it a leader of rank ``NEWCOMER_RANK``, behind any peer that may lead, whose group is still
        held to the majority of the region's peers on the step."""
        claims = self._region_claims(self.region_records(epoch), epoch)
        return not claims.led and not claims.taken

    def paced(self, epoch: int) -> bool:
        """Whether half or more of this peer's trusted peers on ``epoch`` or past it, in any region, say
        their view of it reached the target (``ready``) or are past it: the swarm's pace on the step, as
        the peers it trusts keep it. Records of free ids do not move it."""
        trusted, me = self.trusted(), self.node.peer_id
        on = done = 0
        for r in self._records:
            rec = r.record
            if r.peer == me or rec.leaving or rec.run != self.fingerprint or rec.epoch < epoch:
                continue
            if trusted is not None and r.peer not in trusted:
                continue
            on += 1
            done += rec.epoch > epoch or rec.ready
        return done > 0 and 2 * done >= on

    def leads_by_heard(self, view: SwarmView) -> bool:
        """Whether this peer leads its region's group by what every record read says (``heard``) instead
        of its own view capped by trust: its trusted peers, wherever they are, are done with the step's
        samples (``paced``), and it is anchored, or a newcomer that trusts nobody of its region on its
        step (``view``'s) where nobody of its region may lead but newcomers (``region_unled``).

        An anchored peer's view counts the records of the peers it does not trust for at most as much as
        those it does, and the regions are drawn anew each step: a peer that averaged with few of its
        new region's peers saw a fraction of the region's samples. Where every peer of a region was so,
        every one of them only followed, and the region formed no group until their capped views crept
        to the target (128 simulated peers with 48 slots a node: a region of 39, 31 of them anchored,
        every announcement a follower's for 8 s, the region's round landed 11.6 s after the step's
        first).

        A newcomer's own view counts the untrusted records for at most as much as itself, so in a region
        of newcomers it never reached the target, and every look there only followed: at 128 simulated
        peers over 8 regions, the first step's largest regions (16 to 23 newcomers) formed no group.
        What every record says is what free ids can inflate; the pace is not: its trusted peers' records
        say when a step's samples are done (``ready``: their own views, each capped by their trust,
        reached the target, or they were paced in turn; a chain of paced peers begins at a peer whose
        own view did), and a region's share of the target follows its share of the swarm's rate
        (``_view``). So records of any number of free ids that claim the target reached make it lead no
        sooner than its trusted peers say theirs was, and those that claim nothing only leave the target
        to the honest peers' samples."""
        return (
            self.regions.split
            and view.epoch == self.tally.epoch
            and (self.anchored or (view.vouched_here <= 1 and self.region_unled(view.epoch)))
            and self.paced(view.epoch)
        )

    def _region_claims(self, region: list[PeerProgress], epoch: int) -> RegionClaims:
        """What the others of this peer's region (``region``, on ``epoch`` or past it, not leaving, of
        this run) claim of its group of ``epoch``: hints for a newcomer (``_region_waits``,
        ``region_unled``), never counted as votes."""
        me = self.node.peer_id
        claims = RegionClaims()
        for r in region:
            rec = r.record
            if r.peer == me or rec.leaving or rec.run != self.fingerprint or rec.epoch < epoch - 1:
                continue
            if rec.epoch > epoch:
                claims.past += 1
                claims.taken = claims.taken or (rec.epoch == epoch + 1 and rec.averaged)
                continue
            claims.here += rec.epoch == epoch
            claims.led = claims.led or rec.anchored
        return claims

    def _region_waits(self, region: list[PeerProgress], epoch: int) -> bool:
        """A newcomer's hint of whether its region's group of ``epoch`` may still form with it: most of
        the others of its region (``region``, on ``epoch`` or past it) are not past it yet, and one of
        them on it or arriving says it is anchored (it may lead), or none past it says it came there by
        a round (the region's newcomers lead then: ``region_unled``, ``RoundRunner._form_group``).

        A hint, not a verdict: a newcomer trusts nobody there, so these records only choose between the
        two steps its trusted peers name (the one it is on, or theirs past it: see ``_view``). Free ids
        in its region that say "anchored, here" keep it on its step until its join peers are two past
        it; ids that say "past" make it download what its join peers hold a step early. Following its
        join peers of other regions as soon as theirs took the step (whether its own had or not), most
        newcomers of 256 simulated peers downloaded every step and averaged in none (21% to 48% of the
        live peers in a committed round); staying on the step whatever its region did, those of the
        regions nobody could lead yet waited two steps instead of one (128 peers: 10%)."""
        claims = self._region_claims(region, epoch)
        # (where nobody says anchored or taken, the region's newcomers lead: ``region_unled``)
        return (claims.led or not claims.taken) and claims.past <= claims.here

    def update_view(self) -> SwarmView:
        """The swarm's view from the records read last (and this peer's own record as it is now): its
        region's, where the swarm is split (see ``_view``)."""
        trusted = self.trusted()
        self.view = self._view(self.tally.epoch, cohort=self.cohort(), expired=self._members_read.values())
        if trusted is not None:
            self._note_refused_claims(trusted)
        self.alone.observe(self.view, self.records, self.tally.epoch)
        return self.view

    def cohort(self) -> frozenset[PeerID]:
        """The others of the round that took this peer to its step, less those banned here since (and
        less those in another region of the step, where the swarm is split)."""
        epoch, members = self.tally.cohort
        if epoch != self.tally.epoch:
            return frozenset()
        members = members.difference(self.node.averager.auditor.banned)
        if self.regions.split:
            me = self.node.peer_id
            members = frozenset(p for p in members if self.regions.together(p, me, epoch))
        return members

    def view_of(self, epoch: int) -> SwarmView:
        """The swarm's view of ``epoch``, a step past this peer's (its replay in flight lands it there:
        it joins that step's round, see ``RoundRunner.start_matchmaking``), as the peers on ``epoch``
        see it: this peer's record says its own step, so its samples and rate count toward ``epoch`` in
        nobody's view, its own included (``progress.swarm_view``'s ``epoch``). Counted here, they made
        a sync home peer on a slow link see the target seconds before the others did and lead groups of
        its own for steps the swarm's records did not yet put within reach. ``view`` is left as it
        is."""
        return self._view(epoch, spectator=True)

    def _note_refused_claims(self, trusted: frozenset[PeerID]) -> None:
        """Say once per peer when an untrusted record claims a step far past the trusted peers' (an
        honest newcomer is at most a step or two ahead: this is a forged step, or a swarm this peer has
        lost touch with)."""
        assert self.view is not None
        for r in self.records:
            far = r.record.epoch > self.view.newest + FAR_CLAIM
            if far and r.peer not in trusted | self._refused and r.record.run == self.fingerprint:
                if len(self._refused) >= MAX_REFUSED:
                    return
                self._refused.add(r.peer)
                log.warning(
                    "refused %s's claim of step %d: not a peer this one trusts (the trusted are on step %d)",
                    r.peer.short(),
                    r.record.epoch,
                    self.view.newest,
                )

    def said_on(self, epoch: int) -> list[PeerProgress]:
        """The records of ``epoch`` of this run this peer has read lately from peers it trusted then,
        superseded ones too (the last ``MAX_SAID``): a donor offers the step it holds when asked, and in
        a swarm that steps faster than records travel, the records read by then name later steps (a
        restarted peer chased a swarm of 3 steps a second: every offer named a step no record did)."""
        return [PeerProgress(peer, rec) for (peer, e), rec in self._said.items() if e == epoch]

    def absent_trusted(self, epoch: int) -> frozenset[PeerID]:
        """The trusted peers missing from the records read last whose latest record read put them on
        ``epoch`` or the step before (not leaving), and which are connected to this peer or wrote that
        record within the records' lifetime: a record still in flight, or refused as expired on the
        way. A group of ``epoch`` led here still needs a majority that counts them
        (``RoundRunner._form_group``). Counted as absent from the swarm, its one trusted peer's record
        missing for a moment (refused as expired by the DHT), a DiLoCo joiner just landed on the step
        whose round that peer was running saw a quorum of itself, led a group of itself alone and
        committed the step: a lineage of its own, left by a second download (``test_catchup``'s
        DiLoCo joiner, about 1 run in 8; 0 in 40 with this)."""
        trusted = self.trusted()
        if trusted is None:
            return frozenset()
        me, present = self.node.peer_id, {r.peer for r in self.records}
        latest: dict[PeerID, ProgressRecord] = {}
        for (peer, _), rec in self._said.items():
            absent = peer in trusted and peer != me and peer not in present
            if absent and (peer not in latest or rec.epoch > latest[peer].epoch):
                latest[peer] = rec
        now, ttl = self.clock(), self.config.progress.ttl
        connected = set(self.node.host.connected_peers())
        fresh = {p: r for p, r in latest.items() if (now - r.time <= ttl or p in connected) and not r.leaving}
        return frozenset(
            p
            for p, r in fresh.items()
            if epoch - 1 <= r.epoch <= epoch and self.regions.together(p, me, epoch)
        )

    def trusted(self) -> frozenset[PeerID] | None:
        """The peers whose progress records may move this one to another state (see ``progress``): the
        join peers and the peers it has averaged with. None (every record) in a private swarm, whose
        members the authority vouches for.

        A peer with no anchor at all (started without a join address, it has never averaged: the
        swarm's first peer, or one restarted without ``--join`` and without the partners its checkpoints
        remember) trusts the peers connected to it now: each passed a handshake with it (and paid the
        run's id work), while a record needs no more than a key. Fresh keys that only write records
        cannot outvote the peers that joined through it before its first round."""
        node = self.node
        if node.config.authority is not None:
            return None
        anchors = node.join_peers | node.averager.partners
        return frozenset(anchors or node.host.connected_peers())

    async def leave(self, timeout: float = 5.0) -> None:
        """Tell the swarm this peer stops (its record says so), so nobody waits for it in a group."""
        self.leaving = True
        with trio.move_on_after(timeout):
            await self.publish()

    async def wait_for_peers(self, count: int, timeout: float) -> int:
        """Wait until ``count`` peers (this one included) publish progress in the run, or ``timeout``;
        returns how many did. Lets a swarm that starts together begin together."""
        with trio.move_on_after(timeout):
            while self.peers_seen() < count:
                await self._records_read.wait()
        return self.peers_seen()

    def peers_seen(self) -> int:
        """The peers that publish progress in the run, this one included: those whose records were read,
        scaled to every bucket where a read asks for some of them (a split swarm's, ``reading``)."""
        others = sum(r.peer != self.node.peer_id for r in self.records)
        return 1 + round(others * len(self.keys) / max(1, self._read_buckets))

    # ---- the weight a peer may count for, from its records ----------------------------------------

    def claim(self, samples: int) -> float:
        """The weight this peer claims for ``samples`` in a round: the true count, but no more than a
        reducer accepts for what this peer's own signed records make plausible (every reducer refuses a
        slice over ``WEIGHT_SLACK`` times that: the peer would be left out), nor than it accepts from a
        peer whose record of this step it has not read yet (the whole target: a fast peer's first step,
        hundreds of samples gathered while the group formed, was refused whole). The coordinator then
        caps it at what it finds plausible itself. Samples beyond the claim still went into the values
        sent."""
        cap = self.weight_cap(self.node.peer_id)
        target = float(self.config.training.target_batch_size)
        return min(float(samples), WEIGHT_SLACK * (target if cap is None else min(cap, target)))

    def weight_cap(self, peer: PeerID) -> float | None:
        """The most samples ``peer`` may count for in a round this peer coordinates: what its signed
        records make plausible; the whole target for a peer without records. A stranger (not trusted,
        see :meth:`trusted`: its records are claims of a key) counts for no more than the most that this
        peer's or a trusted peer's records make plausible: a fresh key advertising a billion samples a
        second since long ago, or publishing no record at all, is one peer's worth. A trusted peer counts
        for no more than ``SPREAD`` times the (upper) median of what the records of this peer, the
        other trusted peers on the step and itself make plausible (see ``progress``): a partner that
        turned to lying carries a bounded share of a round's weight once two others vouch here.
        (Plausible, not the samples said so far: a peer that just began the step would cap the others
        at a few samples, and every reducer then refuses their slices.) A private swarm's members: as
        they say."""
        return self.weight_caps([peer])[peer]

    def weight_caps(self, peers: Iterable[PeerID]) -> dict[PeerID, float | None]:
        """:meth:`weight_cap` of each of ``peers`` (a round's members), the records read once for all
        of them (:func:`capped_weights`). Asked a peer at a time, a round's caps cost members x trusted
        peers x records on the event loop (the trusted peers on the step and their plausible samples
        found again for every member)."""
        peers = list(peers)
        plausible = self._plausibility()
        trusted = self.trusted()
        if trusted is None:
            return {p: plausible(p) for p in peers}
        me, epoch = self.node.peer_id, self.tally.epoch
        recorded = {r.peer for r in self.records if r.peer in trusted}
        on_step = {r.peer for r in self.records if r.peer in recorded and r.record.epoch == epoch} - {me}
        return dict(capped_weights(peers, me, trusted, recorded, on_step, plausible))

    def _plausibility(self) -> Callable[[PeerID], float]:
        """What each peer's records make plausible for this epoch, now (see ``progress.plausible_samples``);
        the whole target without a record of this epoch. A peer that handed its samples of this epoch
        to the round (its records count toward the next one now: ``landing``) is judged by what it said
        before; with nothing said before, by the whole target as well. Each peer's figure is worked out
        once."""
        target = float(self.config.training.target_batch_size)
        now, epoch = self.clock(), self.tally.epoch
        known: dict[PeerID, float] = {}
        fastest: list[float] = []  # (found once, at the first record without a rate)

        def fastest_rate() -> float:
            if not fastest:
                trusted = self.trusted()
                said = (
                    r.record.rate
                    for r in self.records
                    if r.record.epoch == epoch and (trusted is None or r.peer in trusted)
                )
                fastest.append(max(max(said, default=0.0), self.tally.rate.rate))
            return fastest[0]

        def plausible(peer: PeerID) -> float:
            if peer in known:
                return known[peer]
            found = self._by_peer.get(peer)
            record = None if found is None else found.record
            if record is not None and record.landing and record.epoch == epoch:
                record = self.counting.get(peer)
            if record is None or record.epoch != epoch:
                value = target
            elif record.rate > 0:
                value = plausible_samples(record, now, self._horizon, slack=target / 8)
            elif fastest_rate() <= 0:  # no rate measured yet (its first moments): as fast as the fastest
                value = target
            else:
                record = dataclasses.replace(record, rate=fastest_rate())
                value = plausible_samples(record, now, self._horizon, slack=target / 8)
            known[peer] = value
            return value

        return plausible

    def vouched_digest(self, epoch: int) -> bytes:
        """The digest of ``epoch``'s state that the peers this one trusts report (what a download must
        match); our own digest vouches for nothing."""
        ours = [r for r in self.records if r.record.run == self.fingerprint]  # (leaving ones still serve)
        trusted = self.trusted()  # (said_on kept only this run's records)
        return vouched_digest(ours, epoch, trusted) or vouched_digest(self.said_on(epoch), epoch, trusted)

    def vouched_roots(self, epoch: int) -> frozenset[bytes]:
        """Every digest of ``epoch``'s state that a peer this one trusts reports: a swarm split into
        regions holds one state a region of a step (``_view``), and any of them is a state the trusted
        peers are on (a download takes one: ``Fetcher.fetch``'s ``roots``)."""
        ours = [r for r in self.records if r.record.run == self.fingerprint]
        trusted = self.trusted()  # (said_on kept only this run's records)
        return vouched_roots(ours, epoch, trusted) | vouched_roots(self.said_on(epoch), epoch, trusted)


def capped_weights(
    peers: Iterable[PeerID],
    me: PeerID,
    trusted: frozenset[PeerID],
    recorded: set[PeerID],
    on_step: set[PeerID],
    plausible: Callable[[PeerID], float],
) -> dict[PeerID, float]:
    """The weight cap of each of ``peers`` (see :meth:`ProgressBoard.weight_cap`), given this peer
    ``me``, the peers it ``trusted``, the trusted ones with a record (``recorded``) and those of them on
    this peer's step but itself (``on_step``), and what each one's records make plausible. A trusted
    peer: at most ``SPREAD`` times the upper median of the figures of ``me``, itself and ``on_step``; a
    stranger: at most the largest of ``me``'s and ``recorded``'s; this peer itself: its own figure. The
    median's list is sorted once, each peer's own figure put in by bisection."""
    mine = plausible(me)
    base = sorted([mine, *(plausible(p) for p in on_step)])
    vouched = max([mine, *(plausible(p) for p in recorded)])
    caps: dict[PeerID, float] = {}
    for peer in peers:
        cap = plausible(peer)
        if peer == me:
            caps[peer] = cap
        elif peer in trusted:
            # The median counts the peer itself (upper median): with one other trusted peer it decides
            # (a fast honest peer beside a slow coordinator, 22x its speed, is not capped), with two or
            # more the median is one of theirs (a liar among honest peers is). It is the upper median
            # of ``base`` with ``cap`` put in, or of ``base`` alone where that holds it already.
            if peer in on_step:
                median = base[len(base) // 2]
            else:
                at, mid = bisect.bisect_right(base, cap), (len(base) + 1) // 2
                median = base[mid] if mid < at else cap if mid == at else base[mid - 1]
            caps[peer] = min(cap, SPREAD * median)
        else:
            caps[peer] = min(cap, vouched)
    return caps
