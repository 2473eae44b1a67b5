"""The audit after an audited round, on trio: serve what this member committed to, audit the partitions
it was chosen for, and keep the list of banned peers (see ``audit`` for the theory of operation).

Evidence of a round is kept for ``AUDIT_WINDOW`` seconds (at most ``MAX_KEPT`` rounds), long enough for
every auditor to fetch what it needs. A verdict against a peer bans it here at once; ``on_ban`` lets the
owner publish it. Bans others published count only once ``quorum`` distinct peers (not banned
themselves) accused the same peer (see :meth:`Auditor.weigh`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import trio

from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..net.host import Host
from ..net.rpc import CallContext
from ..net.streams import RpcStream
from .allreduce import RoundEvidence
from .audit import Verdict, auditor_of, judge, open_attestation
from .protocol import AUDIT_SLICE, Ack, FetchReq

log = logging.getLogger(__name__)

STRIKES = 3  # rounds in a row that failed on the same peer before it is banned here
AUDIT_WINDOW = 120.0  # seconds a round's evidence is kept for its auditors
MAX_KEPT = 4  # rounds of evidence kept at most (each is about one copy of this member's contribution)
FETCH_TIMEOUT = 30.0
NOT_KEPT = "nothing kept for this round"
ASK_AGAIN = 0.25  # seconds: a member that has not kept the round yet may still be finishing it
MAX_BANS = 1024


class Auditor:
    """One per averager: evidence, audits, bans."""

    def __init__(self, host: Host, *, quorum: int = 2) -> None:
        self.host = host
        self.quorum = quorum
        self.banned: dict[PeerID, str] = {}  # peer -> why (our own verdict, or the accusers')
        self.own: set[PeerID] = set()  # the bans that are our own verdicts
        self.strikes: dict[PeerID, int] = {}  # rounds in a row that failed on a peer
        self.verdicts: list[tuple[bytes, int, Verdict]] = []  # (round, partition, verdict) we reached
        self.on_ban: Callable[[PeerID, str], None] | None = None
        self._kept: OrderedDict[bytes, RoundEvidence] = OrderedDict()
        host.registry.add_stream(AUDIT_SLICE, self._on_audit_slice)

    # ---- bans ----

    def ban(self, peer: PeerID, reason: str, *, own: bool = True) -> None:
        """Ban ``peer``. ``own``: our own verdict (published through ``on_ban``); an adopted ban is not
        published again, or one accusation echoed by every peer would look like a crowd of them."""
        if peer in self.banned or peer == self.host.peer_id or len(self.banned) >= MAX_BANS:
            return
        self.banned[peer] = reason
        log.error("banned %s: %s", peer.short(), reason)
        if own:
            self.own.add(peer)
            if self.on_ban is not None:
                self.on_ban(peer, reason)

    def strike(self, peer: PeerID, reason: str) -> None:
        """A round failed on ``peer`` (its partition never came, it never decided). Once is bad luck or
        a bad link; ``STRIKES`` rounds in a row and we stop grouping with it (not published: from here a
        withholding peer and a broken link look alike)."""
        if peer == self.host.peer_id or peer in self.banned:
            return
        self.strikes[peer] = self.strikes.get(peer, 0) + 1
        if self.strikes[peer] >= STRIKES:
            self.ban(peer, f"{self.strikes[peer]} rounds in a row failed on it ({reason})", own=False)

    def cleared(self, peers: Sequence[PeerID]) -> None:
        """A round with ``peers`` committed: their strikes are forgiven."""
        for peer in peers:
            self.strikes.pop(peer, None)

    def weigh(self, accusations: Mapping[PeerID, Sequence[tuple[PeerID, str]]]) -> list[PeerID]:
        """Adopt the bans that ``quorum`` distinct peers published (an accuser we banned does not count;
        nobody can make us ban ourselves). ``accusations``: accuser -> [(accused, reason)]. Returns the
        peers newly banned."""
        accusers: dict[PeerID, set[PeerID]] = {}
        reasons: dict[PeerID, str] = {}
        for accuser, accused_list in accusations.items():
            if accuser in self.banned or accuser == self.host.peer_id:
                continue
            for accused, reason in accused_list:
                accusers.setdefault(accused, set()).add(accuser)
                reasons.setdefault(accused, reason)
        adopted = []
        for accused, who in accusers.items():
            if len(who) >= self.quorum and accused not in self.banned and accused != self.host.peer_id:
                names = ", ".join(sorted(p.short() for p in who))
                self.ban(accused, f"accused by {len(who)} peers ({names}): {reasons[accused]}", own=False)
                adopted.append(accused)
        return adopted

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
            )
            self.verdicts.append((evidence.digest, p, verdict))
            verdicts.append(verdict)
            if verdict.offender is not None:
                offender = evidence.peers[verdict.offender]
                role = "reducer" if verdict.offender == holder else "contributor"
                self.ban(
                    offender,
                    f"{role} of partition {p} in round {evidence.digest.hex()[:8]}: {verdict.reason}",
                )
            else:
                log.info(
                    "audit of partition %d in round %s: %s", p, evidence.digest.hex()[:8], verdict.reason
                )
        return verdicts

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
