"""One member's decisions in a butterfly round (pure: messages and ``now`` in, decisions out).

Theory of operation (member ``me`` of a group of ``n``, coordinator = member 0, round length ``T``; the
trio driver around this is ``allreduce``):

1. Scatter, until ``0.4 T``: each member streams its slice of partition ``j`` to reducer ``j``. A reducer
   stops waiting once every sender delivered or failed (:meth:`RoundMachine.slices_settled`), or at the
   deadline. A slice is refused before a byte is read when its weight is not plausible or its origin not
   the leader's (:meth:`~RoundMachine.distrust`). A member whose every connection with us closed and
   stayed closed for ``GONE_AFTER`` seconds counts as failed at once (:meth:`~RoundMachine.watch`): a
   dead peer costs the others that grace, not the phase's deadline.
2. Decide, until ``0.5 T``: reducers report whom they received (:meth:`~RoundMachine.report`); the
   coordinator decides who counts as a contributor and which reducers failed, and names a replacement
   for each (``agreement``; :meth:`~RoundMachine.decide`). Losing the coordinator, a member asks the
   others for the signed decision until ``0.9 T``.
3. A reducer's failure: the decision names it in ``failed`` with its replacement. :meth:`~RoundMachine.
   settle` turns the decision into this member's :class:`Plan`: the early results of a failed reducer
   are void, every contributor sends that partition's slice again to its replacement, the replacement
   reduces it, and a member too slow to report loses its own partition.
4. Gather, until ``0.9 T``: each reducer computes its partitions over exactly the decided contributors;
   every member fetches every partition from its holder (:meth:`~RoundMachine.holder`), and from the other
   members too once that fetch failed or stalled for ``STALLED_AFTER`` seconds
   (:meth:`~RoundMachine.stalled_at`): a reducer that serves some and then hangs cannot split the group.
   Every result is checked before it counts as held (``gathering``: its form, its reducer's signed
   attestation, and its size against this member's own values, see ``bounds``). Bytes that break the
   rules are a fault of whoever served them (:meth:`~RoundMachine.fault`): that partition is not
   fetched again, and this member's round ends in an abort. A fault is *proven* when the bytes came
   from the partition's holder (malformed, not finite, not what it attested, out of bounds) or from a
   relay (malformed, not finite: an honest relay holds only checked values); a relayed result that is
   merely out of this member's bounds is not proven against anyone (the relay may have accepted it
   within its own), and counts against the holder as a strike.
5. Commit when every partition is held and none is at fault, else abort (:meth:`~RoundMachine.outcome`);
   after an abort, :meth:`~RoundMachine.convicted` names whom a proven fault bans, and
   :meth:`~RoundMachine.blame` whom else this member's round failed on.

Only the holder of a partition computes it, and the decision settles which result it is, so every member
that commits holds the same bits (commit by agreement). Every decision returns its reason in words.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from ..errors import RemoteProtocolError
from ..identity import PeerID
from .agreement import WEIGHT_SLACK, Coordinator
from .protocol import Decision, Manifest, ReportReq
from .rules import SeenOrigins

SCATTER, DECIDE, AWAIT_DECISION, GATHER = 0.4, 0.5, 0.6, 0.9  # phase deadlines, fractions of the round
GONE_AFTER = 1.0  # seconds a member's connections must stay closed before it counts as failed
STALLED_AFTER = 2.0  # seconds a fetch may receive nothing before the other members are asked too


@dataclass(frozen=True)
class Deadlines:
    """When each phase of a round ends (virtual seconds, the round's clock)."""

    start: float
    scatter: float
    decide: float
    await_decision: float  # a reducer's report waits this long for the decision
    gather: float
    end: float

    @classmethod
    def of(cls, start: float, timeout: float) -> Deadlines:
        return cls(
            start,
            start + SCATTER * timeout,
            start + DECIDE * timeout,
            start + AWAIT_DECISION * timeout,
            start + GATHER * timeout,
            start + timeout,
        )


@dataclass(frozen=True)
class Plan:
    """What this member does once the decision is in."""

    abort: str = ""  # non-empty: the round is aborted for every member, and why
    void_early: tuple[int, ...] = ()  # partitions whose early results are void: their reducer failed
    resend: tuple[tuple[int, int], ...] = ()  # (partition, member): our slice again, to its replacement
    take_over: tuple[tuple[int, float | None], ...] = ()  # partitions we re-reduce, with our own weight
    drop_own: bool = False  # our partition went elsewhere: we reported too late
    reason: str = ""


@dataclass(frozen=True)
class Fault:
    """Bytes of a partition's result that broke the rules: who served them, and whether that proves it."""

    server: int  # the member that served the bytes (the holder, or a relay)
    holder: int  # the partition's holder
    reason: str
    proven: bool  # the server is at fault beyond doubt (see ``RoundMachine.fault``)


@dataclass
class Outcome:
    """How this member's round ends: committed, or aborted and why."""

    committed: bool
    reason: str = ""
    missing: list[int] = field(default_factory=list)


class RoundMachine:
    """A member's bookkeeping of one round and every decision it takes from it (no I/O, no tensors)."""

    def __init__(
        self,
        manifest: Manifest,
        digest: bytes,
        me: int,
        weight: float,
        deadlines: Deadlines,
        caps: Mapping[int, float] | None = None,
    ) -> None:
        """``caps``: the most weight this member finds plausible per member (the coordinator counts
        claims at most that; a reducer refuses far more)."""
        self.manifest, self.digest = manifest, digest
        self.peers = manifest.peers()
        self.n = len(self.peers)
        self.me, self.weight = me, weight
        self.sizes = list(manifest.sizes)
        self.at = deadlines
        self.caps = dict(caps or {})
        self.coordinator = Coordinator(digest, self.sizes, caps=dict(self.caps)) if me == 0 else None
        self.origins = SeenOrigins(manifest)  # the leader's origins, checked against what we see
        self.scatter_open = True
        self.failed_senders: dict[int, set[int]] = {}  # partition -> senders whose stream broke
        self.unreachable: set[int] = set()  # reducers my slices could not reach
        # Members whose connections closed for good during the round; from the start, those the leader
        # signed out (``Manifest.out``): they send no slices and fetch no results
        self.signed_out = frozenset(manifest.out)
        self.gone: set[int] = set(self.signed_out)
        # Members this member could not connect to at its last try after the decision (the gather's:
        # ``gathering``): they serve it nothing, and this member relays none of their partitions it lacks
        self.out_of_reach: set[int] = set()
        self.seen: set[int] = set()  # members we were connected with during the round
        self._lost_at: dict[int, float] = {}  # member -> when we last saw it connected
        self._others_settled_at: float | None = None  # when every sender but the silent ones settled (watch)
        self.decision: Decision | None = None
        self.decision_bytes = b""  # the decision as the coordinator signed it
        self.plan: Plan | None = None
        self.held: set[int] = set()  # partitions whose final values this member holds
        self.progress: dict[int, float] = {}  # partition -> when its fetch last received something
        # (partition reduced here, member) for each member that has yet to fetch it: a set of who, not a
        # count of fetches, so that a member served twice (an early fetch whose chunks the decision
        # voided, then the result; a fetch again after a stall) is not taken for another member served
        self.owed: set[tuple[int, int]] = set()
        self.finished = False  # this member's own part of the round is over (committed or aborted)
        self.faults: dict[int, Fault] = {}  # partition -> the first fault found in its result
        self.bad_senders: dict[int, str] = {}  # member -> why a slice it sent us broke the rules

    def name(self, i: int) -> str:
        return self.peers[i].short()

    @property
    def partitions(self) -> list[int]:
        return [p for p, s in enumerate(self.sizes) if s > 0]

    # ---- scatter ----------------------------------------------------------------------------------

    def member_of(self, peer: PeerID) -> int:
        """The index of a caller; RemoteProtocolError if it is not a member."""
        try:
            i = self.peers.index(peer)
        except ValueError:
            raise RemoteProtocolError(f"{peer.short()} is not a member of this round") from None
        self.seen.add(i)
        return i

    @staticmethod
    def bad_weight(weight: float) -> str:
        return "" if math.isfinite(weight) and weight > 0 else "the weight must be positive and finite"

    def distrust(self, sender: int, p: int, weight: float, host: str, relayed: bool, seen_at: str) -> str:
        """Why ``sender``'s slice of partition ``p`` is not believed ('' if it is): a weight far above
        what its records make plausible, or an origin that is not the one the leader listed for it."""
        cap = self.caps.get(sender)
        why = self.origins.refusal(sender, host, relayed, seen_at)
        if cap is not None and weight > WEIGHT_SLACK * cap:
            why = f"weight {weight:g} is over {WEIGHT_SLACK:g} x the {cap:g} its records make plausible"
        if why and p == self.me:  # its slice will not come: this reducer need not wait for it to report
            self.sender_failed(p, sender)
        return why

    def misplaced(self, p: int) -> str:
        """Why a slice of partition ``p`` is refused here ('' if not yet: a slice of a failed reducer's
        partition waits for the decision, see :meth:`takes_over`)."""
        if p >= self.n or self.sizes[p] == 0:
            return f"partition {p} does not exist"
        if p == self.me and not self.scatter_open:
            return "too late: this reducer already reported"
        return ""

    def takes_over(self, p: int) -> str:
        """Why a slice of partition ``p`` (not ours) is refused once the decision is in ('' if we re-reduce
        it: the decision names us as its failed reducer's replacement)."""
        if self.decision is None or self.decision.replacement_of(p) != self.me:
            return f"this member does not reduce partition {p}"
        return ""

    def sender_failed(self, p: int, sender: int) -> None:
        self.failed_senders.setdefault(p, set()).add(sender)

    def slices_settled(self, delivered: Collection[int]) -> bool:
        """As a reducer: every sender of our partition delivered or failed (no need to wait longer)."""
        failed = self.failed_senders.get(self.me, set())
        return all(i in delivered or i in failed or i in self.signed_out for i in range(self.n))

    def close_scatter(self) -> None:
        self.scatter_open = False

    def unreachable_reducer(self, to: int, left_round: bool, delivered: Collection[int] | None) -> str:
        """Our slice could not reach member ``to``; a log line if that also makes it gone."""
        self.unreachable.add(to)
        if self.coordinator is not None:
            self.coordinator.unreachable.add(to)
        if left_round and to not in self.gone:  # it left the round: it sends nothing either
            return self.member_gone(to, "it left the round before it started", delivered)
        return ""

    def watch(self, live: Collection[PeerID], now: float, delivered: Collection[int] | None) -> list[str]:
        """Members whose connections with us closed and stayed closed for ``GONE_AFTER`` seconds count as
        failed; returns a log line for each newly gone one.

        A member we were never connected with during the round (it died as the group formed, before
        anyone had a connection with it but the coordinator; or it is client-only and crashed before it
        dialed us) gives no connection to lose. As a reducer, we wait for such *silent* senders only
        until every other sender of our partition has delivered or failed, and then as long again as
        that took (at least ``GONE_AFTER``): a live member that is merely late (its slices take as long
        to prepare as the others') is waited for, a dead one no longer costs every reducer the scatter's
        deadline. (At 32 simulated peers, a member killed 0.03 s after its group formed held the round
        of 26 for the whole scatter, 12 of its 30 seconds.)"""
        out = []
        silent = []
        for i, peer in enumerate(self.peers):
            if i == self.me or i in self.gone:
                continue
            if peer in live:
                self.seen.add(i)
                self._lost_at.pop(i, None)
            elif i in self.seen:
                if now - self._lost_at.setdefault(i, now) >= GONE_AFTER:
                    out.append(self.member_gone(i, f"no connection for {GONE_AFTER:g} s", delivered))
            elif delivered is not None and i not in delivered:
                silent.append(i)
        if silent and delivered is not None and self.scatter_open:
            if self.slices_settled({*delivered, *silent}):  # every sender but the silent settled
                if self._others_settled_at is None:
                    self._others_settled_at = now
                settled = self._others_settled_at
                if now - settled >= max(GONE_AFTER, settled - self.at.start):
                    took = now - self.at.start
                    why = f"nothing from it in the round, {took:.1f} s in, the others' slices all here"
                    out += [self.member_gone(i, why, delivered) for i in silent]
            else:
                self._others_settled_at = None
        return out

    def watching(self, now: float) -> bool:
        return self.decision is None and not self.finished and now < self.at.end

    def member_gone(self, i: int, why: str, delivered: Collection[int] | None) -> str:
        """Member ``i`` is gone: a sender of ours that has not delivered failed, and a reducer that has
        not reported is unreachable to the coordinator. ``delivered``: who delivered to our partition
        (None: we reduce none)."""
        self.gone.add(i)
        if delivered is not None and i not in delivered:
            self.sender_failed(self.me, i)
        c = self.coordinator
        if c is not None and i in c.reducers and i not in c.reports:
            c.unreachable.add(i)
        return f"{self.name(i)} is gone ({why}): counted as failed"

    # ---- decide -----------------------------------------------------------------------------------

    def report(self, delivered: Mapping[int, float] | None) -> ReportReq:
        """Our report to the coordinator: whom our partition received (None: we reduce nothing)."""
        senders = sorted(delivered) if delivered is not None else None
        return ReportReq(
            self.digest,
            tuple(senders) if senders is not None else None,
            tuple(delivered[i] for i in senders) if delivered is not None and senders is not None else (),
            tuple(sorted(self.unreachable)),
        )

    def take_report(self, member: int, req: ReportReq) -> str:
        """As coordinator: a member's report; returns why it was ignored ('' if taken, or nothing to
        take). RemoteProtocolError if malformed."""
        if self.coordinator is None or req.delivered is None:
            return ""
        if len(req.weights) != len(req.delivered):
            raise RemoteProtocolError("one weight per delivered sender")
        return self.coordinator.report(member, dict(zip(req.delivered, req.weights, strict=True))) or ""

    def ready_to_decide(self, now: float) -> bool:
        assert self.coordinator is not None
        return self.coordinator.ready() or now >= self.at.decide

    def report_own(self, own: Mapping[int, float] | None) -> None:
        """As coordinator: our own partition's report (``own``: whom it received; None: we reduce none)."""
        assert self.coordinator is not None
        if own is not None:
            self.coordinator.report(self.me, dict(own))

    def decide(self) -> tuple[Decision, list[tuple[int, float, float]]]:
        """As coordinator: the decision now (reducers that have not reported failed), and the members
        whose weight claims were capped: (member, claimed, allowed)."""
        assert self.coordinator is not None
        decision = self.coordinator.decide()
        return decision, [(i, c, a) for i, (c, a) in self.coordinator.capped.items()]

    def settle(self, decision: Decision, signed: bytes) -> Plan | None:
        """The decision is in: this member's plan (None if one was already settled)."""
        if self.decision is not None:
            return None
        self.decision, self.decision_bytes = decision, signed
        if decision.abort:
            self.plan = Plan(
                abort=decision.abort, reason=f"round aborted by the coordinator: {decision.abort}"
            )
            return self.plan
        contributor = self.me in decision.contributors
        pairs = list(zip(decision.failed, decision.replacements, strict=True))
        self.plan = Plan(
            void_early=tuple(decision.failed),
            resend=tuple((f, r) for f, r in pairs if r != self.me) if contributor else (),
            take_over=tuple((f, self.weight if contributor else None) for f, r in pairs if r == self.me),
            drop_own=self.me in decision.failed,
            reason=(
                f"{len(decision.contributors)} contributors"
                + (
                    f"; reducers {list(decision.failed)} failed, replaced by {list(decision.replacements)}"
                    if pairs
                    else ""
                )
            ),
        )
        return self.plan

    # ---- gather -----------------------------------------------------------------------------------

    def holder(self, p: int) -> int:
        """Who computes partition ``p``'s result: its reducer, or the replacement the decision names."""
        r = self.decision.replacement_of(p) if self.decision is not None else None
        return p if r is None else r

    def contributors_in(self, delivered: Collection[int]) -> bool:
        """Every decided contributor's slice of a partition is in (it can be finalized)."""
        assert self.decision is not None
        return all(i in delivered for i in self.decision.contributors)

    def finalized(self, p: int) -> None:
        """We computed partition ``p``: every other member will fetch it from us."""
        self.held.add(p)
        self.owed.update((p, i) for i in range(self.n) if i != self.me and i not in self.signed_out)

    def fetched(self, p: int, now: float) -> None:
        self.progress[p] = now

    def stalled_at(self, p: int) -> float:
        """When the fetch of ``p`` counts as stalled (and the other members are asked too)."""
        return self.progress[p] + STALLED_AFTER

    def served(self, p: int, member: int) -> bool:
        """``member`` fetched partition ``p`` from us; True once no one needs this round any more."""
        self.owed.discard((p, member))
        return self.finished and not self.owed

    def finish(self) -> bool:
        """Our own part is over; True if no one needs this round any more (every member fetched what
        it reduced here: until then it goes on serving, to the round's end at most)."""
        self.finished = True
        return not self.owed

    def fault(self, p: int, server: int, reason: str, *, proven: bool) -> str:
        """The result of partition ``p`` that ``server`` served broke the rules (``reason``): nothing of
        it is applied, ``p`` is not fetched again, and the round ends in an abort for this member.
        ``proven``: the bytes themselves convict the server. Returns a log line ('' for a later fault
        of a partition already at fault)."""
        if p in self.faults or server == self.me:
            return ""
        holder = self.holder(p)
        self.faults[p] = Fault(server, holder, reason, proven)
        via = "" if server == holder else f" relayed by {self.name(server)}"
        return f"the result of partition {p} from {self.name(holder)}{via} is refused: {reason}"

    def spoilt(self, p: int, reason: str) -> str:
        """The result of partition ``p`` that this member reduced itself broke the rules (``reason``):
        nothing of it is applied here, and the round ends in an abort for this member. Nobody is blamed
        or convicted for it here (the others judge what we serve them). Returns a log line."""
        self.faults.setdefault(p, Fault(self.me, self.me, reason, False))
        return f"our own result of partition {p} is refused: {reason}"

    def bad_slice(self, sender: int, p: int, reason: str) -> None:
        """As a reducer: ``sender``'s slice of ``p`` broke the rules beyond doubt (malformed, not finite,
        not what it signed): it is left out, and convicted (:meth:`convicted`)."""
        self.sender_failed(p, sender)
        if sender != self.me:
            self.bad_senders.setdefault(sender, f"its slice of partition {p}: {reason}")

    def faulty(self, p: int) -> bool:
        return p in self.faults

    def outcome(self) -> Outcome:
        """After the gather: commit if every partition is held and none is at fault, else abort (and say
        which are missing)."""
        if self.faults:
            p, f = next(iter(self.faults.items()))
            return Outcome(
                False,
                f"the result of partition {p} from {self.name(f.server)} broke the rules: {f.reason}",
                sorted(self.faults),
            )
        missing = [p for p in self.partitions if p not in self.held]
        if missing:
            return Outcome(
                False,
                f"partitions {missing} could not be fetched before the deadline; every member that"
                " lacks them aborts, and none can have committed without them",
                missing,
            )
        return Outcome(True, "every partition is here")

    def convicted(self) -> dict[PeerID, str]:
        """The members whose bytes broke the rules beyond doubt, as results they served (the round then
        aborts) or slices they sent (they are left out): banned at once."""
        tag = self.digest.hex()[:8]
        out = {
            self.peers[s]: f"contributor in round {tag}: sent bytes that broke the rules: {why}"
            for s, why in self.bad_senders.items()
        }
        for p, f in self.faults.items():
            if f.proven:
                role = "reducer" if f.server == f.holder else "relay"
                why = f"{role} of partition {p} in round {tag}: what it served broke the rules: {f.reason}"
                out[self.peers[f.server]] = why
        return out

    def blame(self) -> dict[PeerID, str]:
        """After an abort: the members this round failed on, as far as this member can tell (the
        coordinator if no decision came, else the holders of the partitions it never got), but those
        :meth:`convicted` names."""
        convicted = self.convicted()
        return {peer: why for peer, why in self._blame().items() if peer not in convicted}

    def _blame(self) -> dict[PeerID, str]:
        if self.decision is None:
            return {} if self.me == 0 else {self.peers[0]: "its decision never came"}
        if self.decision.abort:
            return {}
        out = {}
        for p in self.partitions:
            if p not in self.held:
                holder = self.holder(p)
                f = self.faults.get(p)
                if holder == self.me:  # (its own result: ``spoilt`` blames nobody)
                    continue
                if f is not None and not f.proven:
                    why = f"its result of partition {p}, relayed, broke the rules: {f.reason}"
                    out[self.peers[holder]] = why
                elif holder != self.me and (f is None or f.server != holder):
                    out[self.peers[holder]] = f"partition {p} never came from it"
        return out
