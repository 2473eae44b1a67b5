"""The audit after an audited round, on trio: serve what this member committed to, audit the partitions
it was chosen for, and keep the list of banned peers (see ``audit`` for the theory of operation).

Evidence of a round is kept for ``AUDIT_WINDOW`` seconds (at most ``MAX_KEPT`` rounds), long enough for
every auditor to fetch what it needs. A verdict against a peer bans it here at once. A verdict against a
reducer also keeps its :class:`~p2ptrain.averaging.audit.Proof` (at most ``MAX_PROOFS``), served to
anyone who asks, and the run's ``RoundPolicy.on_ban`` lets it publish the accusation. A ban someone else
published is adopted only once its proof, fetched from the accuser, convicts (:meth:`Auditor.examine`);
a proof that does not convict bans the accuser. The accuser also tells the round's other members at once
(``avg.accuse``): they are the peers the convicted reducer meets next, and a member that only learns of
it from the ban records would put its slices into another round with it first. A member examines what it
is told only about a round it kept, a partition that round's holder reduced, from another member of it,
and fetches the proof from the address the accuser had in that round.

Verdicts need no repetition when there is proof (:meth:`Auditor.convict`): bytes a peer served or
signed that break the rules (a malformed or non-finite result, a result beyond this member's bounds, a
bad attestation) ban it at once. Faults without proof (a partition that never came, a decision that
never came: from here a withholding peer and a broken link look alike) are strikes
(:meth:`Auditor.strike`): each weighs 1, decays with a half-life of ``STRIKE_HALF_LIFE``, and a peer is
banned once its weight reaches ``STRIKES``. A good round with the peer forgives nothing, so a peer that
fails one round in a few and behaves in between is banned all the same: one that fails more often than
about once in ``0.58 * STRIKE_HALF_LIFE`` (six minutes) reaches ``STRIKES`` at last. An honest peer on a
bad link pays the same: three failed rounds with it in a few minutes and this member stops grouping
with it (locally: strikes are never published).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..net.host import Host
from ..net.rpc import CallContext
from ..net.streams import RpcStream
from .allreduce import RoundEvidence
from .audit import Proof, Verdict, auditor_of, check_proof, judge, open_attestation
from .protocol import ACCUSE, AUDIT_SLICE, PROOF, PROOF_HEAD, Ack, FetchReq, ProofHead, SignedManifest
from .settings import RoundPolicy

log = logging.getLogger(__name__)

STRIKES = 3.0  # weight of (decaying) strikes at which a peer is banned here
STRIKE_HALF_LIFE = 600.0  # seconds for a strike's weight to halve
MAX_STRIKES = 4096  # peers with strikes remembered at most (the lightest are forgotten first)
AUDIT_WINDOW = 120.0  # seconds a round's evidence is kept for its auditors
MAX_KEPT = 4  # rounds of evidence kept at most (each is about one copy of this member's contribution)
FETCH_TIMEOUT = 30.0
NOT_KEPT = "nothing kept for this round"
ASK_AGAIN = 0.25  # seconds: a member that has not kept the round yet may still be finishing it
MAX_BANS = 1024
MAX_PROOFS = 2  # proofs kept to serve (each about one fp32 copy of the model: a partition's slices)
MAX_EXAMINED = 4096  # accusations examined once (whatever the outcome), not again
PROOF_TIMEOUT = 60.0
TELL_TIMEOUT = 10.0  # seconds to tell a member of a round about its convicted reducer
MAX_TOLD = 4  # accusations we were told of waiting for their examination at most (one runs at a time)


@dataclass(frozen=True)
class Accusation:
    """A published ban: ``accused`` reduced ``partition`` of ``round`` wrongly, says its accuser."""

    accused: PeerID
    reason: str
    round: bytes
    partition: int


class Auditor:
    """One per averager: evidence, audits, bans."""

    def __init__(
        self,
        host: Host,
        *,
        policy: Callable[[], RoundPolicy] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        """``policy``: the run's rules for bans and proofs, as they stand (the averager's, see
        :meth:`Averager.follow`; None: none). ``clock``: seconds, for the strikes' decay."""
        self.host = host
        self._clock = clock
        self._policy = policy or RoundPolicy  # (the class itself: a policy with none of the rules)
        self.banned: dict[PeerID, str] = {}  # peer -> why
        self.accusations: dict[PeerID, Accusation] = {}  # our provable verdicts, to publish
        self.proofs: OrderedDict[tuple[bytes, int], Proof] = OrderedDict()  # (round, partition) -> proof
        self.examined: set[tuple[PeerID, PeerID, bytes, int]] = set()  # (accuser, accused, round, p)
        self.strikes: dict[PeerID, tuple[float, float]] = {}  # peer -> (strike weight, as of when)
        self.verdicts: list[tuple[bytes, int, Verdict]] = []  # (round, partition, verdict) we reached
        self._kept: OrderedDict[bytes, RoundEvidence] = OrderedDict()
        self._nursery: trio.Nursery | None = None  # examinations we are told of run here (see ``run``)
        self._told = 0  # examinations of what members told us, queued or running
        self._examining = trio.Lock()
        host.registry.add_unary(ACCUSE, self._on_accuse)
        host.registry.add_stream(AUDIT_SLICE, self._on_audit_slice)
        host.registry.add_unary(PROOF_HEAD, self._on_proof_head)
        host.registry.add_stream(PROOF, self._on_proof)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the examinations of accusations members tell us of, until cancelled (the averager
        starts this in its nursery)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # ---- bans ----

    def ban(self, peer: PeerID, reason: str, *, accusation: Accusation | None = None) -> None:
        """Ban ``peer``. ``accusation``: our own provable verdict (its proof kept), published through
        the policy's ``on_ban``; bans from anything else (strikes, a contributor's disowned slice, an
        examined proof) stay local: nobody else could check them, or the accuser serves the proof."""
        if peer in self.banned or peer == self.host.peer_id or len(self.banned) >= MAX_BANS:
            return
        self.banned[peer] = reason
        log.error("banned %s: %s", peer.short(), reason)
        if accusation is not None:
            self.accusations[peer] = accusation
            on_ban = self._policy().on_ban
            if on_ban is not None:
                on_ban(peer, reason)

    def convict(self, peer: PeerID, reason: str) -> None:
        """``peer`` served or signed bytes that break the rules (``reason``): proof enough, banned at
        once, here (what it served to us, others cannot re-check: it stays local)."""
        self.ban(peer, reason)

    def strike(self, peer: PeerID, reason: str) -> None:
        """A round failed on ``peer`` without proof (its partition never came, it never decided). Once
        is bad luck or a bad link; strikes weigh 1 each and decay (see the module docstring), and at
        ``STRIKES`` we stop grouping with it (not published: from here a withholding peer and a broken
        link look alike). A good round forgives nothing."""
        if peer == self.host.peer_id or peer in self.banned:
            return
        now = self._clock()
        weight = self.strike_weight(peer, now) + 1.0
        self.strikes[peer] = (weight, now)
        if weight >= STRIKES:
            self.strikes.pop(peer, None)
            self.ban(peer, f"rounds kept failing on it ({weight:.2f} strikes, the last: {reason})")
            return
        if len(self.strikes) > MAX_STRIKES:
            lightest = min(self.strikes, key=lambda q: self.strike_weight(q, now))
            del self.strikes[lightest]

    def strike_weight(self, peer: PeerID, now: float | None = None) -> float:
        """The weight of ``peer``'s strikes now (each 1 when struck, halving every ``STRIKE_HALF_LIFE``)."""
        weight, since = self.strikes.get(peer, (0.0, 0.0))
        if not weight:
            return 0.0
        now = self._clock() if now is None else now
        return float(weight * 0.5 ** (max(0.0, now - since) / STRIKE_HALF_LIFE))

    async def examine(self, accuser: PeerID, address: str, accusation: Accusation) -> str:
        """Fetch the proof of someone's published ban from the accuser (at ``address``) and re-check it:
        ban the accused if it convicts, the accuser if it does not; nothing if the accuser cannot be
        asked or keeps no proof any more (an honest accuser may have left). Examined once. Returns what
        came of it, in words."""
        key = (accuser, accusation.accused, accusation.round, accusation.partition)
        me = self.host.peer_id
        if key in self.examined or accusation.accused in self.banned or accuser in self.banned:
            return "already settled"
        if me in (accuser, accusation.accused):
            return "not ours to judge"
        if len(self.examined) >= MAX_EXAMINED:
            return "too many accusations examined"
        self.examined.add(key)
        try:
            with trio.fail_after(PROOF_TIMEOUT):
                proof = await self._fetch_proof(accuser, address, accusation)
        except (P2PError, trio.TooSlowError, ValueError) as e:
            return f"no proof from {accuser.short()}: {e}"
        if proof is None:
            return f"{accuser.short()} keeps no proof of it"
        try:
            verdict = check_proof(proof, accusation.accused, accusation.round)
        except RemoteProtocolError as e:
            verdict = Verdict(False, None, str(e))
        if verdict.offender == proof.holder:
            self.ban(
                accusation.accused,
                f"proven by {accuser.short()}: reducer of partition {accusation.partition} in round "
                f"{accusation.round.hex()[:8]}: {verdict.reason}",
            )
            return "convicted"
        self.ban(
            accuser, f"false accusation of {accusation.accused.short()}: its proof shows {verdict.reason}"
        )
        return "false accusation"

    async def _fetch_proof(self, accuser: PeerID, address: str, accusation: Accusation) -> Proof | None:
        conn = await self.host.connect(address)
        if conn.peer != accuser:
            raise RemoteProtocolError(f"{address} is not the accuser")
        req = FetchReq(accusation.round, accusation.partition)
        head = await conn.call(PROOF_HEAD, req)
        if not head.manifest:
            return None
        # Bounds before any slice arrives: no slice of the round's partition is larger than raw float32.
        signed = SignedManifest.verify(head.manifest)
        sizes = signed.manifest.sizes
        if signed.digest != accusation.round or not 0 <= accusation.partition < len(sizes):
            raise RemoteProtocolError("the proof's manifest is of another round")
        limit = 4 * sizes[accusation.partition] + 1024
        if any(not 0 <= n <= limit for n in head.lengths):
            raise RemoteProtocolError("a slice in the proof is larger than its partition")
        most = self._policy().max_proof_bytes
        if most is not None and sum(head.lengths) > most:
            # larger than any proof about this run's model: not fetched, and nobody banned for it
            raise RemoteProtocolError(f"a proof of {sum(head.lengths)} bytes, over {most}")
        async with conn.open_stream(PROOF, req) as stream:
            data = await stream.receive_all(sum(head.lengths))
            ack = await stream.response()
        if not ack.ok or len(data) != sum(head.lengths):
            return None
        slices, offset, view = [], 0, memoryview(data)  # views: a proof can be a model's size
        for n in head.lengths:
            slices.append(view[offset : offset + n])
            offset += n
        return Proof(head.manifest, head.holder, accusation.partition, head.attestation, tuple(slices))

    async def _on_proof_head(self, ctx: CallContext, req: FetchReq) -> ProofHead:
        proof = self.proofs.get((req.round, req.partition))
        if proof is None:
            return ProofHead()
        return ProofHead(proof.manifest, proof.holder, proof.attestation, tuple(len(x) for x in proof.slices))

    async def _on_proof(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        proof = self.proofs.get((req.round, req.partition))
        if proof is None:
            return Ack(False, "no proof kept")
        for piece in proof.slices:
            await stream.send(piece)
        await stream.send_eof()
        return Ack(True)

    # ---- evidence ----

    def keep(self, evidence: RoundEvidence) -> None:
        self._kept[evidence.digest] = evidence
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)

    def forget(self, digest: bytes) -> None:
        self._kept.pop(digest, None)

    async def _on_audit_slice(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        ev = self._kept.get(req.round)
        if ev is None:
            return Ack(False, NOT_KEPT)
        if ctx.peer not in ev.peers:
            raise RemoteProtocolError(f"{ctx.peer.short()} is not a member of this round")
        me = ev.peers.index(self.host.peer_id)
        p = req.partition
        data = ev.local.get(p) if ev.holders.get(p) == me else ev.sent.get(p)
        if data is None:
            return Ack(False, f"this member committed to no slice of partition {p}")
        await stream.send(data)
        await stream.send_eof()
        return Ack(True)

    # ---- audits ----

    async def audit(self, evidence: RoundEvidence) -> list[Verdict]:
        """Audit every partition of the round this member was chosen for; ban the offenders."""
        me = evidence.peers.index(self.host.peer_id)
        verdicts = []
        for p, data in sorted(evidence.attestations.items()):
            holder = evidence.holders[p]
            try:
                att = open_attestation(data, evidence.peers[holder], evidence.digest, p, len(evidence.peers))
            except P2PError:
                continue  # checked when it was fetched; cannot happen unless memory is corrupt
            candidates = [evidence.peers[c] for c in att.contributors if c != holder]
            if auditor_of(evidence.digest, p, candidates) != self.host.peer_id:
                continue
            slices = [await self._slice_of(evidence, c, p, me) for c in att.contributors]
            authors = [evidence.peers[c] for c in att.contributors]
            verdict = judge(
                att,
                slices,
                authors,
                size=evidence.sizes[p],
                mode=evidence.mode,
                aggregation=evidence.aggregation,
                holder=holder,
                origins=evidence.origins,
            )
            self.verdicts.append((evidence.digest, p, verdict))
            verdicts.append(verdict)
            if verdict.offender is not None:
                offender = evidence.peers[verdict.offender]
                role = "reducer" if verdict.offender == holder else "contributor"
                reason = f"{role} of partition {p} in round {evidence.digest.hex()[:8]}: {verdict.reason}"
                accusation = None
                if verdict.offender == holder:  # provable: keep the proof, publish the accusation
                    given = tuple(x or b"" for x in slices)
                    self.proofs[(evidence.digest, p)] = Proof(evidence.manifest, holder, p, data, given)
                    while len(self.proofs) > MAX_PROOFS:
                        self.proofs.popitem(last=False)
                    accusation = Accusation(offender, reason, evidence.digest, p)
                self.ban(offender, reason, accusation=accusation)
                if accusation is not None:
                    await self._tell_members(evidence, offender, p)
            else:
                log.info(
                    "audit of partition %d in round %s: %s", p, evidence.digest.hex()[:8], verdict.reason
                )
        return verdicts

    async def _tell_members(self, ev: RoundEvidence, offender: PeerID, p: int) -> None:
        """Tell the round's other members (but the offender, and client-only ones: nobody dials those)
        that we convicted the reducer of partition ``p``; each re-checks our proof itself."""
        async with trio.open_nursery() as nursery:
            for peer, address in zip(ev.peers, ev.addresses, strict=True):
                if address and peer not in (self.host.peer_id, offender):
                    nursery.start_soon(self._tell, peer, address, FetchReq(ev.digest, p))

    async def _tell(self, peer: PeerID, address: str, req: FetchReq) -> None:
        try:
            with trio.fail_after(TELL_TIMEOUT):
                conn = await self.host.connect(address)
                ack = await conn.call(ACCUSE, req)
            if not ack.ok:
                log.info("told %s of the reducer we convicted: %s", peer.short(), ack.reason)
        except (P2PError, trio.TooSlowError) as e:
            log.info("could not tell %s of the reducer we convicted: %s", peer.short(), e)

    async def _on_accuse(self, ctx: CallContext, req: FetchReq) -> Ack:
        """A member of a round we kept says it convicted the reducer of one of its partitions. What we
        kept names the accused and the accuser's address: the request names only the round."""
        ev = self._kept.get(req.round)
        if ev is None:
            return Ack(False, NOT_KEPT)
        if ctx.peer not in ev.peers:
            raise RemoteProtocolError(f"{ctx.peer.short()} is not a member of this round")
        holder = ev.holders.get(req.partition)
        address = ev.addresses[ev.peers.index(ctx.peer)]
        if holder is None or not address:
            return Ack(False, "no reducer of this partition to accuse, or no address to fetch a proof")
        accused = ev.peers[holder]
        what = f"reducer of partition {req.partition} in round {req.round.hex()[:8]}"
        accusation = Accusation(accused, what, req.round, req.partition)
        if (ctx.peer, accused, req.round, req.partition) in self.examined or accused in self.banned:
            return Ack(True)
        if self._nursery is None or self._told >= MAX_TOLD:
            return Ack(False, "busy examining other accusations: it is in the ban records too")
        self._told += 1
        self._nursery.start_soon(self._examine_told, ctx.peer, address, accusation)
        return Ack(True)

    async def _examine_told(self, accuser: PeerID, address: str, accusation: Accusation) -> None:
        try:
            async with self._examining:  # one proof download at a time
                outcome = await self.examine(accuser, address, accusation)
            level = logging.WARNING if outcome in ("convicted", "false accusation") else logging.INFO
            log.log(
                level,
                "examined what %s told us of %s: %s",
                accuser.short(),
                accusation.accused.short(),
                outcome,
            )
        finally:
            self._told -= 1

    async def _slice_of(self, ev: RoundEvidence, c: int, p: int, me: int) -> bytes | None:
        if c == me:
            return ev.sent.get(p)
        try:
            with trio.fail_after(FETCH_TIMEOUT):
                conn = await self.host.connect(self._address(ev, c))
                while True:
                    async with conn.open_stream(AUDIT_SLICE, FetchReq(ev.digest, p)) as stream:
                        data = await stream.receive_all(_limit(ev, p))
                        ack = await stream.response()
                    if ack.ok or ack.reason != NOT_KEPT:
                        return data if ack.ok else None
                    await trio.sleep(ASK_AGAIN)  # it commits the round a moment after us
        except (P2PError, trio.TooSlowError) as e:
            log.info("audit: no slice of partition %d from %s: %s", p, ev.peers[c].short(), e)
            return None

    @staticmethod
    def _address(ev: RoundEvidence, c: int) -> str:
        if not ev.addresses[c]:
            raise RemoteProtocolError("a client-only member cannot be asked for its slice")
        return ev.addresses[c]


def _limit(ev: RoundEvidence, p: int) -> int:
    return 4 * ev.sizes[p] + 1024  # no encoding is larger than raw float32
