"""Forming a group: the matchmaking side of a node's averager.

A peer that wants to average announces itself under the run's group key in the DHT (signed, under its
owned subkey, with a deadline) and reads the others' announcements. The pure rules (``matchmaking``)
pick a leader by lottery: the peer leads (gathers joiners until the group is full or its deadline, then
signs a manifest of members and partition sizes shared out by their bandwidths) or asks the leader for
a place (``JOIN``, naming its quorum: the peers it must average with) and checks the manifest it gets
against the run's rules before anything is sent; a group that holds a banned peer, or whose signed
quorum for this peer does not hold it to its own (``matchmaking.holds_me``), is declined.
Announcements carry strictly increasing expiries, so a closed one still in flight never wins over the
next round's.

Leaders that cannot stall (issue 48). A follower waits for a leader until the leader's deadline +
``JOIN_GRACE``, and follows only leaders whose deadline lies at most ``DEADLINE_SLACK`` past its own
(``matchmaking``): one leader holds it for at most its own matchmaking window + slack + grace. (A peer
that cannot lead has no window of its own to keep: once its deadline passed, it follows whom a look
begun now would, until its look ends: see :meth:`GroupForming._choose`.) A leader
*failed* this peer when it held the call to the end of that wait, or signed a manifest that breaks the
run's rules: the node's :class:`~p2ptrain.averaging.leaders.LeaderBook` then keeps it, and the leaders
of the subnet this peer reached it at, out of every later matchmaking for a long while. It is
*suspected* (``leaders``: three suspicions make a failure) when it kept the call open until its
deadline and then delivered no manifest (whatever it said then: "full", "too small", a redirect), or
coordinated a round that failed on it (:meth:`GroupForming.round_failed`): honest leaders do that
too. A group too small is not even a suspicion when this peer saw fewer peers announcing compatibly
than its own minimum group size (none could have formed). An honest leader
answers at its deadline at the latest, or ``matchmaking.LINGER`` past it while the peers it counts
still join (its reads of the DHT stop there; a joiner's grace is twice that), so ``LATE`` seconds of
clock skew are allowed for; a leader reached through a relay is blamed by its id alone (the address
this peer reached is the relay's), as is one whose address does not connect within ``DIAL_LIMIT``
seconds (its address may name anyone's subnet). A leader that keeps answering "ask again" is passed
over after ``RETRY_FOR`` seconds, or at once when it says it follows a leader this peer does not.

Manifests relayed. A leader answers every joiner of its group with the signed manifest, which lists
every member (about 160 bytes each): a leader of ``n`` sent ``n`` copies, ``O(n^2)`` bytes on one
uplink (a group of 248 at 256 simulated peers: 10 MB from the leader in one burst, 46x the median node's
control bytes of the step, and the last member's copy waited for all the others on that link). Groups
of more than ``RELAY_FROM`` members now have it sent by the leader to about ``sqrt(n)`` of them, the
*relays* (:func:`relay_plan`: members with an address, the ones the leader counts first, a pure
function of the signed manifest); every other member's answer names its relay and the manifest's
digest, and it fetches the manifest from that relay (``avg.recall`` with the digest, which a member
answers only to the manifest's members, waiting up to ``RELAY_HOLD`` for its own copy to arrive). The
leader's signature and the digest are checked on arrival, so a relay can only withhold it: after
``RELAY_WAIT`` seconds, or at once if the relay refuses, is unreachable or sends another manifest, the
member asks the leader (``avg.recall``), as a member whose answer was lost does. Every member thus gets
the leader's manifest or none, as before; the leader sends ``sqrt(n)`` copies and each relay about as
many.

:class:`GroupForming` is owned by the node's averager, which hands it what it needs at construction
(the host, the DHT, the averager's settings, its measured bandwidth, the auditor's bans, and how to
decline a group) and runs its one task (closing announcements) in :meth:`GroupForming.run`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import trio

from ..dht.records import Entry, owned_subkey
from ..dht.service import DHT
from ..dht.spread import SpreadKey
from ..errors import GroupFormationFailed, GroupTooSmall, P2PError, SchemaMismatch, passing
from ..identity import PEER_ID_BYTES, PeerID
from ..net.address import PeerAddress
from ..net.admission import subnet_of
from ..net.host import Host
from ..net.rpc import CallContext, Reply
from ..waits import either
from . import sparse
from .auditor import Auditor
from .bandwidth import BandwidthEstimate, partition_bandwidths
from .compression import Compression
from .leaders import LeaderBook
from .matchmaking import (
    Announcement,
    Gathering,
    Joiner,
    Quorum,
    cannot_join,
    choose_leader,
    group_tag,
    holds_me,
    opening,
    why_not,
)
from .partition import partition_sizes
from .protocol import (
    JOIN,
    RECALL,
    ROUND_ID_BYTES,
    JoinReq,
    JoinResp,
    Manifest,
    MemberMsg,
    RecallReq,
    SignedManifest,
    TensorSpec,
    manifest_digest,
    mask_bytes,
    reducers,
)
from .rules import RoundRules, check_manifest, listed_subnet
from .settings import AveragerConfig, RoundPolicy

log = logging.getLogger("p2ptrain.averaging.averager")  # (the averager's lines, as before)

JOIN_GRACE = 5.0  # how long past a leader's deadline a joiner waits for its answer
POLL = 0.5  # seconds between reads of the announcements while gathering or looking
EXPIRY_STEP = 0.01  # seconds between the expiries of successive announcements under one key
BAD_MANIFEST = "a manifest that breaks the run's rules"
RETRY_JOIN = 0.05  # seconds before asking again a leader that was between states
RETRY_FOR = 2.0  # seconds a leader may keep answering "ask again" in one matchmaking; then it is passed over
RETRY_BUSY = 0.2  # seconds more before dialling again a leader that answered "busy" (``errors.passing``)
DIAL_LIMIT = 3.0  # seconds a leader's address may take to connect (one announcing a dead address costs that)
LATE = 1.0  # seconds before a leader's deadline (our clock) from which an answer without a manifest is late
MAX_FOLLOWED = 16  # manifests of groups this peer followed, remembered for ``round_failed``
MAX_FORMED = 8  # manifests of groups this peer led, kept for members that ask again (``avg.recall``)
RECALL_WAIT = DIAL_LIMIT  # seconds a follower whose join call ended without an answer asks again
RELAY_FROM = 24  # groups of more members have their manifest relayed by some of them (module docstring)
RELAY_WAIT = 2.0  # seconds a member waits for its relay's copy of the manifest before asking the leader
RELAY_HOLD = RELAY_WAIT  # seconds a relay asked for a manifest waits for its own copy to arrive


@dataclass
class _Looking:
    """This peer's matchmaking state while an ``average`` call looks for a group."""

    me: Announcement
    group_key: str
    gathering: Gathering | None = None  # set while leading
    following: Announcement | None = None
    formed: trio.Event | None = None  # the leader decided: a manifest, a refusal, or a redirect
    full: trio.Event | None = None  # wakes the leader: the last place was taken (and it may form now)
    bumped: trio.Event | None = None  # wakes waiting joiners: one of them lost its place to another origin
    manifest: SignedManifest | None = None
    refusal: str = ""
    rules: RoundRules | None = None  # what a leader's manifest must follow (see ``rules``)
    quorum: Quorum | None = None  # the known peers a group led here must hold (see ``matchmaking``)
    announced: dict[PeerID, float] = field(default_factory=dict)  # bandwidths peers announced, as seen
    min_size: int = 2  # the smallest group this peer takes (a smaller one is expected with fewer peers)
    compatible: set[PeerID] = field(default_factory=set)  # peers seen announcing with our schema
    latest: dict[PeerID, Announcement] = field(default_factory=dict)  # each peer's announcement read last
    # Led and formed: the address of each member's relay, for the members that have one (``relay_plan``)
    relays: dict[PeerID, str] = field(default_factory=dict)


def _counted(looking: _Looking) -> frozenset[PeerID]:
    """The peers the quorum of a group led here counts (none without a quorum)."""
    return looking.quorum.peers if looking.quorum is not None else frozenset()


def announced_subnet(addr: str) -> str:
    """The subnet of the host in an announced address ("" for a circuit, nonsense or nothing): where
    this peer would reach that leader, so a subnet's blame applies before dialing."""
    try:
        a = PeerAddress.parse(addr) if addr else None
    except ValueError:
        return ""
    return "" if a is None or a.relay is not None else subnet_of(a.host)


def relay_plan(manifest: Manifest) -> dict[int, int]:
    """The members that fetch the signed ``manifest`` from a fellow member (a *relay*) rather than from
    the leader: member index -> its relay's index ({} for a group of at most ``RELAY_FROM``). About
    ``sqrt(n)`` relays, chosen among the members with an address (a client-only member serves nothing),
    those the leader counts first (its own quorum's peers: the ones it trusts), then in the manifest's
    order; the others are dealt out among them in turn. A pure function of what the leader signed."""
    n = len(manifest.members)
    if n <= RELAY_FROM:
        return {}
    counted = manifest.masks[0] if manifest.masks else 0
    able = [j for j in range(1, n) if manifest.members[j].addr]
    relays = sorted(able, key=lambda j: (not counted >> j & 1, j))[: math.isqrt(n - 1) + 1]
    if not relays:
        return {}
    chosen = set(relays)
    dependents = [i for i in range(1, n) if i not in chosen]
    return {i: relays[x % len(relays)] for x, i in enumerate(dependents)}


def _holds_all(formed: SignedManifest | None, announced: Iterable[PeerID]) -> bool:
    """Whether a group formed and holds every peer seen announcing under its key."""
    return formed is not None and set(announced) <= set(formed.manifest.peers())


def _mismatch(count: int, group_key: str) -> str:
    return (
        f"{count} peer(s) ready to average under {group_key!r} hold tensors of other shapes or dtypes,"
        " or use another compression; no group with ours formed"
    )


class GroupForming:
    """Announcing, leading, following and admitting joiners: one ``form`` call at a time."""

    def __init__(
        self,
        host: Host,
        dht: DHT | None,
        *,
        config: Callable[[], AveragerConfig],
        policy: Callable[[], RoundPolicy] = RoundPolicy,
        measured: BandwidthEstimate,
        auditor: Auditor,
        decline: Callable[[SignedManifest], None],
        clock: Callable[[], float],
    ) -> None:
        """``config``: the averager's current settings (a training run hands it its own before any
        round); ``policy``: the run's (its matchmaking keys' spread); ``measured``: what this member's
        rounds measured of its links; ``decline``: leave a formed group at once (the averager answers
        its members' calls); ``clock``: wall-clock time."""
        self.host, self._dht = host, dht
        self._config, self._policy, self.measured, self.auditor = config, policy, measured, auditor
        self.decline, self.clock = decline, clock
        self._looking: _Looking | None = None
        self.leaders = LeaderBook()  # leaders that failed this peer: not followed for a while
        self._followed: dict[bytes, tuple[PeerID, str]] = {}  # manifests followed -> leader, its subnet
        # Signed manifests this peer holds (led, or checked as a member), by digest: what it relays
        self._held: dict[bytes, SignedManifest] = {}
        self._held_changed = trio.Event()
        # Groups this peer led, by key: the manifest and until when a member may recall it
        self._formed: dict[str, tuple[SignedManifest, float]] = {}
        self._expiries: dict[bytes, float] = {}  # the latest expiry announced under each key
        # The key under which this peer's last look led a group that came out too small: its next look
        # there only follows (see ``form``)
        self._led_short: str | None = None
        self._nursery: trio.Nursery | None = None
        self.signed_out = 0  # members the groups this peer led signed out (``Manifest.out``), all told

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the tasks that close announcements after a ``form`` call returned."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @property
    def busy(self) -> bool:
        """A ``form`` call is looking for a group."""
        return self._looking is not None

    @property
    def dht(self) -> DHT:
        if self._dht is None:
            raise RuntimeError("matchmaking needs a DHT; this averager only runs given manifests")
        return self._dht

    @property
    def bandwidth(self) -> float:
        """The bytes per second this member announces: the configured bandwidth, else what its recent
        rounds measured, else 0 (not known yet: a leader gives it a typical share)."""
        return self._config().bandwidth or self.measured.value() or 0.0

    def keys(self, group_key: str) -> SpreadKey:
        """The DHT keys announcements for ``group_key`` go under (the run's): the group key's own, or,
        where the run spreads its keys (``RoundPolicy.key_bits``), one per bucket of peers that every
        group key of the run shares, each peer's under its bucket's, each announcement naming its group
        key (``Announcement.group``). At 256 simulated peers the node closest to a step's one key sent
        7.4 MB a step, 20.4x the median node: every looker read every announcement from it, O(N^2)
        bytes at one key's replicas. The spread keys are the run's, not the step's: keys new each step
        had every looker look up every bucket's replicas each step (at 64 peers over 4 buckets,
        ``dht.find_node`` 177 KB a peer a step against 44 KB with one key), and a key read again keeps its
        replicas (``dht.replicas``). A peer looks for one group at a time, so its one subkey a key
        holds its one announcement."""
        bits = self._policy().key_bits
        if bits <= 0:
            return SpreadKey.of(f"averaging/{self.host.run_id}/{group_key}", 0)
        return SpreadKey.of(f"averaging/{self.host.run_id}/looks", bits)

    def read_keys(self, group_key: str) -> list[bytes]:
        """The keys a look for ``group_key`` reads: every bucket's (see :meth:`keys`), or those of the
        buckets the run names for it (``RoundPolicy.look_buckets``: a split swarm's region's)."""
        spread = self.keys(group_key)
        pick = self._policy().look_buckets
        buckets = pick(group_key) if pick is not None and spread.bits > 0 else None
        if buckets is None:
            return list(spread.keys)
        return [spread.keys[b] for b in buckets]

    def tag(self, group_key: str) -> bytes:
        """What this peer's announcements for ``group_key`` name it by: nothing under the group key's
        own key, its tag under the run's spread keys (see :meth:`keys`)."""
        return group_tag(group_key) if self._policy().key_bits > 0 else b""

    def _my_addr(self) -> str:
        return self.address(reducer=True)

    def address(self, *, reducer: bool = False) -> str:
        """Where others dial this peer, "" for nowhere: its advertised address once a peer dialed it
        back there; behind a NAT, its address through a relay it holds a reservation with. That one
        makes it a ``reducer`` only once a hole punch with it succeeded (``net.punch``): its share's
        traffic then travels direct, where through the relay it would cost the relay twice the share."""
        if not self.dht.client_only:
            return str(self.dht.advertised_address())
        if self.host.punch.works:  # peers it punched to reach it by its id, even once its relays left
            known = self.host.relay.known_circuit()
            return "" if known is None else str(known)
        circuits = self.host.relay.circuit_addresses()
        return "" if not circuits or reducer else str(circuits[0])

    async def form(
        self,
        group_key: str,
        schema: tuple[TensorSpec, ...],
        digest: bytes,
        mode: Compression,
        timeout: float,
        sizes: tuple[int, int],
        quorum: Quorum | None = None,
        lead: bool = True,
        opens: float | None = None,
        leads_now: Callable[[], bool] | None = None,
    ) -> SignedManifest:
        """Find or lead a group under ``group_key``: its signed manifest, checked against the run's
        rules (GroupTooSmall, SchemaMismatch or GroupFormationFailed say why none formed).

        ``leads_now``: for a peer whose announcement says it only follows (``quorum.leads`` False),
        whether it may lead now; once it says so while this peer follows nobody, the look ends
        (GroupFormationFailed) so that the caller looks again, announced as a leader. A training run
        whose view of the step, capped by trust, has not reached the target while what every record
        says has, follows until its own view reaches it (see ``training``'s rounds).

        ``lead=False``: follow a leader or none, as a client-only peer does (announced without an
        address: nobody follows it or waits for it, and it reduces no share). ``opens``: when the
        matchmaking window begins, if later than now: the deadline is the window after it. A training
        run opens it when its view expects the step's target, so that the peers of one step announce
        about one deadline however early each began to look (see ``training``'s rounds: a look begins
        up to a batch early, and a batch is 0.5 to 2 s in the scale simulator); capped as
        :func:`~p2ptrain.averaging.matchmaking.opening` says."""
        cfg = self._config()
        now = self.clock()
        opens = now if opens is None else opening(now, opens - now, cfg.matchmaking_time)
        # A leader whose group came out too small follows on its next look under the same key, and may
        # lead again after it. Its ticket is the key's, so it would be drawn again for every retry of the
        # step, fail again for the same reason (its own quorum, peers elsewhere), and gather suspicions
        # at each of its followers: three made an exclusion, which differs from follower to follower,
        # so the step's peers split between leaders, each group came out short, and the exclusions
        # multiplied (at 32 simulated peers: step 1 never formed in 170 s, 230 exclusions). Stepping
        # aside is the one change every peer sees alike (its announcement says it), so the next look
        # has one leader for all: the next ticket.
        stepped_aside, self._led_short = self._led_short == group_key, None
        me = Announcement(
            self.host.identity.peer_id,
            self._my_addr() if lead else "",
            opens + cfg.matchmaking_time,
            self.bandwidth,
            digest,
            # (a peer that only follows: ``matchmaking``)
            leads=(quorum is None or quorum.leads) and not stepped_aside,
            rank=0 if quorum is None else quorum.rank,
            group=self.tag(group_key),
        )
        rules = RoundRules(group_key, schema, mode.value, cfg.aggregation, cfg.audit, timeout)
        looking = self._looking = _Looking(me, group_key, rules=rules, quorum=quorum, min_size=sizes[1])
        looking.compatible.add(me.peer)
        spread = self.keys(group_key)
        key = spread.key_of(me.peer)  # (where this peer announces; it reads every bucket's, or its region's)
        reading = self.read_keys(group_key)
        declined: set[Announcement] = set()
        retried: dict[PeerID, float] = {}  # leaders that said "ask again" -> when they first did
        refusals: list[str] = []
        mismatched: set[PeerID] = set()  # peers under this key with other tensors or compression
        formed: SignedManifest | None = None
        try:
            if self._nursery is None:
                await self.announce(key, me, self._expiry(key, me.deadline + JOIN_GRACE))
            else:
                # The announcement is stored in the background while this peer reads the others': a
                # store reaches every replica of a key new each step (a lookup, then the farthest
                # replica's round trip), 1.2 s at the median and 1.8 s at p90 at 32 simulated peers, out
                # of a 3-second window. Awaited first, it left a peer that started looking within the
                # first leader's window too little of it to find and join that leader: each step's
                # group formed at its deadline without the peers that started last, and they caught up
                # instead of averaging. The lottery does not need it awaited: a peer follows only
                # smaller tickets than its own, announced or not (``matchmaking.why_not``), so once its
                # announcement lands nobody prefers it to the leader it follows; a peer that leads is
                # followed once its announcement lands, before its deadline. (A home peer joining
                # ahead over a link full with its replay found the leader after the group formed, the
                # same delay: client-only peers were the first not to wait.) The reads ask the key's
                # replicas directly where :meth:`prepare` found them ahead (else each read looks the
                # key up until the store has found them: 2.7x the read bytes at 32 simulated peers).
                self._nursery.start_soon(self.announce, key, me, self._expiry(key, me.deadline + JOIN_GRACE))
            give_up = me.deadline + JOIN_GRACE
            while self.clock() < give_up:
                seen = await self.announcements(spread, looking.me.group, reading)
                if me.can_lead:  # (``expect`` runs on trio's clock, the deadlines on ``self.clock``)
                    until = trio.current_time() + give_up - self.clock()
                    self._expect_followers(seen, me, _counted(looking), sizes[0], until)
                looking.announced.update((a.peer, a.bandwidth) for a in seen)
                looking.latest.update((a.peer, a) for a in seen)
                looking.compatible.update(a.peer for a in seen if a.schema == me.schema)
                mismatched.update(a.peer for a in seen if a.schema != me.schema)
                leader = self._choose(looking, seen, declined)
                if leader is None and me.can_lead and self.clock() >= me.deadline:
                    # Our window is over (a leader that refused us held us to its deadline): a group led
                    # now closes at once with nobody, and the leaders that announced since lie past our
                    # deadline. At 32 peers half the reads of a look came after its deadline, and each
                    # such peer "led" a group of one ("only 1 of at least 17 peers joined in time"):
                    # the step's peers split into dozens of groups. The caller looks again, anew.
                    break
                if leader is None and me.can_lead:
                    signed = await self._lead(looking, spread, seen, declined, schema, mode, timeout, sizes)
                    if signed is not None:
                        formed = signed
                        return signed
                    if looking.gathering is not None:  # formed, but too small
                        self._led_short = group_key
                        if mismatched:
                            raise SchemaMismatch(_mismatch(len(mismatched), group_key))
                        raise GroupTooSmall(looking.refusal)
                    continue  # a smaller leader appeared: follow it
                if leader is None:
                    if leads_now is not None and leads_now():
                        raise GroupFormationFailed("it may lead now: it looks again, announced as a leader")
                    await trio.sleep(POLL)  # client-only: wait for someone to lead
                    continue
                looking.following = leader
                log.debug("asking %s for a place in %s", leader.peer.short(), group_key)
                signed, why, retry = await self._follow(leader, looking, declined)
                looking.following = None
                if signed is not None:
                    formed = signed
                    return signed
                first = retried.setdefault(leader.peer, self.clock()) if retry else 0.0
                if retry and self.clock() - first < RETRY_FOR:
                    # the leader is between states: ask again (or its own leader) shortly
                    log.debug("%s did not admit us to %s yet: %s", leader.peer.short(), group_key, why)
                    await trio.sleep(RETRY_JOIN)
                    continue
                declined.add(leader)
                refusals.append(f"{leader.peer.short()}: {why}")
                log.info("%s did not admit us to %s: %s", leader.peer.short(), group_key, why)
            if mismatched or any("schema mismatch" in r for r in refusals):
                raise SchemaMismatch(_mismatch(len(mismatched), group_key) + " " + "; ".join(refusals[-4:]))
            raise GroupFormationFailed(
                "no group formed in time" + (f" (refusals: {'; '.join(refusals[-4:])})" if refusals else "")
            )
        except trio.Cancelled:
            log.debug("stopped looking for a group in %s (cancelled)", group_key)
            raise
        finally:
            self._looking = None
            if looking.formed is not None and not looking.formed.is_set():
                # Cancelled while leading: answer the joiners now rather than at their deadlines.
                looking.refusal = looking.refusal or "the leader stopped looking for a group"
                looking.formed.set()
            # So that nobody follows an announcement that is over; not needed where the group holds
            # every peer seen under the key (the key is the step's: the others moved on with us), and
            # a store on every replica, each round, for nothing (a latecomer asks and is refused).
            if self._nursery is not None and not _holds_all(formed, looking.announced):
                expiry = self._expiry(key, me.deadline + JOIN_GRACE)
                if expiry > self.clock():  # (past it, the open one has expired too: nothing to close)
                    self._nursery.start_soon(self.announce, key, me.closed(), expiry)

    def _expiry(self, key: bytes, wanted: float) -> float:
        """The expiry for our next announcement under ``key``: later than every earlier one.

        The DHT keeps the entry with the latest expiry, and the stores run concurrently: a closed
        announcement still in flight must not win over the next round's open one, however soon after
        it comes (with a fast round, the deadlines alone can be too close to tell apart).
        """
        now = self.clock()
        for k in [k for k, e in self._expiries.items() if e < now]:
            del self._expiries[k]
        expiry = max(wanted, self._expiries.get(key, 0.0) + EXPIRY_STEP)
        self._expiries[key] = expiry
        return expiry

    def prepare(self, group_key: str) -> None:
        """A look for a group under ``group_key`` comes soon: find its key's replicas now, in the
        background (``DHT.locate``), so that the look's store and reads ask them directly. A lookup
        under a key new each step took about a second at 32 simulated peers: awaited by the look, it
        came out of the first leader's 3-second window, and in each read it cost 2.7x the read bytes."""
        if self._nursery is not None:
            for key in self.read_keys(group_key):
                self._nursery.start_soon(self._locate, key)

    async def _locate(self, key: bytes) -> None:
        try:
            await self.dht.locate(key)
        except P2PError as e:
            log.debug("could not find the replicas of a matchmaking key ahead: %s", e)

    async def announce(self, key: bytes, me: Announcement, expiry: float) -> None:
        """Store ``me`` under ``key`` until ``expiry`` (signed, under our owned subkey)."""
        ttl = expiry - self.clock()
        try:
            await self.dht.store(key, me.to_bytes(), ttl=ttl, subkey=owned_subkey(me.peer), sign=True)
        except P2PError as e:
            log.warning("could not announce readiness to average: %s", e)

    async def announcements(
        self, spread: SpreadKey, group: bytes = b"", keys: Sequence[bytes] | None = None
    ) -> list[Announcement]:
        """The announcements under ``spread``'s keys (``keys`` of them where given) whose owner signed
        them, each under its owner's bucket's key (``SpreadKey.owned``: a peer counts once), that name
        ``group`` (see :meth:`tag`), and that are not banned here; the keys are read at once. Every
        looker of the step writes them,
        so even a first read asks their replicas directly (``written``): a lookup of the value ends at
        the closest replicas, which each sent every announcement to every looker (at 256 simulated
        peers, 17.2 MB in a step from the node closest to the step's key, 23.7x the median node's
        control bytes)."""
        read: dict[bytes, dict[bytes, Entry]] = {}

        async def get(key: bytes) -> None:
            try:
                read[key] = await self.dht.get(key, quorum=3, written=True)
            except P2PError as e:
                log.info("reading announcements failed: %s", e)

        async with trio.open_nursery() as nursery:
            for key in spread.keys if keys is None else keys:
                nursery.start_soon(get, key)
        out = []
        for peer, entry in spread.owned(read).values():
            try:
                announcement = Announcement.from_bytes(peer, entry.value)
            except (P2PError, ValueError):
                continue
            if announcement.group != group:  # (a look for another group key of the run)
                continue
            if announcement.peer not in self.auditor.banned:  # never follow or wait for a banned peer
                out.append(announcement)
        return out

    def _choose(
        self, looking: _Looking, seen: list[Announcement], declined: set[Announcement]
    ) -> Announcement | None:
        """The leader to follow among ``seen`` (``matchmaking``), leaving out those this peer's book
        excludes by their id or by the subnet of the address they announce.

        A peer follows only leaders whose deadline lies at most ``DEADLINE_SLACK`` past its own, so that
        no leader keeps it past its own window. A peer that cannot lead has no window of its own to
        keep: once its deadline passed, it follows whom a look begun now would (its deadline taken a
        window from now), until its look ends as before (its first deadline + ``JOIN_GRACE``). Its
        window opened when what every record says expected the step's target (``training``'s rounds),
        earlier than the views capped by trust that its region's leaders go by: at a 128-peer swarm's
        first step the followers of a region read its leader's announcement within their look, the
        leader's deadline 5 to 7 s past theirs (theirs passed already), refused it for that alone, and
        looked again after the group had formed without them."""
        now = self.clock()
        me = looking.me
        if not me.can_lead and now >= me.deadline:
            me = dataclasses.replace(me, deadline=now + self._config().matchmaking_time)
        return choose_leader(
            me,
            seen,
            now,
            looking.group_key,
            declined=declined,
            excluded=self._excluded(seen, now),
        )

    def _excluded(self, seen: list[Announcement], now: float) -> set[PeerID]:
        """The announcers among ``seen`` this peer's book excludes, by their id or announced subnet."""
        return {a.peer for a in seen if self.leaders.excluded(a.peer, announced_subnet(a.addr), now)}

    def _failed(self, leader: PeerID, subnet: str, why: str, *, surely: bool = True) -> None:
        """Book a leader's failure: ``surely`` (no honest leader does that), else a suspicion
        (``leaders.SUSPICIONS`` of them make a failure)."""
        if surely:
            until: float | None = self.leaders.failed(leader, subnet, self.clock(), why)
        else:
            until = self.leaders.suspect(leader, subnet, self.clock(), why)
        if until is None:
            log.info("leader %s failed us (%s): suspected", leader.short(), why)
            return
        log.warning(
            "leader %s%s failed us (%s): not followed for %.0f s",
            leader.short(),
            f" (subnet {subnet})" if subnet else "",
            why,
            until - self.clock(),
        )

    def round_failed(self, signed: SignedManifest, blame: dict[PeerID, str]) -> None:
        """A round of a group this peer followed aborted; ``blame``: whom it failed on (see
        ``round_machine``). Its coordinator is the leader: one whose decision never came coordinated a
        round it never ran (or died in it), and is not followed again for a while."""
        followed = self._followed.pop(signed.digest, None)
        if followed is None:
            return
        leader, subnet = followed
        if leader in blame:
            why = f"its round {signed.digest.hex()[:8]} failed on it: {blame[leader]}"
            self._failed(leader, subnet, why, surely=False)

    def _away(
        self, looking: _Looking, gathering: Gathering, seen: list[Announcement], declined: set[Announcement]
    ) -> None:
        """Stop waiting for the known peers that never join this group (``matchmaking.cannot_join``);
        not for those this peer may follow (it redirects to the smallest of them instead)."""
        if looking.quorum is not None and seen:
            now, me, key = self.clock(), looking.me, looking.group_key
            excluded = self._excluded(seen, now)
            followable = {
                a.peer for a in seen if not why_not(me, a, now, key, declined=declined, excluded=excluded)
            }
            gathering.away = cannot_join(me, seen, key, looking.quorum.peers, followable=followable)
            if gathering.ready() and looking.full is not None:
                looking.full.set()

    async def _lead(
        self,
        looking: _Looking,
        spread: SpreadKey,
        seen: list[Announcement],
        declined: set[Announcement],
        schema: tuple[TensorSpec, ...],
        mode: Compression,
        timeout: float,
        sizes: tuple[int, int],
    ) -> SignedManifest | None:
        """Gather until full or the deadline; None if a smaller leader appeared first (joiners redirected)."""
        me = looking.me
        observed = self._dht.observed_host if self._dht is not None else None
        gathering = looking.gathering = Gathering(
            Joiner(
                me.peer,
                me.addr,
                me.bandwidth,
                listed_subnet(me.addr) or (subnet_of(observed) if observed else ""),
            ),
            me.schema,
            sizes[0],
            sizes[1],
            by_origin=self._config().aggregation != "mean",
            quorum=looking.quorum,
        )
        looking.formed, looking.full, looking.bumped = trio.Event(), trio.Event(), trio.Event()
        self._away(looking, gathering, seen, declined)
        # (past its deadline only while the peers it counts still join: ``Gathering.closes_at``)
        while not gathering.ready() and self.clock() < gathering.closes_at(me.deadline):
            with trio.move_on_after(min(POLL, max(0.0, gathering.closes_at(me.deadline) - self.clock()))):
                await looking.full.wait()
            if gathering.ready() or self.clock() >= gathering.closes_at(me.deadline):
                break
            seen = []
            # (an honest leader answers by its closing, however slow the DHT: see the module docstring)
            with trio.move_on_after(max(0.0, gathering.closes_at(me.deadline) - self.clock())):
                seen = await self.announcements(spread, looking.me.group, self.read_keys(looking.group_key))
            until = gathering.closes_at(me.deadline) + JOIN_GRACE  # (a joiner's grace past the closing)
            self._expect_followers(
                seen, me, _counted(looking), sizes[0], trio.current_time() + until - self.clock()
            )
            self._away(looking, gathering, seen, declined)
            smaller = self._choose(looking, seen, declined)
            # (Not once the group may form. Full but short of its quorum, or held by one origin, it
            # waits for its deadline and forms with the quorum's peers or not at all: holding a stranger
            # that filled it, a leader waited there alone while a smaller leader's group of the same
            # step, with the quorum's peers, formed without it. Nor late, where it may form: its joiners,
            # held to its deadline, would be sent elsewhere at the end of their wait.)
            late = self.clock() >= me.deadline - LATE and gathering.quorate()
            if smaller is not None and not gathering.ready() and not late:
                looking.gathering, looking.refusal = None, f"redirected to {smaller.peer.short()}"
                looking.following = smaller
                looking.formed.set()
                return None
        members = gathering.form()
        if isinstance(members, str):
            looking.refusal = members
            looking.formed.set()
            return None
        entries = gathering.entries(members)  # every member's quorum, signed (see ``matchmaking``)
        if isinstance(entries, str):
            looking.refusal = entries
            looking.formed.set()
            return None
        needs, counts, out = entries
        self.signed_out += len(out)
        bandwidths = partition_bandwidths([m.bandwidth for m in members])
        total, align = sum(s.numel for s in schema), sparse.BLOCK if mode.sparse else 1
        shares = partition_sizes(total, bandwidths, reducers([m.addr for m in members], out), align)
        manifest = Manifest(
            round_id=os.urandom(ROUND_ID_BYTES),
            group_key=looking.group_key,
            members=tuple(
                MemberMsg(m.peer.digest, m.addr, bw) for m, bw in zip(members, bandwidths, strict=True)
            ),
            sizes=tuple(shares),
            origins=gathering.origins(members),
            needs=needs,
            counts=tuple(mask_bytes(c) for c in counts),
            out=out,
            schema=schema,
            compression=mode.value,
            timeout=timeout,
            aggregation=self._config().aggregation,
            audit=self._config().audit,
        )
        looking.manifest = SignedManifest.sign(self.host.identity, manifest)
        looking.relays = {members[i].peer: manifest.members[r].addr for i, r in relay_plan(manifest).items()}
        self._hold(looking.manifest)
        self._formed.pop(looking.group_key, None)
        while len(self._formed) >= MAX_FORMED:
            del self._formed[next(iter(self._formed))]
        self._formed[looking.group_key] = (looking.manifest, self.clock() + timeout)
        looking.formed.set()
        log.info("formed a group of %d for %s", len(members), looking.group_key)
        return looking.manifest

    def _expect_followers(
        self,
        seen: Iterable[Announcement],
        me: Announcement,
        counted: frozenset[PeerID],
        target: int,
        until: float,
    ) -> None:
        """As a peer that may lead: the others announced under its group key with its schema may dial it
        to join, until ``until`` (trio's clock; ``Host.expect``): over its inbound cap they may take an
        idle connection's slot, as a round's members do. Its slots full of the DHT's connections refused
        them (128 simulated peers with 48 slots a node: 18 of a run's left-out peers formed no group, a
        leader "unreachable" among their refusals, its handshake refused or the connection closed).

        At most the group's room (``target`` - 1), the peers its quorum counts (``counted``) first:
        announcements are free, and a hundred ids announced under the key must not push the members of
        the rounds this node takes part in out of its table of expected peers (``Inbound.expect`` keeps
        the most recent few hundred). What k ids gain: each of at most that many may take an idle,
        unprotected slot of the leaders that read it, until their matchmaking ends, within the
        per-address cap (the address is its own claim: it can only name a host whose connection may
        then take such a slot).
        Client-only peers (no address) are not known by address."""
        others = [a for a in seen if a.peer != me.peer and a.addr and a.schema == me.schema]
        others.sort(key=lambda a: a.peer not in counted)  # (stable: the read's order otherwise)
        others = others[: max(0, target - 1)]
        if others:
            self.host.expect([a.peer for a in others], [a.addr for a in others], until)

    async def _follow(
        self, leader: Announcement, looking: _Looking, declined: set[Announcement]
    ) -> tuple[SignedManifest | None, str, bool]:
        """Ask ``leader`` for a place: the manifest, or why not and whether asking again may help. A
        leader that failed us (see the module docstring) goes into the book on the way out."""
        me = looking.me
        asked = self.clock()
        wait = max(0.0, leader.deadline - asked) + JOIN_GRACE
        subnet = ""  # where we reached it ("" until connected, or through a relay)
        sent = False  # whether the leader may have admitted us (then its answer is asked for again)
        try:
            with trio.fail_after(wait):
                conn = await self.host.connect(leader.addr, timeout=min(wait, DIAL_LIMIT))
                subnet = "" if conn.relayed else subnet_of(conn.remote_host)
                excluded = self.leaders.excluded(leader.peer, subnet, self.clock())
                if excluded:  # (its announced address did not show the subnet we reached it in)
                    return None, excluded, False
                quorum = looking.quorum
                need, named = (0, ()) if quorum is None else (quorum.joins, quorum.named(looking.announced))
                req = JoinReq(
                    looking.group_key, me.schema, me.addr, me.bandwidth, need, tuple(p.digest for p in named)
                )
                sent = True
                reply = await conn.call_with_body(JOIN, req, timeout=wait)
        except trio.TooSlowError:
            why = f"no manifest within {wait:.1f} s, past its deadline"
            body = await self._recall(leader, looking.group_key) if sent else None
            if body is None:
                self._failed(leader.peer, subnet, why)
                return None, why, False
            self._failed(
                leader.peer, subnet, f"its manifest came only when asked again ({why})", surely=False
            )
        except P2PError as e:
            body = await self._recall(leader, looking.group_key) if sent else None
            if body is None and not sent and passing(e):
                # it is there (its slots full before it read our announcement, see
                # ``_expect_followers``; or the connection closed under the dial): asked again shortly,
                # as a leader between states is (for ``RETRY_FOR``), not as often (``RETRY_BUSY``)
                await trio.sleep(RETRY_BUSY)
                return None, f"unreachable for now ({e})", True
            if body is None:
                why = f"unreachable ({e})"
                if self._late(leader, looking, asked, why):
                    self._failed(
                        leader.peer, subnet, f"it held us to its deadline, then: {why}", surely=False
                    )
                elif self.clock() - asked >= min(wait, DIAL_LIMIT):  # an address that swallows dials
                    self._failed(
                        leader.peer, "", f"no answer at its address for {DIAL_LIMIT:g} s", surely=False
                    )
                return None, why, False
        except trio.Cancelled:  # our caller gave up: a group formed with us meanwhile is declined
            if sent and self._nursery is not None:
                self._nursery.start_soon(self._leave_unanswered, leader, looking.group_key)
            raise
        else:
            if not reply.message.accepted:
                why = reply.message.reason or "refused"
                if self._late(leader, looking, asked, why):
                    self._failed(
                        leader.peer, subnet, f"it held us to its deadline, then: {why}", surely=False
                    )
                    return None, why, False
                redirect = reply.message.redirect
                passed = self._passed_over(redirect, declined, looking.latest) if redirect else ""
                if passed == "excluded":
                    return None, f"{why}, one this peer does not follow", False  # asking again cannot help
                if passed == "declined":  # (its next announcement, once read, may be followed: ask again)
                    return None, f"{why}, under an announcement that refused this peer", True
                return None, why, reply.message.retry
            body = bytes(reply.body)
            if not body and reply.message.relay:  # a large group: the manifest comes from a fellow member
                relayed = await self._from_relay(leader, looking.group_key, reply.message)
                if relayed is None:
                    why = "its manifest came neither from the relay it named nor when asked again"
                    self._failed(leader.peer, subnet, why, surely=False)
                    return None, why, False
                body = relayed
        try:
            signed = SignedManifest.verify(body, leader.peer)
            assert looking.rules is not None
            announced = {**looking.announced, me.peer: me.bandwidth}
            check_manifest(signed.manifest, looking.rules, me.peer, me.addr, announced)
        except P2PError as e:
            self._failed(leader.peer, subnet, f"{BAD_MANIFEST}: {e}")  # (logged there)
            return None, f"{BAD_MANIFEST}: {e}", False
        self.leaders.delivered(leader.peer, self.clock())
        self._hold(signed)  # (a member the leader named as a relay serves it to the others)
        banned = [p for p in signed.manifest.peers() if p in self.auditor.banned]
        if banned:  # its leader has not banned it (yet): our slices never go into a round of theirs
            self.decline(signed)
            why = f"the group holds {banned[0].short()}, banned here: {self.auditor.banned[banned[0]]}"
            log.info("declined the group of %s: %s", leader.peer.short(), why)
            return None, why, False
        quorum = looking.quorum
        why = "" if quorum is None else holds_me(signed.manifest, me.peer, quorum)
        if signed.manifest.signs_out(me.peer):
            why = f"its leader signed this peer out of the round: {why or 'its quorum cannot be met'}"
        if why:  # its leader's word on the majority is not ours: refuse now, never discard its round later
            self.decline(signed)
            log.info("declined the group of %s: %s", leader.peer.short(), why)
            return None, why, False
        while len(self._followed) >= MAX_FOLLOWED:
            del self._followed[next(iter(self._followed))]
        self._followed[signed.digest] = (leader.peer, subnet)
        return signed, "", False

    def _hold(self, signed: SignedManifest) -> None:
        """Keep a manifest this peer led or checked as a member, for the members it relays it to."""
        while len(self._held) >= MAX_FOLLOWED:
            del self._held[next(iter(self._held))]
        self._held[signed.digest] = signed
        changed, self._held_changed = self._held_changed, trio.Event()
        changed.set()

    async def _from_relay(self, leader: Announcement, group_key: str, answer: JoinResp) -> bytes | None:
        """The manifest (its envelope) the leader's ``answer`` says to fetch from a fellow member; the
        leader's own copy (``avg.recall``) if that member refuses, cannot be reached within
        ``RELAY_WAIT``, or sends one of another digest; None if neither came."""
        try:
            with trio.fail_after(RELAY_WAIT):
                conn = await self.host.connect(answer.relay, timeout=RELAY_WAIT)
                reply = await conn.call_with_body(
                    RECALL, RecallReq(group_key, answer.digest), timeout=RELAY_WAIT
                )
            body = bytes(reply.body)
            if not reply.message.accepted or manifest_digest(body) != answer.digest:
                raise P2PError(reply.message.reason or "a manifest of another digest")
            return body
        except (P2PError, ValueError, trio.TooSlowError) as e:
            log.info(
                "the relay %s named by %s did not serve its manifest: %s",
                answer.relay,
                leader.peer.short(),
                e,
            )
        return await self._recall(leader, group_key)

    async def _recall(self, leader: Announcement, group_key: str) -> bytes | None:
        """The manifest ``leader`` formed with this peer under ``group_key``, asked for again after the
        answer to our join call was lost (None: it formed none with us, or cannot be reached now).

        A leader lists a joiner once it admitted it, and the joiner learns it only from that answer. Lost
        (a reply that failed on the way, a link slower than our wait, a caller that gave up just as the
        group formed), the others ran a round that listed a member who never heard of it: they waited
        for its slices until the scatter deadline, 0.4 of the round's timeout, and committed without
        it (two nodes in threads on a busy machine: one committed its own tensor alone). Asked again
        (``avg.recall``, which admits nobody), the member runs that round, or declines it."""
        try:
            with trio.fail_after(RECALL_WAIT):
                conn = await self.host.connect(leader.addr, timeout=RECALL_WAIT)
                reply = await conn.call_with_body(RECALL, RecallReq(group_key), timeout=RECALL_WAIT)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("could not ask %s again for a group of %s: %s", leader.peer.short(), group_key, e)
            return None
        if not reply.message.accepted:
            log.debug(
                "%s formed no group of %s with us: %s", leader.peer.short(), group_key, reply.message.reason
            )
            return None
        log.info("the answer of %s was lost: its manifest came when asked again", leader.peer.short())
        return bytes(reply.body)

    async def _leave_unanswered(self, leader: Announcement, group_key: str) -> None:
        """Our caller gave up while ``leader`` had not answered: decline a group it formed with us."""
        body = await self._recall(leader, group_key)
        if body is None:
            return
        try:
            signed = SignedManifest.verify(body, leader.peer)
        except P2PError as e:
            log.debug("%s recalled a manifest that does not verify: %s", leader.peer.short(), e)
            return
        if self.host.identity.peer_id in signed.manifest.peers():
            self.decline(signed)

    async def on_recall(self, ctx: CallContext, req: RecallReq) -> Reply[JoinResp]:
        """A member asks again for the group we formed with it under a key (see :meth:`_recall`), or,
        with a digest, a fellow member asks us as its relay for that manifest, which may be on its way
        here still (:meth:`_from_relay`)."""
        if req.digest:
            held: SignedManifest | None = None
            # (only while a look of ours runs may a manifest still arrive here: a stranger's digest is
            # answered at once otherwise, not held for RELAY_HOLD seconds a call)
            with trio.move_on_after(RELAY_HOLD):
                while (held := self._held.get(req.digest)) is None and self._looking is not None:
                    await self._held_changed.wait()
            if held is None or ctx.peer not in held.manifest.peers():
                return Reply(JoinResp(False, "no manifest of this digest that lists the caller is held here"))
            return Reply(JoinResp(True), held.envelope)
        signed, until = self._formed.get(req.group_key, (None, 0.0))
        if signed is None or until < self.clock() or ctx.peer not in signed.manifest.peers():
            return Reply(JoinResp(False, "no group formed here under this key holds the caller"))
        return Reply(JoinResp(True), signed.envelope)

    def _passed_over(self, addr: str, declined: set[Announcement], latest: dict[PeerID, Announcement]) -> str:
        """Whether the leader at ``addr`` (where a peer we asked said it follows) is one we do not follow:
        "excluded" (our book excludes it), "declined" (its announcement read last refused us), or "".

        A refusal passes over the announcement it came under, not the peer (``matchmaking.why_not``): a
        leader that refused us (it found a smaller place at its deadline, or its group came out short)
        and then looks again, under a new announcement, may be followed. Passed over by its address, at
        128 simulated peers a peer that had been refused by the step's eventual leader declined every
        peer that redirected to it, one after another, and was out of the step's round (the same for a
        sixth of the live peers at some steps). A redirect to it is therefore asked again shortly: by
        then this peer may have read the new announcement, and follows it directly."""
        try:
            peer = PeerAddress.parse(addr).peer_id
        except ValueError:
            peer = None
        if peer is not None and self.leaders.excluded(peer, announced_subnet(addr), self.clock()):
            return "excluded"
        last = latest.get(peer) if peer is not None else None
        if last is not None:
            return "declined" if last in declined else ""
        return "declined" if any(d.addr == addr for d in declined) else ""

    def _late(self, leader: Announcement, looking: _Looking, asked: float, why: str) -> bool:
        """Whether an answer without a manifest came so late that the leader failed us: at its deadline
        or after (an honest one answers ``full``, a redirect, a refusal at once, or before it). A group
        too small is no failure where this peer saw too few peers for one (see the module docstring)."""
        now = self.clock()
        if now < leader.deadline - LATE or now - asked < LATE:
            return False  # it answered before its deadline, or at once (it did not hold us)
        too_few = len(looking.compatible) < looking.min_size
        return not (too_few and why.startswith("only "))

    async def on_join(self, ctx: CallContext, req: JoinReq) -> Reply[JoinResp]:
        """A follower asks for a place in the group we gather (long-poll until it forms)."""
        looking = self._looking
        if looking is None or looking.group_key != req.group_key:
            return Reply(JoinResp(False, "not looking for a group under this key"))
        if looking.following is not None:
            return Reply(
                JoinResp(False, "following another leader", redirect=looking.following.addr, retry=True)
            )
        gathering, formed, full, bumped = looking.gathering, looking.formed, looking.full, looking.bumped
        if gathering is None or formed is None or full is None or bumped is None:
            return Reply(JoinResp(False, "not gathering a group yet", retry=True))
        if ctx.peer in self.auditor.banned:
            return Reply(JoinResp(False, f"banned here: {self.auditor.banned[ctx.peer]}"))
        before = len(gathering.bumped)
        counts = frozenset(PeerID(c) for c in req.counts if len(c) == PEER_ID_BYTES)
        why = gathering.offer(
            Joiner(ctx.peer, req.addr, req.bandwidth, subnet_of(ctx.remote_host), req.need, counts),
            req.schema_digest,
            self.clock(),
        )
        if why:
            return Reply(JoinResp(False, why))
        log.debug("admitted %s to %s (%d so far)", ctx.peer.short(), req.group_key, gathering.size())
        if len(gathering.bumped) != before:  # somebody lost its place: tell it now, not at the deadline
            bumped.set()
            bumped = looking.bumped = trio.Event()
        if gathering.ready():
            full.set()
        try:
            while not formed.is_set():
                if ctx.peer in gathering.bumped:
                    return Reply(JoinResp(False, gathering.bumped[ctx.peer]))
                await either(formed, looking.bumped if looking.bumped is not None else formed)
        except trio.Cancelled:
            log.debug("%s left %s before it formed", ctx.peer.short(), req.group_key)
            raise
        finally:
            gathering.withdraw(ctx.peer)  # no effect once formed
        if looking.manifest is None or ctx.peer not in looking.manifest.manifest.peers():
            why = gathering.bumped.get(ctx.peer) or looking.refusal or "the group did not form"
            return Reply(JoinResp(False, why))
        relay = looking.relays.get(ctx.peer)
        if relay:  # (a large group: see "Manifests relayed")
            return Reply(JoinResp(True, relay=relay, digest=looking.manifest.digest))
        return Reply(JoinResp(True), looking.manifest.envelope)
