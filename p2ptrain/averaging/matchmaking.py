"""Matchmaking decisions: whom to follow, whom to admit, when to form the group (pure, no I/O).

Theory of operation: a peer ready to average announces itself in the DHT under the run and a group key,
with a deadline (when it would form a group of its own) and its bandwidth (0 until it measured it, see
``bandwidth``). Who leads is decided by a lottery no peer sets: each peer's *ticket* under a group key is
``blake2b(group key || peer id)`` (:func:`ticket`), and announcements are ordered by ticket. Each peer
follows the smallest announcement below its own that may lead (:func:`why_not`: it accepts connections,
is still open, has our schema, has not refused us, is not excluded by this peer's book of failed
leaders, and declares no deadline further ahead than the run's matchmaking window allows); with none, it
leads: it admits joiners until the group reaches its target size or its deadline passes, then sends each
a manifest signed with its key. A follower waits for a leader until the earlier of the leader's deadline
and its own, plus a grace (``grouping``); a leader that does not deliver by then is remembered
(``leaders``) and not followed again for a long while.

Why the lottery: with the order by declared deadline, one fresh key that announced the earliest deadline
led every group of every step, and could hold them all (issue 48). Nothing in an announcement moves its
ticket: declared deadlines and bandwidths only decide whether it is followed at all. An identity's
ticket is fixed by its key and the group key (per step), so a key generator can grind keys with small
tickets, but each of them is then excluded, with its subnet, by every peer it failed (``leaders``):
grinding buys stalls per subnet, not per key.

Why no deadlock is possible: a peer only ever waits for an answer from a peer strictly smaller in the
ticket order (tickets differ for different ids: a tie is a blake2b collision), and a leader waits for
nobody: it answers every joiner by its own deadline. A chain of waits is therefore strictly decreasing,
cannot close into a cycle, and ends at a leader whose deadline bounds it. Each peer's exclusions (its
own book, the leaders that refused it) only remove candidates; they never reorder the rest, so every
edge still goes down the one global order, whatever each peer excludes. A peer asked to admit a joiner
while it follows someone else answers at once with a redirect to its own leader (smaller still), so
requests flow down the order to the peer that gathers the group. hivemind's documented deadlock
(leaders waiting on each other) needs a wait from a smaller peer to a larger one, which this rule
forbids. A client-only peer follows any leader: nobody ever waits for it.

Origins (robust runs). Identities are free, subnets are not: in a run that aggregates with a robust rule,
a leader counts its joiners by *origin*, the subnet (/24, /64) it sees each one's connection come from,
so that one host's fresh keys cannot fill a group before the peers of other subnets ask. While one origin
holds more than half of the group, the group does not form early (it waits for the deadline), and a
joiner from a smaller origin that finds the group full takes the place of the newest joiner of the
largest one (told why). The manifest then says which members share an origin, and reducers count each
origin once (see ``robust``). A run with the plain mean admits first come, first served: one peer
already moves a mean anywhere, so counting origins would only slow honest groups on one subnet.

Quorum of known peers. A step's group must hold a majority of the step's peers, so that two groups cannot
both commit it (two lineages). Counted by id, fresh keys that join two groups would let both reach it;
so a training run names the peers it knows (those that publish progress) and how many of them the group
must hold (:class:`Quorum`): the group forms only with that many of them, and a known joiner that finds
the group full takes the place of the newest joiner that is not. The run's target size counts the known
peers on the step; a known peer that announced under the key, may lead, and holds a smaller ticket than
the leader never joins it (it leads, or follows a smaller one): the leader does not wait for it
(:func:`cannot_join`), unless the leader may follow it (then it redirects to it instead). Without that,
a known peer whose group nobody joins (a leader the others stopped following: ``leaders``) held every
other group of the step to its leader's deadline.

Who may lead. A leader forms only once its own quorum is met, and every follower whose smallest ticket
it holds waits for it until its deadline. So the lottery may only pick peers whose quorum the peers
that follow them can meet. A newcomer (it averaged with nobody yet) trusts its join peers alone, and
where they are fewer than the untrusted peers it sees on the step, its quorum was *all* of them: a
group it led formed only if those very peers followed it, and they were often elsewhere (leading,
following another leader, a batch late). At 64 simulated peers every newcomer needed the swarm's first
peer (every peer's join peer), the smallest tickets of the first step were newcomers', and each of
their groups failed at its deadline for want of one join peer ("only 3 of the at least 4 peers it
knows joined in time"); their followers suspected them, passed them over, then each led a group of
one: no step was ever taken. The invariant: **a peer leads only if whoever follows it can meet its
quorum** — it is anchored (it has averaged, or joined through nobody: its quorum is a majority of the
many peers it counts), its quorum leaves out some of the peers it counts, or it needs only itself.
Otherwise its announcement says it only follows (``Announcement.leads``; ``Quorum.leads``, set by the
training run): nobody waits for it, as for a client-only peer, so the no-deadlock argument above
holds unchanged, and it joins a group led by a peer that can form one. Whether a peer is anchored is
earned by rounds it committed, never by what other ids say, so free ids cannot stop an established peer
from leading (they can make a newcomer's quorum tight, which only keeps a newcomer, a follower anyway,
following). A leader whose group came out too small also only follows on its next look under the same
key (``grouping``): its ticket stays the smallest for the whole step, and drawn again at each retry it
failed again, while its followers' suspicions turned into exclusions that differ from follower to
follower and split the step's peers between leaders. Its own announcement is what every peer reads
alike, so the next look has one leader for all.

Followers' quorums. The quorum that keeps two groups of one step from both forming is the *leader's*
(a majority of the step's peers, counted among those it trusts); what a joiner's quorum guards is the
joiner: a leader may lie, so a member takes part only in a group that holds what it would follow
anyway. That is a majority of the peers it trusts on the step, since a majority of its trusted peers'
records is what decides which state it moves to (``progress``); a round it declines for more would move
it there all the same, a download later. So a joiner names that majority (``Quorum.joins``), not its
leader's quorum: a group that misses ``k`` of the step's peers then holds every member that trusts more
than ``2k + 1`` of them. Named as its leader's quorum, a member that trusted fewer than a majority of the
step needed *all* of them: at 128 simulated peers, where each trusted 54 to 88 of the step after the
first rounds (trust is earned window by window, see ``trust``), every group of the second step (88 to
108 members) failed at formation, members declining one after the other until the leader's own quorum
was gone.

Who leads first. A leader forms only with its own quorum, so a leader whose quorum is all of the peers it
trusts on the step (where they are fewer than a majority: see ``training``'s ``step_quorum``) fails as
soon as one of them is elsewhere, and its followers, held to its deadline, suspect it. Leaders are
therefore ordered by *rank* first, then by ticket (:func:`place`): rank 0 where the leader's quorum
leaves out at least an eighth of the peers it counts on the step, rank 1 otherwise; a peer of rank 1
leads only where no peer of rank 0 announced, and a newcomer that leads in a region of a split swarm
where nobody else could (``NEWCOMER_RANK``, 2) only where no peer of rank 0 or 1 announced. The rank
is the announcer's own word, as the lottery's other inputs are: a free id that claims rank 0 gains what
a ground ticket gains (it leads, and once it fails it is excluded with its subnet). The order is still
one strict order that every peer computes alike from the announcements, so the no-deadlock argument
above holds unchanged.

The group's closing. A leader's window is the run's matchmaking time from when its view expects the
target, but the step's peers begin to look over a spread of seconds (their views differ, and each looks
between two of its batches), and a window that closed on time left the last of them out: at 128
simulated peers, a step's group formed 5.6 s after its first look with 102 members, and 16 more peers
asked it 0.1 to 2 s later (each of them then downloaded the step). So a group that is not full closes
only once no peer the quorum counts joined it for ``QUIET`` seconds, and at most ``LINGER`` past its
deadline (:meth:`Gathering.closes_at`), and a follower may ask a leader until then (:func:`why_not`).
A late peer still follows by the ticket order: one with a smaller ticket than the lingering leader's
leads (alone, as before), since letting anyone follow a leader past its deadline would let an id that
declares a deadline just past lead every peer of the step whatever its ticket. (The leader holds the
smallest ticket of the step's announcers that may lead, so at 128 peers about one late peer in a hundred
is such a one.) The invariant: **a leader never closes a group that is not full while the peers it
counts are still joining, and closes it at most ``LINGER`` late.** Nothing holds a group past that:
what free ids can do (join, or publish records that swell the places a leader gathers for) costs at
most ``LINGER``, and only a step led by a peer that counts nobody but itself (a swarm's first step,
or a region of newcomers): a leader that counts any peer lingers only while counted peers join
(lingering for its places too, it let records of free ids hold each of its groups 2.5 s: the 3.5 s
steps of the suite's attack test took 6 s); a full group forms at once, as before. A group held to a
quorum that it cannot form with at its deadline gathers for the whole ``LINGER``, since closing then could
only fail it: at 128 simulated peers, at a swarm's second step (each peer trusting about 11 of its
region's 34 peers, so a leader's quorum was every one of them), a region's group of 32 failed at its
deadline for want of one trusted peer, whose look began 0.5 s before that deadline and asked 1.4 s
after it; the region's 34 peers then took no step for 30 s, each failed leader's followers suspecting
it and scattering to the next. So does a group whose leader counts nobody but itself (a newcomer
that trusts none of the step's peers: nothing tells it who is still coming) and that held no majority
of its places (the peers its leader sees on the step) at its deadline (:meth:`Gathering.holds_most`):
most of the step's peers are still on their way, and formed without them it leaves them to a second
group of the step, which the newcomers bound to one trusted peer in the first decline. At a swarm's
first step (128 simulated peers), a region's peers began to look over 5 s, its leader formed at its
deadline with 10 of the 25 it saw, two more groups of the step formed after it, and 15 of the step's
24 left-out declined a group for want of their one trusted peer, which was in another (it asked 2 s
after the deadline, its read of the records slow). A leader that finds a smaller one to follow
redirects its joiners there only until ``grouping.LATE`` before its deadline where its own group may
form (:meth:`Gathering.quorate`): later, they would have been held to its deadline and then sent elsewhere
(and suspected it for that), so it forms instead.

One committed round, one decision. Members' quorums differ (each counts the peers it knows and trusts,
and sizes its majority by its own records), and members drop out between formation and the round (a
state that moved on, a crash), so a round's contributors may hold one member's quorum and not another's.
Each member checking them against its own quorum *after* the round split the swarm (at 32 peers, most
members threw a committed round away while the others applied it; the former formed a second group of
the same step: two lineages). So the quorums are fixed and signed at formation: each joiner names its
quorum in its join request, the leader signs every member's as an entry of the manifest
(:meth:`Gathering.entries`: the need over the *other* members, counting only peers the leader knows to
publish progress, and needing at most a slack (``NEED_SLACK``, or an eighth of the peers known) more
than the leader's own need or a majority of the peers the leader knows to publish progress), every
member checks that its entry holds it to its own quorum before it takes part (:func:`holds_me`; else it
declines the group), and a committed round is applied only if the decided contributors meet the entries
of the leader and of the members the leader counts (:func:`short_of_quorums`), by every member alike; a
member the leader does not count (a stranger to it) also holds the round to its own entry, and may
discard it alone. The invariant: the leader and all the members it counts make the same apply/discard
decision, computed only from what the leader signed (the manifest and the decision), never from a
member's own view; no member applies a round they discard; and a stranger's entry binds only the
stranger. A member that disagrees with a group refuses to join it before the round. The round itself
still commits when the entries are not met, so that its audits run: a hostile reducer that refused
honest slices to make the round fall short is convicted as after any round (aborting instead, such a
round was never audited, and a zero farmer kept every round of an adversarial test's swarm aborting). A
joiner whose quorum the group cannot meet (it needs more than the members it counts, or more than that
bound) gets an empty entry and declines the group itself, and the others' entries do not count it: every
entry signed is met by the members that take part (:meth:`Gathering.entries`), so a group that forms
does not fall short for the members it holds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from ..errors import RemoteProtocolError
from ..identity import PeerID
from ..wire.codec import pack, unpack
from .protocol import MAX_COUNTS, Manifest
from .rules import listed_subnet

NEED_SLACK = 2  # more of the peers a leader counts than its own quorum needs a joiner's quorum may need
SLACK_SHARE = 8  # ... or this share of the peers the leader knows, where that is more (views differ by it)


@dataclass(frozen=True)
class Announcement:
    """A peer's readiness to average, as stored in the DHT (signed by the peer as the subkey owner)."""

    peer: PeerID
    addr: str  # "" when the peer is client-only: it can follow, never lead
    deadline: float  # wall-clock seconds: when this peer forms a group of its own
    bandwidth: float
    schema: bytes  # digest of the tensors' schema and the compression
    # False: the peer only follows (its quorum names peers it cannot bring to a group of its own: see
    # ``Quorum.leads``); it is still reachable at ``addr``, as a reducer. Sent only when False.
    leads: bool = True
    # Leaders of rank 0 lead before those of rank 1 (see "Who leads first"). Sent only when not 0.
    rank: int = 0
    # The group key looked for (``group_tag``), where the key it is stored under is not the group
    # key's own but one that every group key of the run shares (``grouping``: spread keys, whose
    # replicas are found once, not at every step). Sent only when not empty.
    group: bytes = b""

    @property
    def can_lead(self) -> bool:
        return bool(self.addr) and self.leads

    def closed(self) -> Announcement:
        """The same peer, no longer open: stored over the open announcement once a group formed."""
        return Announcement(
            self.peer, self.addr, 0.0, self.bandwidth, self.schema, self.leads, self.rank, self.group
        )

    def to_bytes(self) -> bytes:
        fields: list[object] = [self.addr, self.deadline, self.bandwidth, self.schema]
        if self.group:
            return pack([*fields, self.leads, self.rank, self.group])
        if not self.leads:
            return pack([*fields, False])
        return pack([*fields, True, self.rank] if self.rank else fields)

    @classmethod
    def from_bytes(cls, peer: PeerID, data: bytes) -> Announcement:
        try:
            addr, deadline, bandwidth, schema, *rest = unpack(data)
        except (TypeError, ValueError):
            raise RemoteProtocolError("malformed announcement") from None
        leads = True if not rest else rest[0] if len(rest) <= 3 else None
        rank = rest[1] if len(rest) >= 2 else 0
        group = rest[2] if len(rest) == 3 else b""
        if not (
            isinstance(leads, bool)
            and (leads or len(rest) != 2)
            and isinstance(group, bytes)
            and (len(rest) < 3 or 0 < len(group) <= GROUP_TAG_BYTES)
            and type(rank) is int
            and 0 <= rank <= MAX_RANK
            and isinstance(addr, str)
            and len(addr) <= 300
            and isinstance(deadline, int | float)
            and math.isfinite(deadline)
            and isinstance(bandwidth, int | float)
            and math.isfinite(bandwidth)
            and 0 <= bandwidth <= 1e15  # 0: the peer has not measured its own yet
            and isinstance(schema, bytes)
            and len(schema) <= 32
        ):
            raise RemoteProtocolError("malformed announcement")
        return cls(peer, addr, float(deadline), float(bandwidth), schema, leads, rank, group)


GROUP_TAG_BYTES = 8


def group_tag(group_key: str) -> bytes:
    """What an announcement stored under a key that several group keys share names ``group_key`` by."""
    return hashlib.blake2b(group_key.encode(), digest_size=GROUP_TAG_BYTES, person=b"p2pt-group").digest()


MAX_RANK = 2  # the ranks of leaders (see "Who leads first")
NEWCOMER_RANK = 2  # a newcomer that leads where its region has nobody else to (see "Who leads first")
DEADLINE_SLACK = 5.0  # seconds a leader's deadline may lie past ours (clock skew, later starts)
# A leader whose group is not full keeps gathering past its deadline while the peers it counts still
# join (one within QUIET seconds), for at most LINGER seconds (see "The group's closing"). LINGER is half
# of a joiner's grace (``grouping.JOIN_GRACE``): a joiner that asked before the deadline still has its
# answer within its wait.
LINGER = 2.5
QUIET = 1.0


def ticket(group_key: str, peer: PeerID) -> bytes:
    """``peer``'s place in the order of leaders under ``group_key``: smaller leads (see the module
    docstring). Set by the key and the group key alone, never by anything the peer declares."""
    # (the digest has a fixed length, so the key and the id cannot run into each other)
    return hashlib.blake2b(group_key.encode() + peer.digest, digest_size=16, person=b"p2ptrain-lead").digest()


def place(group_key: str, a: Announcement) -> tuple[int, bytes]:
    """``a``'s place in the order of leaders under ``group_key``: by its rank (what its quorum leaves
    room for, as it announced), then by its ticket. A strict order every peer computes alike from the
    announcements (tickets differ for different ids), which is all the no-deadlock argument needs."""
    return a.rank, ticket(group_key, a.peer)


def opening(now: float, wait: float, window: float) -> float:
    """When a matchmaking window opens that a peer asked to open ``wait`` seconds from ``now`` (a training
    run: when its view expects the step's target): at most a window later, and at most half of
    ``DEADLINE_SLACK``, so that peers whose views disagree on the target announce deadlines within the
    slack of each other's and follow each other; a leader that stalls holds a follower at most that much
    longer than it did with a window from its look's start."""
    return now + max(0.0, min(wait, window, DEADLINE_SLACK / 2))


def why_not(
    me: Announcement,
    a: Announcement,
    now: float,
    group_key: str,
    *,
    declined: Collection[Announcement] = (),
    excluded: Collection[PeerID] = (),
) -> str:
    """Why ``me`` does not follow ``a`` now ("" if it may).

    A deadline more than ``DEADLINE_SLACK`` past ours is further ahead than the run's matchmaking window
    allows (ours began no later than it): following it would keep us past our own window.
    ``declined``: announcements that refused us (a peer that refused while busy with its previous round
    may be asked again once it announces anew); ``excluded``: leaders this peer's book does not follow.
    """
    why = _why_not_now(me, a, now, declined, excluded)
    if not why and me.can_lead and place(group_key, a) >= place(group_key, me):
        return "after us in the order"
    return why


def _why_not_now(
    me: Announcement,
    a: Announcement,
    now: float,
    declined: Collection[Announcement],
    excluded: Collection[PeerID],
) -> str:
    """:func:`why_not`, but for the order of places (``choose_leader`` computes ``me``'s place once)."""
    if a.peer == me.peer:
        return "ourselves"
    if not a.can_lead:
        return "client-only: it cannot lead"
    if a.schema != me.schema:
        return "another schema: it could never admit us"
    if a.deadline + LINGER <= now:
        return "closed: its deadline passed"
    if a.deadline > me.deadline + DEADLINE_SLACK:
        past = a.deadline - me.deadline
        return f"its deadline lies {past:.1f} s past ours: further than the run's window allows"
    if a in declined:
        return "it refused us under this announcement"
    if a.peer in excluded:
        return "it failed us as a leader"
    return ""


def choose_leader(
    me: Announcement,
    seen: Iterable[Announcement],
    now: float,
    group_key: str,
    *,
    declined: Collection[Announcement] = (),
    excluded: Collection[PeerID] = (),
) -> Announcement | None:
    """The peer to ask for a place, or None when this peer should gather a group itself: the smallest
    place among the announcements ``me`` may follow (:func:`why_not`, :func:`place`)."""
    mine = place(group_key, me) if me.can_lead else None
    best: tuple[tuple[int, bytes], Announcement] | None = None
    for a in seen:
        if _why_not_now(me, a, now, declined, excluded):
            continue
        t = place(group_key, a)
        if (mine is None or t < mine) and (best is None or t < best[0]):
            best = (t, a)
    return None if best is None else best[1]


def cannot_join(
    leader: Announcement,
    seen: Iterable[Announcement],
    group_key: str,
    known: Collection[PeerID],
    *,
    followable: Collection[PeerID] = (),
) -> frozenset[PeerID]:
    """The ``known`` peers (counted in the leader's target) that will never join ``leader``'s group:
    they announced under the key, may lead, and hold a smaller ticket (a peer only ever follows smaller
    tickets). A client-only peer may follow anyone: it is never among them. Nor is a peer in
    ``followable``, one the leader may follow itself (:func:`why_not`): the leader goes to it (its group
    is not full without it, so it redirects its joiners there) rather than forming without it; else a
    leader that two peers reached before the smallest did formed a group without it, and the smallest
    led a group of one."""
    mine = place(group_key, leader)
    return frozenset(
        a.peer
        for a in seen
        if a.peer in known
        and a.peer != leader.peer
        and a.can_lead
        and a.peer not in followable
        and place(group_key, a) < mine
    )


@dataclass(frozen=True)
class Joiner:
    peer: PeerID
    addr: str
    bandwidth: float
    origin: str = ""  # the subnet its leader sees it from (the leader: its own, "" when it does not know)
    # its quorum, as its join request named it: ``need`` of ``counts`` (itself included) among a round's
    # contributors; 0: none (a peer averaging outside a training run)
    need: int = 0
    counts: frozenset[PeerID] = frozenset()


@dataclass(frozen=True)
class Quorum:
    """A group forms only once it holds at least ``size`` of ``peers`` (the leader included); a member's
    round commits only with that many of them among its contributors (see the module docstring)."""

    peers: frozenset[PeerID]
    size: int
    # the peers a joiner's quorum may name (those that publish progress, trusted or not: a newcomer
    # leader trusts few, and the joiners' quorums name the peers they trust); empty: ``peers``
    nameable: frozenset[PeerID] = frozenset()
    # Whether a peer held to this quorum may lead. Not when the quorum is all of a few peers it cannot
    # bring to its group (a newcomer's: see the module docstring, "Who may lead"): it only follows.
    leads: bool = True
    # How many of ``peers`` a group this peer *joins* must hold (0: ``size``): a majority of the peers it
    # trusts on the step, which is what decides the state it follows anyway (see the module docstring,
    # "Followers' quorums").
    joining: int = 0
    # Whether its leader's quorum leaves room (see "Who leads first"): 0 leads before 1, and 1 before
    # a newcomer's ``NEWCOMER_RANK``.
    rank: int = 0

    @property
    def joins(self) -> int:
        """The members of ``peers`` (this one included) a group this peer joins must hold."""
        return self.joining or self.size

    def named(self, seen: Iterable[PeerID] = ()) -> tuple[PeerID, ...]:
        """The peers a join request names: all of them, or past ``MAX_COUNTS`` those ``seen`` (announcing
        under the group key) first. Leaving peers out only makes the quorum harder to meet."""
        if len(self.peers) <= MAX_COUNTS:
            return tuple(self.peers)
        first = [p for p in dict.fromkeys(seen) if p in self.peers]
        taken = set(first)
        rest = [p for p in self.peers if p not in taken]
        return tuple([*first, *rest][:MAX_COUNTS])


def short_of_quorums(manifest: Manifest, contributors: Iterable[PeerID], me: PeerID | None = None) -> str:
    """Why ``me`` does not apply a committed round of ``manifest`` with these ``contributors`` ('' if it
    does): they miss the signed quorum of the leader, of a member the leader counts, or of ``me``
    (``Manifest.short_of_quorum``). The leader and the members it counts (in an open swarm, those it
    trusts) decide alike, from the signed manifest and decision alone; a member it does not count may in
    addition discard the round for its own entry, which costs that member alone (it catches up by
    replay), never apply one the others discard. A stranger's entry binds nobody else: enforced on every
    member, it let a stranger name an accomplice that publishes records and have it drop out, and no
    member applied the round (two free ids in the group, any round stalled). (A round of one
    contributor is no exception: applied, its contributor stepped alone while the members that left its
    group formed another of the same step, a fork in the in-memory swarm test.)"""
    peers = manifest.peers()
    at = {p: i for i, p in enumerate(peers)}
    counted = manifest.masks[0] if manifest.masks else 0
    binding = {0} | {j for j in range(len(peers)) if counted >> j & 1}
    if me is not None and me in at:
        binding.add(at[me])
    return manifest.short_of_quorum(tuple(sorted({at[p] for p in contributors if p in at})), binding)


def holds_me(manifest: Manifest, me: PeerID, own: Quorum) -> str:
    """Why the manifest's entry for ``me`` does not hold it to its ``own`` quorum ('' if it does): any
    contributors that meet the entry must hold ``own.joins`` of ``own.peers`` (counting ``me``, which a
    round counts only as its own member: its entry is over the others). The entry needs ``need`` of the
    members in its mask; at worst they are all of the mask's members ``me`` does not count, then the
    rest from those it does."""
    peers = manifest.peers()
    if me not in peers:
        return "this peer is no member of the group"
    i = peers.index(me)
    if not manifest.needs:
        return "the manifest holds no member to a quorum"
    need, mask = manifest.needs[i], manifest.masks[i]
    mine = sum(1 << j for j, p in enumerate(peers) if j != i and p in own.peers)
    worst = need - (mask & ~mine).bit_count()
    wanted = own.joins - (1 if me in own.peers else 0)
    if worst >= wanted:
        return ""
    return (
        f"the group is held to {need} of the {mask.bit_count()} other members its leader signed for this"
        f" peer, which may hold only {max(worst, 0)} of the {wanted} others it must average with"
    )


@dataclass
class Gathering:
    """A leader's group in the making."""

    leader: Joiner
    schema: bytes
    target_size: int
    min_size: int
    by_origin: bool = False  # count joiners by origin (robust runs; see the module docstring)
    quorum: Quorum | None = None  # the known peers it must hold (see the module docstring)
    joiners: list[Joiner] = field(default_factory=list)
    bumped: dict[PeerID, str] = field(default_factory=dict)  # joiners that lost their place, and why
    formed: bool = False
    away: frozenset[PeerID] = frozenset()  # peers counted in the target that never join (``cannot_join``)
    last_counted: float = -math.inf  # when a joiner the quorum counts last joined (``closes_at``)
    joined_at: dict[PeerID, float] = field(default_factory=dict)  # when each joiner joined (``holds_most``)

    def offer(self, joiner: Joiner, schema: bytes, now: float = -math.inf) -> str | None:
        """Admit ``joiner`` (asking at ``now``), or return why not."""
        if self.formed:
            return "the group is already formed"
        if schema != self.schema:
            return "schema mismatch: the leader averages tensors of other shapes, dtypes or compression"
        if joiner.peer == self.leader.peer or any(j.peer == joiner.peer for j in self.joiners):
            return "already in this group"
        if not (math.isfinite(joiner.bandwidth) and joiner.bandwidth >= 0):
            return "bandwidth must be finite and not negative (0: not measured yet)"
        most = self._most_needed() if self.quorum is not None else 0
        if self.quorum is not None and joiner.need - (joiner.peer in joiner.counts) > most:
            return (  # (told at once: whoever joins, the group's quorum will not hold it)
                f"its quorum needs {joiner.need} peers, more than this group can be held to ({most} others)"
            )
        listed = listed_subnet(joiner.addr)
        if self.by_origin and listed and joiner.origin and listed != joiner.origin:
            # Members refuse a manifest that splits a listed subnet over origins, or merges two: a joiner
            # listed in one subnet and counted in another (where it connects from) would make them
            # refuse the whole group.
            return f"the address offered is in {listed}, but the call came from {joiner.origin}"
        if self.size() >= self.places():
            out = self._displaced_by(joiner)
            if out is None:
                return "the group is full"
            self.joiners.remove(out)
            self.bumped[out.peer] = (
                "the group is full: its place went to a peer the leader knows"
                if self._counts(joiner)
                else "the group is full: its place went to a peer of a less represented subnet"
            )
        self.bumped.pop(joiner.peer, None)
        self.joiners.append(joiner)
        self.joined_at[joiner.peer] = now
        if self.quorum is None or self._counts(joiner):
            self.last_counted = max(self.last_counted, now)
        return None

    def closes_at(self, deadline: float) -> float:
        """When a group that is not full stops gathering (it forms if it may, else fails): at
        ``deadline``, or, while the peers the quorum counts still join, when none joined for ``QUIET``
        seconds, and at most ``LINGER`` past it (see "The group's closing" in the module docstring).
        A group held to a quorum that could not form now (short of its quorum or of its minimum size),
        or whose leader counts nobody but itself and that held no majority of its places at its
        deadline (:meth:`counts_others`, :meth:`holds_most`), gathers until ``LINGER`` past its
        deadline: closed sooner it could only fail, or split its step's peers. Nothing holds a group
        past ``LINGER``, and only a leader that counts nobody else lingers for its places (which records
        of free ids may swell), so free ids cannot hold a group longer, nor one led by a peer that
        trusts some of the step's peers at all. (A group held to no quorum, the plain averager's,
        closes as before.)"""
        if self.quorum is not None and not (
            self.quorate() and (self.counts_others() or self.holds_most(deadline))
        ):
            return deadline + LINGER
        return min(deadline + LINGER, max(deadline, self.last_counted + QUIET))

    def counts_others(self) -> bool:
        """Whether the leader's quorum counts any peer but itself: one that does sees who is still coming
        (its counted peers, :meth:`closes_at`); one that does not (a newcomer that trusts none of the
        step's peers) has only the places it gathers for (:meth:`holds_most`)."""
        return self.quorum is not None and bool(self.quorum.peers - {self.leader.peer})

    def holds_most(self, by: float) -> bool:
        """Whether the group held a majority of the places it gathers for (the peers its leader sees on
        the step, less those that never join) with the members that joined ``by`` then: short of that at
        its deadline, most of them are still on their way, and a group formed without them leaves them
        to form a second group of the step (see "The group's closing")."""
        early = sum(self.joined_at.get(j.peer, -math.inf) <= by for j in self.joiners)
        return 2 * (1 + early) > self.places()

    def _places(self) -> dict[str, int]:
        places: dict[str, int] = {self.leader.origin: 1}
        for j in self.joiners:
            places[j.origin] = places.get(j.origin, 0) + 1
        return places

    def _counts(self, joiner: Joiner) -> bool:
        return self.quorum is not None and joiner.peer in self.quorum.peers

    def counted(self) -> int:
        """Members of the quorum's peers in the group (the leader included)."""
        return sum(self._counts(j) for j in (self.leader, *self.joiners))

    def _displaced_by(self, joiner: Joiner) -> Joiner | None:
        """The joiner that gives up its place to ``joiner`` in a full group: for a peer of the quorum,
        the newest joiner that is not; else the newest of the origin holding the most places, if that
        holds at least two more than ``joiner``'s (so the places even out and never swing back and
        forth)."""
        if self.quorum is not None and self._counts(joiner):
            stranger = next((j for j in reversed(self.joiners) if not self._counts(j)), None)
            if stranger is not None:
                return stranger
        if not self.by_origin:
            return None
        places = self._places()
        movable = {j.origin for j in self.joiners}
        if not movable:
            return None
        largest = max(movable, key=lambda o: places[o])
        if places[largest] < places.get(joiner.origin, 0) + 2:
            return None
        return next(j for j in reversed(self.joiners) if j.origin == largest)

    def dominated(self) -> bool:
        """Does one origin hold more than half of the places (then the group waits for its deadline, so
        that peers of other subnets may still take places; see the module docstring)?"""
        if not self.by_origin:
            return False
        places = self._places()
        return len(places) > 1 and 2 * max(places.values()) > self.size()

    def ready(self) -> bool:
        """Full, and may form before its deadline."""
        return self.full() and self.quorate() and not self.dominated()

    def quorate(self) -> bool:
        """Whether the group would form now: large enough, holding its quorum (see :meth:`form`)."""
        quorate = self.quorum is None or self.counted() >= self.quorum.size
        return quorate and self.size() >= self.min_size

    def origins(self, members: list[Joiner]) -> tuple[int, ...]:
        """For a manifest listing ``members``: each one's origin as the index of the first member that
        shares it; () when joiners are not counted by origin (every member its own)."""
        if not self.by_origin:
            return ()
        first: dict[str, int] = {}
        return tuple(first.setdefault(m.origin, i) for i, m in enumerate(members))

    def withdraw(self, peer: PeerID) -> None:
        """A joiner gave up before the group formed."""
        if not self.formed:
            self.joiners = [j for j in self.joiners if j.peer != peer]

    def size(self) -> int:
        return 1 + len(self.joiners)

    def full(self) -> bool:
        """Every peer counted in the target joined, or never joins: each peer counted once. A peer
        counted away may join after all (its look for a group ended, and its next one follows: a leader
        whose group came out short steps aside), and counted twice it made the group full one peer
        short: in a DiLoCo swarm of 3, the two fast peers' group formed the moment the second joined, a
        tenth of a second before the third's replay landed it on the step, at every step (it averaged in
        1 of 6: a CI failure).

        A joiner the leader does not count holds no place of a peer it counts that has not joined yet:
        the group is not full while both are so (it closes as a group that is not full does, and the
        counted peer that asks meanwhile takes that joiner's place). Counted full by places alone, a
        group of 3 honest peers formed the moment a newcomer catching up joined it ahead, just before the
        third honest peer asked; that one downloaded the step (the suite's test of fresh keys)."""
        if self.size() < self.places():
            return False
        if self.quorum is None or self.counted() == self.size():
            return True
        joined = {self.leader.peer, *(j.peer for j in self.joiners)}
        return not self.quorum.peers.difference(joined, self.away)

    def places(self) -> int:
        """The members the group is gathered for: its target, less the counted peers that never join."""
        away = self.away.difference(j.peer for j in self.joiners)
        return max(self.min_size, self.target_size - len(away))

    def form(self) -> list[Joiner] | str:
        """The members in order (leader first, then by peer id), or why the group cannot form."""
        self.formed = True
        if self.size() < self.min_size:
            return f"only {self.size()} of at least {self.min_size} peers joined in time"
        if self.quorum is not None and self.counted() < self.quorum.size:
            return f"only {self.counted()} of the at least {self.quorum.size} peers it knows joined in time"
        return [self.leader, *sorted(self.joiners, key=lambda j: j.peer.digest)]

    def entry(
        self, m: Joiner, members: list[Joiner], taking: Collection[PeerID] | None = None
    ) -> tuple[int, int] | str:
        """Member ``m``'s quorum as the manifest signs it: (need, bitmask of the other members it counts),
        or why the group cannot meet it. The leader's is its own; a joiner's counts only peers the
        leader knows publish progress (``Quorum.nameable``: a stranger's list names no ids of its own
        that never published), and needs at most what :meth:`_most_needed` allows. ``taking``: the
        members that take part (all of ``members`` if None); the mask counts only those."""
        if self.quorum is None:
            return 0, 0
        leading = m.peer == self.leader.peer
        counts = self.quorum.peers if leading else m.counts & (self.quorum.nameable or self.quorum.peers)
        need = self.quorum.size if leading else m.need
        need = max(0, need - (1 if m.peer in (self.quorum.peers if leading else m.counts) else 0))
        mask = sum(
            1 << j
            for j, o in enumerate(members)
            if o.peer != m.peer and o.peer in counts and (taking is None or o.peer in taking)
        )
        most = self._most_needed()
        if need > most:
            return f"its quorum needs {need} other peers, more than this group is held to ({most})"
        if need > mask.bit_count():
            return (
                f"its quorum needs {need} other peers, and the group holds {mask.bit_count()} of those"
                " it counts that its leader knows"
            )
        return need, mask

    def _most_needed(self) -> int:
        """The most other members a joiner's quorum may need: the leader's own need, or a majority of the
        peers the leader knows to publish progress (``Quorum.nameable``, the peers an entry may count),
        whichever is more, and the slack (views differ: records travel for seconds, and a joiner that
        sees more peers on the step wants more). The slack grows with the peers known: at 128 simulated
        peers a leader that had read 108 records refused joiners that saw 115 to 120 on the step ("its
        quorum needs 58 peers, more than this group can be held to (56 others)"), its own trusted
        peers among them, and its group then missed its own quorum.

        The invariant: an honest joiner with the leader's records is never refused for its quorum. Its
        need is a majority of the peers on the step as it sees them (``progress``), or fewer where it
        trusts fewer, so at most a majority of the publishing peers; it never depends on how many of
        them the *leader* trusts. Capped by the leader's trusted peers instead, a leader trusting its 3
        join peers refused the one joiner that trusts everyone (the swarm's first peer, its join peer:
        need 17 of 32), while its own quorum needed that very peer: neither could form a group, their
        followers suspected them, and at 32 simulated peers matchmaking stalled for good. A large need
        costs the group nothing it did not owe: the entry is signed only where the group can meet it
        (:meth:`entry`), and a stranger's entry binds the stranger alone (``short_of_quorums``)."""
        assert self.quorum is not None
        known = len(self.quorum.nameable or self.quorum.peers)
        return max(self.quorum.size - 1, known // 2) + max(NEED_SLACK, known // SLACK_SHARE)

    def entries(
        self, members: list[Joiner]
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | str:
        """The manifest's ``needs``, ``counts`` and ``out`` for the formed group (() when it has no
        quorum), or why the group cannot form: the leader's own quorum cannot be met by the members that
        take part.

        The invariant (a group that forms can meet every entry it signs): every member with an entry
        counts only members that take part, and needs no more of them than it counts. A member whose
        quorum the members taking part cannot meet gets no entry (0, 0) and declines the group itself
        (``holds_me``); the others' entries then no longer count it, and so on until none changes: the
        largest set of members each of whose quorum the set itself meets (removing a member only ever
        removes others' counted members, so the order does not matter). Signing entries that counted
        members bound to decline made each round of such a group fall short as soon as they declined
        (at 32 simulated peers: "its contributors hold 11 of the 15 other peers member 7 must average
        with"), every member discarded it and suspected its leader, and three such rounds had a leader
        passed over for minutes: matchmaking stalled. An entry that is met at formation can still fall
        short in the round (a member that drops out later): that is the round's ordinary failure.

        The members that decline are signed ``out`` (``Manifest.out``): no partition, no entry, no slices
        waited for. Signed in with an entry of (0, 0), each was a reducer the round lost: at 128 simulated
        peers with 48 inbound slots a node, 196 of the 337 slices that never reached their reducer went
        to such a member ("this member left round ... before it started"), and the partition's
        replacement needed every member to send its slice again through slots already full."""
        if self.quorum is None:
            return (), (), ()
        out: set[PeerID] = set()  # members that decline: the members taking part cannot meet their quorums
        while True:
            taking = {m.peer for m in members} - out
            pairs = {m.peer: self.entry(m, members, taking) for m in members if m.peer not in out}
            failing = {p for p, e in pairs.items() if isinstance(e, str)}
            if self.leader.peer in failing:
                why = pairs[self.leader.peer]
                assert isinstance(why, str)
                return f"the members taking part cannot meet the leader's own quorum: {why}"
            if not failing:
                break
            out |= failing
        final = [pairs.get(m.peer, (0, 0)) for m in members]
        return (
            tuple(e[0] if isinstance(e, tuple) else 0 for e in final),
            tuple(e[1] if isinstance(e, tuple) else 0 for e in final),
            tuple(i for i, m in enumerate(members) if m.peer in out),
        )
