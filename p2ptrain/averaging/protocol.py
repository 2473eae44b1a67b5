"""Averaging wire messages: the signed group manifest, the signed decision, and the round's calls.

Theory of operation: a round is named by the digest of its signed manifest, so two manifests that differ
in anything (members, partitions, schema, compression) are two different rounds and a message for one
is never applied to the other. The manifest and the decision are signed by the leader, who is also the
round's coordinator, because members relay them to each other. Every call below is member -> reducer or
member -> coordinator: a client-only member only ever dials out.

Calls of a round:
- ``avg.join`` (unary, long-poll): a follower asks a leader for a place; the reply body is the signed
  manifest, or the reply says why not (and may redirect to the leader the callee follows).
- ``avg.part`` (stream): a member streams its slice of one partition to that partition's reducer.
- ``avg.report`` (unary, long-poll): a reducer reports whom it received complete slices from (others
  report nothing); the reply body is the coordinator's signed decision once made.
- ``avg.fetch`` (stream): a member fetches a reduced partition, as the round's compression encodes it.
- ``avg.relay_decision`` / ``avg.relay_result``: a member that lost its coordinator or a reducer asks the
  others for the decision or a partition they already hold (a result travels relayed as raw float32, so
  every member decodes the same bits).
- ``avg.audit_slice`` (stream), in audited rounds only: after the round, a partition's auditor fetches a
  contributor's slice as it was sent, to recompute the reducer's result (see ``audit``).

Calls about a published ban (any peer, not only members): ``avg.proof_head`` (unary) and ``avg.proof``
(stream) fetch from an accuser the proof that convicts a reducer, for the caller to re-check.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ..errors import RemoteProtocolError
from ..identity import MAX_ENVELOPE_PAYLOAD, PEER_ID_BYTES, Identity, PeerID, SignedEnvelope
from ..net.rpc import Method
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded
from . import sparse
from .compression import Compression, parse_compression
from .robust import Aggregation, parse_aggregation

# Members a group may hold: enough for one group to hold a majority of a step's peers up to 2x this
# (a step's majority that fits no group lets two groups of it both commit: see the docs' swarms at scale)
MAX_GROUP = 256
MAX_TENSORS = 4096
MAX_COUNTS = 256  # peers a joiner may name in its quorum (the group holds at most MAX_GROUP of them)
MAX_ELEMENTS = 1 << 36
MAX_ROUND_TIMEOUT = 24 * 3600.0
ROUND_ID_BYTES = 16
MANIFEST_DOMAIN = "p2ptrain/averaging-manifest"
MANIFEST_DIGEST_BYTES = 16  # a signed manifest's digest: the round's name
DECISION_DOMAIN = "p2ptrain/averaging-decision"
MAX_COMMIT_ENVELOPE = 384
MAX_ATTESTATION = MAX_GROUP * MAX_COMMIT_ENVELOPE + 1024
TAG_BYTES = 16  # a signed scale table's tag (``bounds.table_tag``)
# a contributor's signed scales of its slices (``bounds.ScaleTable``: 16 bytes a partition)
MAX_TABLE_ENVELOPE = 16 * MAX_GROUP + 256
DTYPES = ("float32", "float16", "bfloat16", "float64")


def mask_bytes(mask: int) -> bytes:
    """A manifest's bitmask of counted members as it travels (``Manifest.counts``): little-endian, no
    more bytes than its highest bit needs."""
    return mask.to_bytes((mask.bit_length() + 7) // 8, "little")


@dataclass(frozen=True)
class RoundSettings:
    """What every member of a round encodes and computes with, parsed once from text (a run file, the
    command line, a manifest's header): the compression, the aggregation rule and the audit flag.

    Building one checks the one rule that ties them (:func:`sparse_problem`): ValueError says why not.
    """

    mode: Compression
    aggregation: Aggregation
    audit: bool

    @classmethod
    def parse(
        cls, compression: str, aggregation: str, audit: bool, *, canonical: bool = False
    ) -> RoundSettings:
        """``canonical``: the aggregation must already be written as its name (a manifest's is signed)."""
        rule = parse_aggregation(aggregation)
        if canonical and rule != aggregation:
            raise ValueError(f"aggregation {aggregation!r} is not in canonical form")
        return cls(parse_compression(compression), rule, bool(audit))

    def __post_init__(self) -> None:
        problem = sparse_problem(self.mode, self.aggregation, self.audit)
        if problem:
            raise ValueError(problem)


@dataclass(frozen=True)
class TensorSpec(Message):
    shape: tuple[int, ...] = bounded(max_len=16)
    dtype: str = bounded(max_len=16)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MemberMsg(Message):
    peer: bytes = bounded(max_len=PEER_ID_BYTES)
    addr: str = bounded("", max_len=300)  # "" for a client-only member: it reduces nothing
    bandwidth: float = bounded(1.0, ge=0.0, le=1e15)


@dataclass(frozen=True)
class Manifest(Message):
    """One round's group, signed by its leader (``members[0]``, the coordinator)."""

    round_id: bytes = bounded(max_len=ROUND_ID_BYTES)
    group_key: str = bounded(max_len=256)
    members: tuple[MemberMsg, ...] = bounded(max_len=MAX_GROUP)
    sizes: tuple[int, ...] = bounded(max_len=MAX_GROUP)
    schema: tuple[TensorSpec, ...] = bounded(max_len=MAX_TENSORS)
    compression: str = bounded("none", max_len=16)
    timeout: float = bounded(60.0, ge=0.001, le=MAX_ROUND_TIMEOUT)
    aggregation: str = bounded("mean", max_len=32)  # the rule every reducer applies (see ``robust``)
    audit: bool = False  # members commit to their slices, reducers attest their results (see ``audit``)
    # Robust rules: members[i] shares an origin (a subnet) with members[origins[i]], the first member of
    # it; reducers count each origin once (see ``robust``). () : every member is an origin of its own.
    origins: tuple[int, ...] = bounded((), max_len=MAX_GROUP)
    # The round's quorum, fixed here at formation: member i needs ``needs[i]`` of the other members in
    # the bitmask ``counts[i]`` (bit j: member j; little-endian bytes, as a group may hold more members
    # than a msgpack integer has bits: ``masks``) among the decided contributors, and the round commits
    # only if every member's need is met (:meth:`short_of_quorum`). Each member checked, before it took
    # part, that its entry holds it to its own quorum (``matchmaking.holds_me``); every member checks the
    # decision against all entries: so all members of a committed round make the same apply/discard
    # decision, from signed facts alone. () : no quorum (averaging outside a training run).
    needs: tuple[int, ...] = bounded((), max_len=MAX_GROUP)
    counts: tuple[bytes, ...] = bounded((), max_len=MAX_GROUP)
    # Members the leader signs out of the round (sorted indices, never the leader): the members taking
    # part cannot meet their quorums (``matchmaking.Gathering.entries``), so they decline it on receipt.
    # Signed out, such a member holds no partition, no entry (need 0 of none), counts in no other entry,
    # and no member waits for its slices nor serves it a result: its decline costs the round nothing.
    # (Signed in as a reducer, each of its declines lost its partition's slices of every member.)
    out: tuple[int, ...] = bounded((), max_len=MAX_GROUP)

    @property
    def total(self) -> int:
        return sum(s.numel for s in self.schema)

    @functools.cached_property
    def masks(self) -> tuple[int, ...]:
        """Each member's counted members as a bitmask (bit j: member j), from ``counts``."""
        return tuple(int.from_bytes(c, "little") for c in self.counts)

    def peers(self) -> list[PeerID]:
        return [PeerID(m.peer) for m in self.members]

    def reduces(self) -> list[bool]:
        """Which members may hold a partition (:func:`reducers`)."""
        return reducers([m.addr for m in self.members], self.out)

    def signs_out(self, peer: PeerID) -> bool:
        """Whether the leader signed ``peer`` out of the round (``out``)."""
        return any(self.members[i].peer == peer.digest for i in self.out)

    def short_of_quorum(self, contributors: tuple[int, ...], binding: Iterable[int] | None = None) -> str:
        """Why a decision with these ``contributors`` (member indices) must not be applied ('' if it may):
        they hold fewer of the members some member counts than it needs (of the members ``binding``,
        every member if None). The same answer on every member, as it reads only what the leader signed
        here and in the decision."""
        held = sum(1 << i for i in contributors)
        only = None if binding is None else set(binding)
        for i, (need, mask) in enumerate(zip(self.needs, self.masks, strict=True)):
            if only is not None and i not in only:
                continue
            have = (mask & held).bit_count()
            if have < need:
                return (
                    f"its contributors hold {have} of the {need} other peers member {i} must average with"
                    f" (of {mask.bit_count()} it counts): committed, it could split the swarm"
                )
        return ""

    @functools.cached_property
    def settings(self) -> RoundSettings:
        """The header's text parsed, once (:meth:`check` does it when a manifest arrives); ValueError if
        it is not valid. The text fields stay as they are: they are what the leader signed."""
        return RoundSettings.parse(self.compression, self.aggregation, self.audit, canonical=True)

    def check(self) -> None:
        """Internal consistency; RemoteProtocolError says what is wrong."""
        n = len(self.members)
        if n < 1 or len(self.sizes) != n:
            raise RemoteProtocolError("a manifest needs members and one partition size per member")
        if len(self.round_id) != ROUND_ID_BYTES:
            raise RemoteProtocolError("bad round id")
        if len({m.peer for m in self.members}) != n:
            raise RemoteProtocolError("a member appears twice in the manifest")
        for m in self.members:
            if len(m.peer) != PEER_ID_BYTES:
                raise RemoteProtocolError("bad member peer id")
        for spec in self.schema:
            if spec.dtype not in DTYPES or any(d < 0 for d in spec.shape):
                raise RemoteProtocolError(f"bad tensor spec {spec.shape} {spec.dtype}")
        if self.total > MAX_ELEMENTS:
            raise RemoteProtocolError("the round's tensors are too large")
        if any(s < 0 for s in self.sizes) or sum(self.sizes) != self.total:
            raise RemoteProtocolError("partition sizes do not add up to the tensors' size")
        if any(s > 0 and not m.addr for s, m in zip(self.sizes, self.members, strict=True)):
            raise RemoteProtocolError("a client-only member cannot hold a partition")
        if self.origins and (
            len(self.origins) != n
            or any(not (isinstance(o, int) and 0 <= o <= i) for i, o in enumerate(self.origins))
            or any(self.origins[o] != o for o in self.origins)
        ):
            raise RemoteProtocolError("the origins must name, for each member, the first member sharing it")
        if self.needs or self.counts:
            if len(self.needs) != n or len(self.counts) != n:
                raise RemoteProtocolError("a manifest's quorum needs one need and one count per member")
            if any(len(c) > (n + 7) // 8 for c in self.counts):
                raise RemoteProtocolError("a member's quorum counts members outside the group, or itself")
            for i, (need, mask) in enumerate(zip(self.needs, self.masks, strict=True)):
                if not (0 <= mask < 1 << n) or mask >> i & 1:
                    raise RemoteProtocolError("a member's quorum counts members outside the group, or itself")
                if not 0 <= need <= mask.bit_count():
                    raise RemoteProtocolError("a member's quorum needs more members than it counts")
        if self.out:
            if not self.needs:
                raise RemoteProtocolError("only a manifest that holds members to quorums signs members out")
            if list(self.out) != sorted(set(self.out)) or not all(0 < i < n for i in self.out):
                raise RemoteProtocolError("the members signed out must be sorted, distinct, not the leader")
            held = sum(1 << i for i in self.out)
            if any(self.needs[i] or self.masks[i] or self.sizes[i] for i in self.out):
                raise RemoteProtocolError("a member signed out holds no quorum entry, no partition")
            if any(mask & held for mask in self.masks):
                raise RemoteProtocolError("a member's quorum counts a member signed out of the round")
        try:
            settings = self.settings  # (also checks that the compression goes with the rule and the audit)
        except ValueError as e:
            raise RemoteProtocolError(str(e)) from None
        starts = zip(_starts(self.sizes), self.sizes, strict=True)
        if settings.mode.sparse and any(o % sparse.BLOCK for o, s in starts if s):
            raise RemoteProtocolError("a top-k round's partitions must start on whole blocks")


def reducers(addrs: Sequence[str], out: Collection[int]) -> list[bool]:
    """Which members of a group may hold a partition: the dialable ones (an address) that take part
    (not signed out). The leader sizes the partitions by it and every member checks them by it
    (``rules.check_manifest``): one rule, or honest manifests are refused."""
    signed_out = set(out)
    return [bool(a) and i not in signed_out for i, a in enumerate(addrs)]


@dataclass(frozen=True)
class SignedManifest:
    manifest: Manifest
    envelope: bytes  # the signed bytes as they travel (a relay forwards these)
    digest: bytes  # names the round in every later message

    @classmethod
    def sign(cls, identity: Identity, manifest: Manifest) -> SignedManifest:
        env = SignedEnvelope.seal(identity, MANIFEST_DOMAIN, pack(manifest.to_obj())).to_bytes()
        return cls(manifest, env, manifest_digest(env))

    @classmethod
    def verify(cls, data: bytes, leader: PeerID | None = None) -> SignedManifest:
        """Check the signature (by ``members[0]``, and by ``leader`` if given) and the contents."""
        env = SignedEnvelope.from_bytes(bytes(data))
        payload = env.open(MANIFEST_DOMAIN, leader)
        manifest = Manifest.from_obj(unpack(payload, max_bytes=MAX_ENVELOPE_PAYLOAD))
        manifest.check()
        if PeerID(manifest.members[0].peer) != env.signer:
            raise RemoteProtocolError("a manifest must be signed by its first member, the leader")
        return cls(manifest, bytes(data), manifest_digest(bytes(data)))


def manifest_digest(data: bytes) -> bytes:
    """A signed manifest's digest, from its envelope's bytes: the name of its round."""
    return hashlib.blake2b(data, digest_size=MANIFEST_DIGEST_BYTES).digest()


@dataclass(frozen=True)
class Decision(Message):
    """The coordinator's verdict: the contributors, the replacement reducers, or an abort."""

    round: bytes = bounded(max_len=16)
    contributors: tuple[int, ...] = bounded((), max_len=MAX_GROUP)
    weights: tuple[float, ...] = bounded((), max_len=MAX_GROUP)  # each contributor's weight
    failed: tuple[int, ...] = bounded((), max_len=MAX_GROUP)  # reducers that did not report
    replacements: tuple[int, ...] = bounded((), max_len=MAX_GROUP)  # who re-reduces each failed one
    abort: str = bounded("", max_len=512)  # non-empty: the round is aborted, and why

    def check(self, n: int) -> None:
        if self.abort:
            return
        if len(self.weights) != len(self.contributors) or len(self.failed) != len(self.replacements):
            raise RemoteProtocolError("malformed decision")
        if not self.contributors or list(self.contributors) != sorted(set(self.contributors)):
            raise RemoteProtocolError("a decision's contributors must be sorted and distinct")
        if any(not 0 <= i < n for i in (*self.contributors, *self.failed, *self.replacements)):
            raise RemoteProtocolError("a decision names a member outside the group")
        if any(not (math.isfinite(w) and w > 0) for w in self.weights):
            raise RemoteProtocolError("a decision's weights must be positive and finite")
        if set(self.failed) & set(self.replacements):
            raise RemoteProtocolError("a failed reducer cannot be a replacement")

    def replacement_of(self, partition: int) -> int | None:
        for f, r in zip(self.failed, self.replacements, strict=True):
            if f == partition:
                return r
        return None


def seal_decision(identity: Identity, decision: Decision) -> bytes:
    return SignedEnvelope.seal(identity, DECISION_DOMAIN, pack(decision.to_obj())).to_bytes()


def open_decision(data: bytes, coordinator: PeerID, digest: bytes, n: int) -> Decision:
    env = SignedEnvelope.from_bytes(bytes(data))
    decision = Decision.from_obj(unpack(env.open(DECISION_DOMAIN, coordinator)))
    if decision.round != digest:
        raise RemoteProtocolError("the decision is for another round")
    decision.check(n)
    return decision


# ---- calls ----


@dataclass(frozen=True)
class JoinReq(Message, positional=True):
    group_key: str = bounded(max_len=256)
    schema_digest: bytes = bounded(max_len=32)
    addr: str = bounded("", max_len=300)  # "" when client-only
    bandwidth: float = bounded(1.0, ge=0.0, le=1e15)
    # The joiner's quorum (see ``matchmaking``): how many of the peers it counts (itself included) it
    # needs among a round's contributors; the leader signs it into the manifest (``needs``, ``counts``).
    need: int = bounded(0, ge=0, le=MAX_COUNTS)
    counts: tuple[bytes, ...] = bounded((), max_len=MAX_COUNTS)  # the peers it counts toward it (ids)


@dataclass(frozen=True)
class RecallReq(Message, positional=True):
    group_key: str = bounded(max_len=256)
    # A fellow member's relay (see ``grouping``, "Manifests relayed"): the digest of the manifest asked
    # for, which the callee may hold as a member rather than have formed. b"": the callee's own group.
    digest: bytes = bounded(b"", max_len=MANIFEST_DIGEST_BYTES)


@dataclass(frozen=True)
class JoinResp(Message, positional=True):
    accepted: bool = False
    reason: str = bounded("", max_len=512)
    redirect: str = bounded("", max_len=300)  # the address of the leader the callee follows
    retry: bool = False  # the refusal is transient (the callee is between states): ask again soon
    # Accepted with no body: the manifest (this digest) is to be fetched from the member at ``relay``
    # (``RECALL`` with the digest), and from the leader if that fails (see ``grouping``)
    relay: str = bounded("", max_len=300)
    digest: bytes = bounded(b"", max_len=MANIFEST_DIGEST_BYTES)


@dataclass(frozen=True)
class PartReq(Message, positional=True):
    round: bytes = bounded(max_len=16)
    partition: int = bounded(ge=0, le=MAX_GROUP)
    weight: float = bounded(ge=0.0, le=1e30)
    commit: bytes = bounded(b"", max_len=MAX_COMMIT_ENVELOPE)  # audited rounds: the signed commitment
    scale: bytes = bounded(b"", max_len=MAX_TABLE_ENVELOPE)  # the sender's signed scales (``bounds``)


@dataclass(frozen=True)
class Ack(Message, positional=True):
    ok: bool = True
    reason: str = bounded("", max_len=512)
    attestation: bytes = bounded(b"", max_len=MAX_ATTESTATION)  # audited fetches: the reducer's signature
    # fetches and relays of a result: the tag of each decided contributor's signed scales, in the
    # decision's order (the tables the fetching member lacks rode in the body, after the result)
    scales: tuple[bytes, ...] = bounded((), max_len=MAX_GROUP)


@dataclass(frozen=True)
class ReportReq(Message, positional=True):
    round: bytes = bounded(max_len=16)
    delivered: tuple[int, ...] | None = bounded(None, max_len=MAX_GROUP)  # None: not a reducer
    weights: tuple[float, ...] = bounded((), max_len=MAX_GROUP)
    unreachable: tuple[int, ...] = bounded((), max_len=MAX_GROUP)  # reducers this member failed to reach


@dataclass(frozen=True)
class DecisionResp(Message, positional=True):
    known: bool = False  # the signed decision rides in the reply body


@dataclass(frozen=True)
class FetchReq(Message, positional=True):
    round: bytes = bounded(max_len=16)
    partition: int = bounded(ge=0, le=MAX_GROUP)
    # fetches and relays of a result: the tag of the signed scales the caller holds of each member
    # (``TAG_BYTES`` each, in the manifest's order; zeros for none): the server sends only the others
    have: bytes = bounded(b"", max_len=TAG_BYTES * MAX_GROUP)


@dataclass(frozen=True)
class RelayDecisionReq(Message, positional=True):
    round: bytes = bounded(max_len=16)


@dataclass(frozen=True)
class LeaveReq(Message, positional=True):
    round: bytes = bounded(max_len=16)


@dataclass(frozen=True)
class ProofHead(Message, positional=True):
    """What a proof holds besides the slices (``avg.proof`` streams those, back to back); an empty
    ``manifest`` when the callee keeps no proof of that round and partition."""

    manifest: bytes = bounded(b"", max_len=MAX_ENVELOPE_PAYLOAD + 4096)  # the round's signed manifest
    holder: int = bounded(0, ge=0, le=MAX_GROUP)  # the member that reduced the partition
    attestation: bytes = bounded(b"", max_len=MAX_ATTESTATION)  # its signed attestation
    lengths: tuple[int, ...] = bounded((), max_len=MAX_GROUP)  # each contributor's slice, in bytes


LEFT_ROUND = "left_round"
"""The error code of a call to a member that left the round before it started (see Averager.decline)."""

NOT_HELD = "not_held"
"""The error code of a member asked to relay a partition's result that it does not hold and cannot get
from the partition's holder either (it could not connect to it): the asker asks the others, and gives
the partition up once none is left (see ``gathering``)."""

ROUND_OVER = "round_over"
"""The error code of a call for a round that is over at the callee: it retired the round (every member
had fetched what it reduced, or the round's time ran out) and serves nothing of it again. A member that
still lacks a partition asks others for it, or gives it up at once (see ``gathering``)."""

JOIN = Method("avg.join", JoinReq, JoinResp)
RECALL = Method("avg.recall", RecallReq, JoinResp)
"""A follower whose join call ended without an answer (failed on the way, slower than its wait, or its
caller gave up) asks its leader for the manifest of a group the leader formed with it under the key, if
any: it never admits anybody. The follower runs the round, or declines it, so that the others do not
wait for its slices until the scatter deadline (see ``grouping``). With a digest, a member asks a fellow
member the leader named as its relay for the manifest of that digest (a large group's leader sends it
to a few members only: ``grouping``, "Manifests relayed")."""
PART = Method("avg.part", PartReq, Ack, streaming=True)
REPORT = Method("avg.report", ReportReq, DecisionResp)
FETCH = Method("avg.fetch", FetchReq, Ack, streaming=True)
FETCH_EARLY = Method("avg.fetch_early", FetchReq, Ack, streaming=True)
"""A partition's mean chunk by chunk as the scatter completes each chunk, before the decision; the answer
says whether those chunks are the round's result (see serving.RoundServer.on_fetch_early)."""
RELAY_DECISION = Method("avg.relay_decision", RelayDecisionReq, DecisionResp)
LEAVE = Method("avg.leave", LeaveReq, Ack)
"""A member that left a formed group before its round started (``Averager.decline``) tells the members
that reduce a partition, so that they stop waiting for its slices at once. It speaks for itself only:
the callee counts the caller (the connection's authenticated id) as gone, nobody else."""
RELAY_RESULT = Method("avg.relay_result", FetchReq, Ack, streaming=True)
TABLES = Method("avg.tables", FetchReq, Ack, streaming=True)
"""The signed scale tables of the decided contributors that the caller does not hold (``FetchReq.have``;
the partition is not read), one per body chunk; the answer names the tag of the table the callee holds
of each decided contributor, in the decision's order (b"" for none). A member that reduced nothing (a
client-only one) asks one member once, instead of having every result's server send it every table."""
AUDIT_SLICE = Method("avg.audit_slice", FetchReq, Ack, streaming=True)
PROOF_HEAD = Method("avg.proof_head", FetchReq, ProofHead)
PROOF = Method("avg.proof", FetchReq, Ack, streaming=True)
ACCUSE = Method("avg.accuse", FetchReq, Ack)
"""A member of an audited round tells the others it convicted the reducer of a partition: they fetch
its proof and re-check it (see Auditor.examine) before their next round, instead of at their next read
of the ban records."""


def _starts(sizes: tuple[int, ...]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def sparse_problem(mode: Compression, aggregation: str, audit: bool) -> str:
    """Why ``mode`` cannot go with the aggregation rule or the audit ('' if it can): a robust rule
    over top-k contributions would mostly see zeros, and the audit recomputes dense results."""
    if not mode.sparse:
        return ""
    if aggregation != "mean":
        return (
            f"compression {mode.value} needs aggregation 'mean' (robust rules would see mostly zeros),"
            f" not {aggregation!r}"
        )
    if audit:
        return (
            f"compression {mode.value} cannot be audited yet: turn the audit off or use a dense compression"
        )
    return ""
