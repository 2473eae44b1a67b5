"""Progress records and the swarm's view of a global step (pure: records and ``now`` in, decisions out).

Theory of operation: every training peer publishes a signed progress record in the DHT (one owned
subkey per peer under the run's progress key): the global step (epoch) it works on, the samples it has
processed toward that step, its smoothed samples per second, when it measured them, the digest of the
state it started the epoch from, and where others may download that state. It publishes when something
changed that others cannot extrapolate (:func:`must_publish`), and every few seconds besides; it reads
the others' records about once a second.

From the records of the live peers, :func:`swarm_view` decides, identically on every peer that sees the
same records:

- how many samples the swarm has done toward this epoch (each record extrapolated at its rate, for at
  most ``horizon`` seconds, so a silent or lying clock cannot inflate it without bound), and therefore
  whether the target is reached (time to average) and how soon it will be (time to start matchmaking);
- how many peers work on this epoch (the size of the group to form), counting those whose averaging
  round for the previous epoch is still landing (diloco with overlap), and not those that said they are
  leaving; and the majority of them a group needs (``quorum``, counting those one step behind and
  those past it too), where untrusted records count for at most as many as the trusted ones (ids that
  publish records and never join a group slow a round down to the leader's deadline, but cannot make
  a group impossible);
- whether this peer is behind or has diverged: then it downloads the state, from ``donors`` in order.

Which states a peer adopts is a question of trust, not of numbers: identities are free, so a record's
step and digest are claims, and a thousand records saying the same are a thousand claims of one key
generator. Only the records of *trusted* peers (``trusted``) can move a peer to another state: the peers
the user told it to join through, and the peers it has averaged with (their contributions went into a
round it committed, so they held its state then). A private swarm's members all are. Among the trusted
records and its own:

- the epoch to be on is the upper median of their epochs (never below its own): a peer that missed a
  round follows the trusted majority that moved on, while one trusted peer that lies about a far
  future step is outvoted by the others (with a single trusted peer, that peer decides: it is the one
  the user named, or the only one this peer ever trained with);
- the digest of an epoch is the one most of them report, ties broken by the smaller digest, so every
  peer that trusts the same peers names the same winner; the peer has diverged when it holds another.

Any peer, trusted or not, may serve the chosen state as a donor: every chunk is checked against the
trusted digest on arrival. Untrusted records still count toward the group size (capped in its quorum,
above), and toward the samples of this peer's epoch for at most as much as this peer's and the trusted
records together (fresh keys that claim any number of samples at most halve the batch a step is taken
with). A peer's own samples are never extrapolated: it knows them exactly.

The others of the round that took this peer to its step (its ``cohort``) are on that step as surely as
it is: they committed the same bits. A record of theirs on the step reaches a peer at once only if they
offer it their records (their partners, at most 32); the others read it from the replicas once a
record's life. Counting only records of the step, a peer that held a quarter of its round's new records
saw a quarter of the samples and the rate, and expected the target later than a peer that held them
all (at 128 simulated peers, a leader that held 80 of 128 members' records also gathered for 80). So a
member whose last record is of a step before counts toward this step at that record's rate since this
peer's own samples of it count, for at most ``UNREAD`` horizons, under the same trust caps as any record
of the step, until its own record of the step says what it did; a member whose records this peer holds
none of counts the same way at the lower median rate of this peer and its trusted peers on the step.

Every peer's view of a step is computed from the same published records, its own included as the
others read it. A peer may view a step its record does not say (``epoch``: a peer whose replay in
flight lands it on the swarm's step joins that step's round): there its own samples and rate count for
nothing, as in every other peer's view of that step (its record is of the step before, or two), and it
counts itself where the others count it (one step behind: arriving). So it never looks for a group of a
step sooner than the records of the peers on that step put the target within reach: counting the
samples it computed on the state it replays from, a sync peer on a slow link saw the target seconds
before the others and led groups nobody joined in time.

Trust is earned by useful work, and a partner may lie later. So no trusted record's claims count for
more than ``SPREAD`` times the (lower) median of this peer's and the trusted records on the epoch: its
samples and its rate (:func:`spread_cap`; ``board`` caps its weight in a round the same way; a
private swarm's members, vouched for by its authority, are believed as they say). A
partner that claims a billion samples a second counts as ``SPREAD`` typical peers: with ``n`` honest
peers on the step, it brings at most ``SPREAD / (n + SPREAD)`` of the samples a step is taken with.
The price for honest hardware: a peer more than ``SPREAD`` times faster than the median is counted,
in the others' views, as ``SPREAD`` times the median (its own view counts it whole): the swarm's step
waits a little longer than its samples alone would make it. The trusted peers on the epoch whose
records say their view reached the target (``ready``) make this one's reach it too, once they are at
least half of the trusted peers on the epoch (with a single trusted peer, that one): a peer that trusts
few peers would otherwise see the target reached long after the others, and one partner alone that
says ``ready`` at once does not make a swarm of honest peers step with the few samples it has.

A view capped by trust. Trust is earned in rounds, so a peer a round left out trusts no more than
before it, and one that trusts few counts the swarm's samples at a fraction of the truth: at 128
simulated peers such peers saw the swarm's rate at 80 to 390 samples a second of its 1,160, looked for
the step's group after it had formed, were left out again, and earned no more trust, step after step.
So the view also says what every record read says (``heard``, ``heard_rate``: the untrusted records
not capped in total, each one capped as a trusted peer's claims are). It only times a look in which
this peer *follows* (``RoundRunner.start_matchmaking(follows=True)``): it joins the group a leader
gathers, and leads only once its own view (``samples``) reaches the target. A group forms when its
leader's view says so, and a leader's view counts free ids for at most as much as its trusted peers, so
records of free ids that claim the target reached make the honest peers follow early, and no step is
taken sooner or with fewer samples for them. Without free ids, ``heard`` is what a peer that trusts
every peer counts, whomever this one trusts. One trusted peer on the step that says its view reached
the target (``ready``) puts ``heard`` at the target too, once ``heard`` is within ``READY_SLACK`` (an
eighth) of it: its group is forming, and this peer follows into it (it leads only by its own view, or
by half of its trusted peers on the step saying so). A trusted liar that says ``ready`` and leads
takes a step at most that share of the target early: followers are what a group's samples come from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from ...config import ProgressSection
from ...identity import PeerID
from ...idwork import WORK_BYTES, work_bits
from ...net.address import PeerAddress
from ...wire.schema import Message, bounded
from ..state.chunks import HASH_BYTES as DIGEST_BYTES  # (a state's root digest: see ``state.chunks``)


@dataclass(frozen=True)
class ProgressRecord(Message, positional=True):
    """What a peer tells the swarm about its training (stored signed, one subkey per peer)."""

    epoch: int = bounded(ge=0, le=2**53)  # the global step this peer works toward
    samples: int = bounded(ge=0, le=2**53)  # samples it processed toward it
    rate: float = bounded(ge=0.0, le=1e9)  # smoothed samples per second
    time: float = bounded(ge=0.0, le=1e11)  # when it measured samples and rate (its wall clock)
    digest: bytes = bounded(b"", max_len=DIGEST_BYTES)  # the state it started the epoch from
    # Where to download that state; "" when client-only. Sent without the author's own id (``/p2p/...``,
    # a quarter of a record): its subkey names it (see :func:`sent_addr`, :func:`with_author`).
    addr: str = bounded("", max_len=300)
    run: bytes = bounded(b"", max_len=16)  # fingerprint of the run's settings: others are ignored
    landing: bool = False  # a round for ``epoch`` is in flight (diloco overlap): next on ``epoch + 1``
    leaving: bool = False  # the peer is shutting down: count it no more
    since: float = bounded(0.0, ge=0.0, le=1e11)  # when it began ``epoch`` (its wall clock)
    work: bytes = bounded(b"", max_len=WORK_BYTES)  # its id's work nonce (runs that price ids: ``idwork``)
    ready: bool = False  # its view of ``epoch`` reached the target: it looks for a group (see swarm_view)
    # The step it is catching up to, past ``epoch + 1`` or at it (a replay of the missed steps' results in
    # flight, or a round joined ahead of its step: see swarm_view's ``arriving``); 0: none.
    toward: int = bounded(0, ge=0, le=2**53)
    # It has averaged with peers it verified (or joined through nobody): it may lead a group. A claim, only
    # a newcomer's hint of whether its region's group can form (see ``ProgressBoard._region_waits``).
    anchored: bool = False
    # It came to ``epoch`` by a committed round of the step before (not alone, not by a download; a round
    # it alone contributed to too): where the swarm is split, its region of that step took the step (see
    # ``ProgressBoard._view``, "taken").
    averaged: bool = False


def sent_addr(addr: str, author: PeerID) -> str:
    """``addr`` as a record of ``author`` carries it: without ``/p2p/<author>`` where that ends a direct
    address (a circuit's keeps it: the relay's id comes before it)."""
    try:
        parsed = PeerAddress.parse(addr)
    except ValueError:
        return addr
    if parsed.peer_id != author or parsed.relay is not None:
        return addr
    return str(dataclasses.replace(parsed, peer_id=None))


def with_author(record: ProgressRecord, author: PeerID) -> ProgressRecord:
    """A record read back: a direct address without a peer id is the author's (its subkey proves who
    wrote it), so it gets its id again, for dialing it with the id checked."""
    try:
        parsed = PeerAddress.parse(record.addr) if record.addr else None
    except ValueError:
        return record
    if parsed is None or parsed.peer_id is not None or parsed.relay is not None:
        return record
    return dataclasses.replace(record, addr=str(parsed.with_peer(author)))


@dataclass(frozen=True)
class PeerProgress:
    peer: PeerID
    record: ProgressRecord


@dataclass(frozen=True)
class SwarmView:
    """What the records say about this peer's epoch; ``reason`` explains it in words."""

    epoch: int
    newest: int  # the epoch the trusted peers' records say to be on (>= ``epoch``)
    peers: int  # peers working on ``epoch`` (or about to: their round for the one before is landing)
    # The fewest peers a group of ``epoch`` needs: a majority of those this peer can vouch for, on this
    # epoch or one behind. Above ``peers``: no group may form yet (wait for those behind).
    quorum: int
    others: int  # other live peers of the run, on any epoch (some may be catching up)
    samples: float  # estimated samples the swarm has done toward ``epoch``
    rate: float  # the swarm's samples per second on ``epoch``
    target: int
    majority: bytes  # the state digest most trusted peers on ``epoch`` started from (this one included)
    overtaken: bool  # trusted peers, leaving ones included, took the swarm past ``epoch``: no step alone
    donors: tuple[PeerProgress, ...]  # where to download the trusted state of ``newest``, best first
    reason: str
    # The whole run's samples per second, every live peer on any epoch (one between two steps, or a
    # step behind, computes all the same): what a user means by the swarm's throughput. Untrusted
    # records count for at most as much as this peer's and the trusted ones.
    swarm_rate: float = 0.0
    arriving: int = 0  # peers one step behind: a group of ``epoch`` waits for them (its leader's deadline)
    vouched_here: int = 1  # this peer and the trusted peers on ``epoch`` (their round landing included)
    # ``samples`` and ``rate`` with the untrusted records not capped in total by the trusted ones (each
    # still capped as a trusted peer's claims are): what every record read says. They only time a look
    # in which this peer follows (see the module docstring, "A view capped by trust").
    heard: float = 0.0
    heard_rate: float = 0.0

    @property
    def ready(self) -> bool:
        """The swarm has done the epoch's samples: time to average."""
        return self.samples >= self.target

    @property
    def eta(self) -> float:
        """Seconds until the target, at the current rate (0 when reached, inf with no progress)."""
        if self.ready:
            return 0.0
        return (self.target - self.samples) / self.rate if self.rate > 0 else math.inf

    def near(self, seconds: float) -> bool:
        """The target is reached within ``seconds`` at the current rate."""
        return self.samples + self.rate * seconds >= self.target

    def heard_near(self, seconds: float) -> bool:
        """What every record read says (``heard``) puts the target within ``seconds``."""
        return self.heard + self.heard_rate * seconds >= self.target

    @property
    def heard_eta(self) -> float:
        """Seconds until the target by what every record read says (0 when reached, inf with no progress)."""
        if self.heard >= self.target:
            return 0.0
        return (self.target - self.heard) / self.heard_rate if self.heard_rate > 0 else math.inf

    @property
    def behind(self) -> bool:
        return self.newest > self.epoch

    def diverged(self, digest: bytes) -> bool:
        """This peer's state differs from the one most peers on its epoch started from."""
        return bool(self.majority) and bool(digest) and digest != self.majority


def majority_digest(records: Iterable[ProgressRecord]) -> bytes:
    """The digest most records report (ties: the smallest), b"" when none reports one."""
    counts = Counter(r.digest for r in records if r.digest)
    if not counts:
        return b""
    return min(counts, key=lambda d: (-counts[d], d))


def vouched_digest(records: Iterable[PeerProgress], epoch: int, trusted: Collection[PeerID] | None) -> bytes:
    """The digest most trusted records of ``epoch`` report (see :func:`majority_digest`)."""
    return majority_digest(
        r.record for r in records if r.record.epoch == epoch and (trusted is None or r.peer in trusted)
    )


def vouched_roots(
    records: Iterable[PeerProgress], epoch: int, trusted: Collection[PeerID] | None
) -> frozenset[bytes]:
    """Every digest the trusted records of ``epoch`` report (a swarm split into regions holds one state
    a region of a step: see ``ProgressBoard.vouched_roots``)."""
    return frozenset(
        r.record.digest
        for r in records
        if r.record.epoch == epoch and r.record.digest and (trusted is None or r.peer in trusted)
    )


def upper_median(values: Iterable[int]) -> int:
    """The middle value, the larger of the two middle ones for an even count."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def record_horizon(progress: ProgressSection) -> float:
    """How long a peer extrapolates a record it holds at the record's rate: while the record lives
    (``ttl``: a held record expires then), since its successor may not reach it before. A peer reads
    the replicas once a record's life and hears of new records at once only from the partners that
    offer theirs to it; extrapolated for a heartbeat and two reads (7 s of a 10 s life), the work of
    every other peer stalled in its view from then until its next read. At 128 simulated peers the
    step's records went out as the peers landed, the target came 9 s later, and the views of the peers
    that had read the replicas just after the landing stalled at 7/9 of it: they looked for the group
    when their next read or their partners' ``ready`` came, up to 9 s after the first looks, and
    were left out (``tests/unit/test_progress_read_phase.py``)."""
    return progress.ttl


def estimate(record: ProgressRecord, now: float, horizon: float) -> float:
    """Samples a peer has done by ``now``: its count, plus its rate for at most ``horizon`` seconds."""
    elapsed = min(max(now - record.time, 0.0), horizon)
    return record.samples + record.rate * elapsed


RATE_CHANGE = 0.25  # a rate that moved by more than this share goes out at once


def must_publish(
    last: ProgressRecord | None, record: ProgressRecord, heartbeat: float, tolerance: float
) -> bool:
    """Whether ``record`` must go out now, ``last`` being the record this peer published before.

    Others extrapolate a record at its rate (:func:`estimate`), so a steady peer need not repeat its
    count every second (each publication is a DHT store, and every reader fetches it again): a record
    goes out when anything but its count, rate and time changed (a new step, a round landing, leaving,
    a new digest or address), when its rate moved by more than a quarter, when the count strayed from
    what ``last`` extrapolates to by more than ``tolerance`` samples, and at least every ``heartbeat``
    seconds, so that it never expires while the peer is alive.
    """
    if last is None or record.time - last.time >= heartbeat:
        return True
    if dataclasses.replace(record, samples=0, rate=0.0, time=0.0) != dataclasses.replace(
        last, samples=0, rate=0.0, time=0.0
    ):
        return True
    if abs(record.rate - last.rate) > RATE_CHANGE * last.rate:
        return True
    return abs(record.samples - estimate(last, record.time, heartbeat)) > tolerance


# A round's member's first record of the step it took reaches a peer it does not offer its records to
# by a read of the replicas, at most a record's life (two heartbeats) after it went out: until then it is
# counted at its last rate (see ``swarm_view``'s ``joined``) for at most this many horizons.
UNREAD = 2.0
PLAUSIBLE_RATE = 2.0  # a peer may do this many times its advertised samples per second (rates lag)
SPREAD = 3.0  # a trusted peer's claims count for at most this many times the median peer's (see above)
READY_SLACK = 0.125  # one trusted peer's ``ready`` makes a follower look this share of the target early


def spread_cap(values: Iterable[float], spread: float = SPREAD) -> float:
    """The most any one of ``values`` (this peer's and the trusted peers' claims) counts for:
    ``spread`` times their lower median (the upper half of them cannot raise it), inf when empty."""
    ordered = sorted(values)
    if not ordered or math.isinf(spread):
        return math.inf
    return spread * ordered[(len(ordered) - 1) // 2]


def rate_claimed(
    records: Iterable[PeerProgress],
    *,
    run: bytes,
    min_work: int,
    cap: float,
    epochs: Collection[int] | None = None,
) -> float:
    """The samples per second the live ``records`` of run ``run`` claim together (those of ids with the
    work the run asks for, not leaving; on ``epochs`` only, or any), each counted for at most ``cap``
    (:func:`spread_cap` of this peer's and its trusted peers' rates): what a split swarm's peer weighs
    its region's rate against the swarm's by (``ProgressBoard._view``)."""
    return math.fsum(
        min(r.record.rate, cap)
        for r in records
        if r.record.run == run
        and not r.record.leaving
        and (epochs is None or r.record.epoch in epochs)
        and (not min_work or work_bits(r.peer, r.record.work) >= min_work)
    )


def plausible_samples(record: ProgressRecord, now: float, horizon: float, slack: float) -> float:
    """The most samples a peer's own records make plausible for its current epoch: its advertised rate
    (doubled) over the time it has been on the epoch, plus ``slack``. Times come from the peer's own
    clock, extrapolated for at most ``horizon``, so clock skew does not widen it."""
    elapsed = max(record.time - record.since, 0.0) + min(max(now - record.time, 0.0), horizon)
    return PLAUSIBLE_RATE * record.rate * elapsed + slack


def swarm_view(
    me: PeerID,
    mine: ProgressRecord,
    others: Iterable[PeerProgress],
    *,
    now: float,
    target: int,
    horizon: float,
    trusted: Collection[PeerID] | None,
    min_work: int = 0,
    cohort: Collection[PeerID] = (),
    met: Collection[PeerID] | None = None,
    epoch: int | None = None,
    expired: Iterable[PeerProgress] = (),
) -> SwarmView:
    """Decide from the live records (``others`` excludes this peer; stale ones already dropped).
    ``trusted``: the peers whose records may move this one to another state (None: every peer's, as in
    a private swarm whose members are all vouched for). ``min_work``: the bits of id work the run asks
    for; a record of an id without them counts for nothing. ``cohort``: the peers whose round produced
    this peer's state with it (it saw them commit the same bits): until their records say otherwise,
    they hold its digest. ``met``: the peers connected to this one (None: everyone); records of
    untrusted ids count toward the majority a group needs only if their peers passed a handshake
    with this one (see below). ``expired``: the last records this peer read of peers whose records
    expired here since (their samples count until its next read says more: see ``lapsed``).
    ``epoch``: the step to view, this peer's own by default; another one
    (a step its replay in flight lands it on, see ``RoundRunner.start_matchmaking``) is viewed as a
    peer on it sees it: this peer's record counts as what it says, like anyone's (see the module
    docstring)."""
    at = mine.epoch if epoch is None else epoch
    here = at == mine.epoch  # False: a spectator of ``at`` (its record says another step)

    def of_run(o: PeerProgress) -> bool:  # (this run's, from an id with the work it asks for)
        return o.record.run == mine.run and (not min_work or work_bits(o.peer, o.record.work) >= min_work)

    others = [o for o in others if o.peer != me and of_run(o)]
    # A spectator's own record is one of the swarm's records, read as the others read it (it vouches for
    # itself): on another step than ``at``, it adds no samples and no rate to ``at``'s.
    own = [] if here else [PeerProgress(me, mine)]

    # Peers that said they leave count for nothing but this: the trusted among them may have taken the
    # swarm past this peer's step, and a step taken alone now would start a second lineage under the
    # swarm's step numbers (a peer catching up while the others shut down).
    def vouches(o: PeerProgress) -> bool:
        return trusted is None or o.peer in trusted or o.peer == me

    # They still serve their state until they stop: a peer they left behind catches up from them.
    leaving = [o for o in others if o.record.leaving and vouches(o)]
    others = [o for o in others if not o.record.leaving]
    vouched = [o for o in others if vouches(o)]
    same = [o for o in others if o.record.epoch == at]
    newest = max(
        at,
        upper_median([at, *(o.record.epoch for o in vouched)]),
        upper_median([at, *(o.record.epoch for o in (*vouched, *leaving))]),
    )
    overtaken = newest > at
    # fsum: exact, so the verdict does not depend on the order the DHT returned the records in. The
    # untrusted count for at most as much as this peer and the trusted do: any number of fresh keys
    # claiming 2**53 samples at most halves the batch a step is taken with.
    sure = [o for o in same if vouches(o)]
    unsure = [o for o in same if not vouches(o)]
    # The others of the round that took this peer to ``at`` (``cohort``) work on it since about when this
    # one does, whether or not their first record of it has reached this peer: counted at the rate their
    # last record says, from when this peer's own samples of ``at`` count (``mine.since``), until a record
    # of theirs on the step says what they did (``joined``: see the module docstring).
    members = frozenset(cohort) if here else frozenset()
    # The members whose last record read expired here since (its successor is at the replicas, read by
    # this peer at its next read) count as they did while it lived: a peer that read the records of
    # the step's landing just after it held them only until they expired, a record's life after, and
    # at 128 simulated peers that was when the step's target came: its count fell by a third until its
    # next read (up to half a life later), and its look with it. Not among the step's peers (they are
    # arriving: a group waits for them), and for at most two horizons of extrapolation.
    listed = {o.peer for o in (*others, *leaving)}
    lapsed = [
        o
        for o in expired
        if o.peer in members
        and o.peer not in listed
        and of_run(o)
        and not o.record.leaving
        and o.record.epoch <= at
    ]
    joined = [o for o in (*others, *lapsed) if o.peer in members and o.record.epoch < at]
    sure_lapsed = [o.record for o in lapsed if o.record.epoch == at and vouches(o)]
    unsure_lapsed = [o.record for o in lapsed if o.record.epoch == at and not vouches(o)]
    started = min(max(now - mine.since, 0.0), UNREAD * horizon)
    # What this peer itself brings to ``at``: its exact count and rate on its own step; nothing on a
    # step its record does not say (a spectator), as in every other peer's view of that step.
    mine_samples = [float(mine.samples)] if here else []
    mine_rate = [mine.rate] if here else []
    # A trusted peer's claims count for at most SPREAD times the median's (see the module docstring);
    # not in a private swarm, whose authority vouches for every member.
    spread = SPREAD if trusted is not None else math.inf
    sure_joined = [o.record.rate for o in joined if vouches(o)]
    unsure_joined = [o.record.rate for o in joined if not vouches(o)]
    # Members whose records this peer holds none of, live or kept, work on ``at`` as surely: each counts
    # at the lower median rate of this peer and the trusted peers on it, under the same caps. Left out:
    # at 128 simulated peers, some peers' reads of the progress key, their looks' own reads included,
    # held the records of 89 or 106 of their round's 128 members, step after step (why is not found
    # yet); they counted two thirds of the step's samples and looked for its group as it formed.
    typical = sorted(
        [*mine_rate, *(o.record.rate for o in sure), *sure_joined, *(r.rate for r in sure_lapsed)]
    )
    kept = {o.peer for o in lapsed}
    unheard = [p for p in members if p != me and p not in listed and p not in kept]
    if typical:
        rate_of = typical[(len(typical) - 1) // 2]
        sure_joined += [rate_of for p in unheard if trusted is None or p in trusted]
        unsure_joined += [rate_of for p in unheard if not (trusted is None or p in trusted)]
    sure_rates = [*(o.record.rate for o in sure), *sure_joined, *(r.rate for r in sure_lapsed)]
    unsure_rates = [*(o.record.rate for o in unsure), *unsure_joined, *(r.rate for r in unsure_lapsed)]
    claimed = [
        *(estimate(o.record, now, horizon) for o in sure),
        *(r * started for r in sure_joined),
        *(estimate(r, now, UNREAD * horizon) for r in sure_lapsed),
    ]
    unclaimed = [
        *(estimate(o.record, now, horizon) for o in unsure),
        *(r * started for r in unsure_joined),
        *(estimate(r, now, UNREAD * horizon) for r in unsure_lapsed),
    ]
    most = spread_cap([*mine_samples, *claimed], spread)
    samples = math.fsum([*mine_samples, *(min(c, most) for c in claimed)])
    heard = samples + math.fsum(min(c, most) for c in unclaimed)
    samples += min(math.fsum(unclaimed), samples)
    # Trusted peers on this step whose own view reached the target look for a group now: so does this
    # one, once they are half of the trusted peers here. A peer that trusts few (a joiner: its join
    # peer; one a round left out: no partner) counts the others for at most as much as itself and those
    # few: on 8 peers it saw half the swarm's samples, looked for a group when the others' had formed
    # without it, and was left out again each round. One partner's word is not enough where it has
    # company: a partner that said ``ready`` at once took every step with the few samples it had.
    said_ready = sum(o.record.ready for o in sure)
    ready_said = said_ready > 0 and 2 * said_ready >= len(sure)
    if ready_said:
        samples = max(samples, float(target))
    heard = max(heard, samples)
    # One trusted peer on this step whose view reached the target is enough to look as a follower (its
    # group is forming: ``heard``, which only times a follower's look) once what every record says is
    # within ``READY_SLACK`` of the target: counted by half of them, a peer whose own view lagged
    # looked a second or less before its region's group formed, and was left out (64 simulated peers
    # over 8 regions: 78 of the 151 left-out peers of a run). Not at once: a trusted liar that says
    # ``ready`` and leads would then take every step with the batch each honest peer had when it
    # spoke; so it brings a look forward by at most that share of the target.
    if said_ready and heard >= (1.0 - READY_SLACK) * target:
        heard = max(heard, float(target))
    fastest = spread_cap([*mine_rate, *sure_rates], spread)
    rate = math.fsum([*mine_rate, *(min(r, fastest) for r in sure_rates)])
    heard_rate = rate + math.fsum(min(r, fastest) for r in unsure_rates)
    rate += min(math.fsum(unsure_rates), rate)
    heard_rate = max(heard_rate, rate)
    quickest = spread_cap([mine.rate, *(o.record.rate for o in vouched)], spread)
    swarm_rate = math.fsum([mine.rate, *(min(o.record.rate, quickest) for o in vouched)])
    swarm_rate += min(math.fsum(o.record.rate for o in others if not vouches(o)), swarm_rate)
    # Records lag behind rounds: right after a round committed, its members' records still show the
    # step before, and a trusted peer's record of this step with another digest (one that stepped
    # alone, or lied) would be the "majority" it ties with. The members of the round this peer
    # committed hold its digest until a record of theirs on this step says otherwise.
    said = {o.peer for o in vouched if o.record.epoch == at}
    held = sum(1 for p in set(cohort) if p != me and p not in said and (trusted is None or p in trusted))
    ours = [mine] * (1 + held) if here else []  # (a spectator holds no state of ``at``)
    majority = majority_digest([*ours, *(o.record for o in vouched if o.record.epoch == at)])
    at_newest = [o for o in (*others, *leaving) if o.record.epoch == newest]
    best = vouched_digest(
        [*vouched, *leaving], newest, None
    )  # what the others hold: ours vouches for nothing
    donors = sorted(
        (o for o in at_newest if o.record.addr and best and o.record.digest == best),
        key=lambda o: hashlib.blake2b(me.digest + o.peer.digest, digest_size=8).digest(),
    )
    landing = [o for o in (*others, *own) if o.record.landing and o.record.epoch + 1 == at]
    lagging = [o for o in (*others, *own) if not o.record.landing and o.record.epoch + 1 == at]
    peers = here + len(same) + len(landing)
    # A group must be a majority of the epoch's peers (two groups cannot both commit it), but records of
    # ids that never join a group would raise that majority past the honest peers: untrusted ones count
    # toward it for at most as many as the trusted. The group a leader waits for still counts them all
    # (it gathers until its deadline, then goes with those who came). Peers one step behind count
    # toward the majority too: they are about to arrive (a round that committed without them, a record
    # not yet re-published), and a group of the few already here would commit the step before them, and
    # they another, under the same step number (two lineages).
    # Untrusted records count only where their ids are connected to this peer (each passed a handshake,
    # and paid the run's id work): records a host writes under fresh keys that never dial anyone made
    # the majority all of the trusted peers, and a trusted peer that never joins (an attacker's node the
    # swarm's first peer trusts as connected) then kept every group from forming.
    # Peers already past this step count too: they took it (or say so), and a group of the few left
    # on it would take it a second time. Records travel for seconds: on 8 peers of a loaded machine,
    # 3 that had read the new step of some of the 5 whose round committed formed a group of 3 for the
    # step those had left, a lineage of its own that ran on for minutes.
    past = [o for o in others if o.record.epoch > at]
    counted = (*same, *landing, *lagging, *past)
    sure_n = here + sum(vouches(o) for o in counted)
    unsure_n = sum(1 for o in counted if not vouches(o) and (met is None or o.peer in met))
    quorum = (sure_n + min(unsure_n, sure_n - 1)) // 2 + 1
    # Peers one step behind are catching up (a download, a record not re-published yet): a group waits
    # for them until its leader's deadline. One that lands the step as the group forms without it is
    # behind again at once, and chases the swarm for good when steps are about as long as a record takes
    # to travel and a download to land. (A joiner is trusted by nobody yet; ids that only publish such
    # records cost what those on the step do: the leader's deadline.)
    # Peers further behind that say they are catching up to ``at`` or the step before by a replay (or a
    # round joined ahead: ``toward``) arrive too, a step later: the step they land on is behind again,
    # and they join ``at``'s group ahead (``RoundRunner.start_matchmaking``). Not waited for, a sync
    # home peer whose replay of a step took about as long as a step (a 10 Mbit/s link) was two steps
    # behind whenever the group formed, on the swarm's step at once, and every look it made for a group
    # came after it formed: it replayed every step and averaged in none (the namespace lab: 0 of 44).
    # (It costs a group what a record one step behind does, its leader's deadline, and no more: a
    # record that says it is never counted as on the step, nor toward the quorum.)
    coming = [
        o
        for o in (*others, *own)
        if o.record.epoch + 1 < at and at - 1 <= o.record.toward <= at and not o.record.leaving
    ]
    # Members of the round that took this peer to ``at`` whose records it holds none of (not read yet,
    # or expired before their records of the step were read) are on it as surely as it is: waited for.
    # Left out, a leader at 128 simulated peers whose view held 80 of the 128 members of the round
    # before gathered a group of 80, full at once, and the 48 others downloaded the step. So are those
    # whose last record read is older still (records travel slower than steps are taken: 3 peers taking
    # a step every 0.3 s, the slowest one's record two steps old, and the two others formed a group of 2).
    read = {o.peer for o in (*same, *landing, *lagging, *coming, *past, *leaving)}
    unread = sum(1 for p in members if p != me and p not in read)
    arriving = len(lagging) + len(coming) + unread
    # A spectator two steps behind is in no other peer's count; it looks for the group all the same.
    arriving += not here and not any(o.peer == me for o in (*landing, *lagging, *coming))
    vouched_here = here + sum(vouches(o) for o in (*same, *landing))
    if newest > at:
        ahead = sum(o.record.epoch == newest for o in vouched)
        reason = f"behind: {ahead} trusted peer(s) are on step {newest}, this one on {at}"
    else:
        reason = f"{peers} peer(s) on step {at}: {samples:.0f} of {target} samples at {rate:.1f}/s"
        reason += " (a trusted peer's view reached it)" if ready_said else ""
        reason += "" if here else f" (this one's record is of step {mine.epoch})"
    return SwarmView(
        epoch=at,
        newest=newest,
        peers=peers,
        quorum=quorum,
        arriving=arriving,
        vouched_here=vouched_here,
        others=len(others),
        samples=samples,
        rate=rate,
        target=target,
        majority=majority,
        overtaken=overtaken,
        donors=tuple(donors),
        reason=reason,
        swarm_rate=swarm_rate,
        heard=heard,
        heard_rate=heard_rate,
    )
