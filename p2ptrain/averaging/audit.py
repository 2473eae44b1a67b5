"""Accountability for averaging rounds: commitments, attestations, recomputation and bans (pure parts).

Theory of operation, in rounds whose manifest says ``audit``:

1. A member sending its slice of partition ``p`` signs a *commitment*: the round, ``p``, its weight and
   the hash of the exact bytes it sends. The reducer checks the bytes against it as they arrive (a slice
   that does not match is refused: its sender is at fault) and keeps the signed commitments.
2. The reducer computes its partition in member order (canonical, so anyone can redo it bit for bit) and
   signs an *attestation*: the round, ``p``, the decided contributors and weights, their commitments, and
   the hash of the encoded result it serves. Every member that fetches the result checks the bytes
   against the attestation and its own commitment in it.
3. After the round, one *auditor* per partition (a member other than its reducer, chosen from the round
   digest so every member agrees who) asks each contributor for the slice it committed to, checks it
   against the signed commitment, recomputes the reducer's result and compares its hash with the
   attested one. A mismatch names the reducer (its signed attestation cannot be explained by the
   contributors' signed slices); a slice that does not match its own author's commitment names that
   author. Members keep what they sent for a short while so that an auditor can ask for it.
4. The verdict bans the offender locally (no more groups with it). A verdict against a reducer is
   provable to anyone: the signed manifest (its hash names the round: the members, the partition sizes,
   the compression and the aggregation), the reducer's signed attestation and the contributors' slices,
   each matching its author's signed commitment inside the attestation, are a :class:`Proof` that
   :func:`check_proof` re-checks without trusting whoever sent it. Only such verdicts are published
   (a ban record names the round and partition; the accuser serves the proof). Other peers fetch the
   proof and re-check it before they ban: a proof that convicts bans the reducer, one that does not
   bans the accuser (its own signed record makes a claim its own evidence refutes). The number of
   accusers counts for nothing. A verdict against a contributor (it gave the auditor other bytes than it
   committed to) rests on what the auditor received, which nobody else can check: it stays local.

The cost: hashing what is sent and received, one signature per slice, one retained copy of this peer's
contribution for the audit window, and per partition one auditor fetching every contributor's slice of
it (about ``1/n`` of the round's traffic again).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import RemoteProtocolError
from ..identity import Identity, PeerID, SignedEnvelope
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded
from .compression import Compression
from .protocol import MAX_COMMIT_ENVELOPE, MAX_GROUP, SignedManifest
from .reducer import PartitionReducer

COMMIT_DOMAIN = "p2ptrain/averaging-commit"
ATTESTATION_DOMAIN = "p2ptrain/averaging-attestation"
HASH_BYTES = 32


def new_hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=HASH_BYTES, person=b"p2ptrain-slice")


def hash_pieces(pieces: Iterable[bytes | memoryview]) -> bytes:
    h = new_hasher()
    for piece in pieces:
        h.update(piece)
    return h.digest()


@dataclass(frozen=True)
class Commit(Message):
    round: bytes = bounded(max_len=16)
    partition: int = bounded(ge=0, le=MAX_GROUP)
    weight: float = bounded(ge=0.0, le=1e30)
    hash: bytes = bounded(max_len=HASH_BYTES)


@dataclass(frozen=True)
class Attestation(Message):
    round: bytes = bounded(max_len=16)
    partition: int = bounded(ge=0, le=MAX_GROUP)
    contributors: tuple[int, ...] = bounded(max_len=MAX_GROUP)
    weights: tuple[float, ...] = bounded(max_len=MAX_GROUP)
    commits: tuple[bytes, ...] = bounded(max_len=MAX_GROUP)  # each contributor's signed commitment
    result: bytes = bounded(max_len=HASH_BYTES)  # hash of the encoded result the reducer serves


def seal_commit(identity: Identity, round_: bytes, partition: int, weight: float, digest: bytes) -> bytes:
    commit = Commit(round_, partition, weight, digest)
    return SignedEnvelope.seal(identity, COMMIT_DOMAIN, pack(commit.to_obj())).to_bytes()


def open_commit(data: bytes, author: PeerID, round_: bytes, partition: int) -> Commit:
    """A commitment signed by ``author`` for this round and partition; RemoteProtocolError otherwise."""
    if len(data) > MAX_COMMIT_ENVELOPE:
        raise RemoteProtocolError("commitment too large")
    env = SignedEnvelope.from_bytes(bytes(data))
    commit = Commit.from_obj(unpack(env.open(COMMIT_DOMAIN, author)))
    if commit.round != round_ or commit.partition != partition or len(commit.hash) != HASH_BYTES:
        raise RemoteProtocolError("the commitment is for another round or partition")
    if not (math.isfinite(commit.weight) and commit.weight > 0):
        raise RemoteProtocolError("the commitment's weight must be positive and finite")
    return commit


def seal_attestation(identity: Identity, attestation: Attestation) -> bytes:
    return SignedEnvelope.seal(identity, ATTESTATION_DOMAIN, pack(attestation.to_obj())).to_bytes()


def open_attestation(data: bytes, reducer: PeerID, round_: bytes, partition: int, n: int) -> Attestation:
    """An attestation signed by ``reducer``, well formed for a group of ``n``; RemoteProtocolError if not."""
    env = SignedEnvelope.from_bytes(bytes(data))
    att = Attestation.from_obj(unpack(env.open(ATTESTATION_DOMAIN, reducer)))
    if att.round != round_ or att.partition != partition:
        raise RemoteProtocolError("the attestation is for another round or partition")
    k = len(att.contributors)
    if not k or len(att.weights) != k or len(att.commits) != k or len(att.result) != HASH_BYTES:
        raise RemoteProtocolError("malformed attestation")
    if list(att.contributors) != sorted(set(att.contributors)) or att.contributors[-1] >= n:
        raise RemoteProtocolError("the attestation's contributors are not members in order")
    return att


def auditor_of(digest: bytes, partition: int, candidates: Sequence[PeerID]) -> PeerID | None:
    """Who audits ``partition``: the candidate whose hash with the round digest comes first (every member
    computes the same one; a reducer is never among the candidates for its own partition)."""
    if not candidates:
        return None

    def rank(peer: PeerID) -> bytes:
        return hashlib.blake2b(digest + bytes([partition]) + peer.digest, digest_size=16).digest()

    return min(candidates, key=rank)


@dataclass(frozen=True)
class Verdict:
    """The outcome of one partition's audit; ``offender`` is None when it checked out (or was
    inconclusive: then ``reason`` says why nothing could be concluded)."""

    ok: bool
    offender: int | None
    reason: str


def recompute(
    attestation: Attestation,
    slices: Sequence[bytes | memoryview],
    *,
    size: int,
    mode: Compression,
    aggregation: str,
    holder: int,
    origins: Sequence[int] = (),
) -> bytes:
    """The hash of the result a correct reducer computes from the contributors' committed slices
    (``slices`` in contributor order; the holder's own slice is raw float32, as it never went over the
    wire)."""
    red = PartitionReducer(size, mode, aggregation=aggregation, origins=origins, canonical=True)
    for c, data, w in zip(attestation.contributors, slices, attestation.weights, strict=True):
        if c == holder:
            if len(data) != 4 * size:
                raise RemoteProtocolError("the reducer's own slice has the wrong size")
            red.add_local(c, torch.frombuffer(bytearray(data), dtype=torch.float32), w)
        else:
            offset, view = 0, memoryview(bytearray(data))  # writable: torch views it without a copy
            for index in range(len(red.spans)):
                n = red.chunk_bytes(index)
                red.add_chunk(c, index, view[offset : offset + n], w)
                offset += n
            if offset != len(data):
                raise RemoteProtocolError("a slice longer than its partition")
            red.complete(c, w)
    red.finalize(attestation.contributors, attestation.weights)
    assert red.encoded is not None
    return hash_pieces(red.encoded)


def judge(
    attestation: Attestation,
    slices: Sequence[bytes | memoryview | None],
    authors: Sequence[PeerID],
    *,
    size: int,
    mode: Compression,
    aggregation: str,
    holder: int,
    origins: Sequence[int] = (),
) -> Verdict:
    """Check every slice against its author's signed commitment, then the reducer's result against a
    recomputation. ``slices[k]`` is what contributor ``k`` (in the attestation's order) gave the auditor,
    None if it gave nothing; ``authors[k]`` its peer id."""
    for k, (c, data) in enumerate(zip(attestation.contributors, slices, strict=True)):
        try:
            commit = open_commit(attestation.commits[k], authors[k], attestation.round, attestation.partition)
        except RemoteProtocolError as e:  # the reducer signed a commitment its author never made
            return Verdict(False, holder, f"the attestation carries a bad commitment of member {c}: {e}")
        if attestation.weights[k] > commit.weight:  # capping may lower a weight, nothing may raise it
            return Verdict(False, holder, f"member {c}'s weight was raised above its commitment")
        if data is None:
            return Verdict(True, None, f"inconclusive: member {c} did not provide its slice")
        if hash_pieces([data]) != commit.hash:
            return Verdict(False, c, f"member {c} gave the auditor another slice than it committed to")
    try:
        given = [d for d in slices if d is not None]
        result = recompute(
            attestation, given, size=size, mode=mode, aggregation=aggregation, holder=holder, origins=origins
        )
    except RemoteProtocolError as e:
        return Verdict(False, holder, f"the committed slices cannot be reduced: {e}")
    if result != attestation.result:
        return Verdict(False, holder, "its result does not match the contributors' committed slices")
    return Verdict(True, None, "the result matches the committed slices")


@dataclass(frozen=True)
class Proof:
    """What convicts a partition's reducer, checkable by anyone (see :func:`check_proof`)."""

    manifest: bytes  # the round's signed manifest
    holder: int  # the member that reduced the partition (signed the attestation)
    partition: int
    attestation: bytes  # the reducer's signed attestation
    slices: tuple[bytes | memoryview, ...]  # each contributor's committed slice, in the attestation's order


def check_proof(proof: Proof, accused: PeerID, round_: bytes) -> Verdict:
    """Re-run a partition's audit from a proof. The proof convicts ``accused`` when the verdict's
    ``offender`` is ``proof.holder``; any other verdict means it does not. RemoteProtocolError: the
    proof is malformed, of another round or against another peer (it convicts nobody either)."""
    signed = SignedManifest.verify(proof.manifest)
    if signed.digest != round_:
        raise RemoteProtocolError("the proof's manifest is of another round")
    m = signed.manifest
    peers, p, holder = m.peers(), proof.partition, proof.holder
    if not (0 <= p < len(peers) and 0 <= holder < len(peers)):
        raise RemoteProtocolError("the proof names a partition or reducer outside the group")
    if peers[holder] != accused:
        raise RemoteProtocolError("the proof is against another peer")
    att = open_attestation(proof.attestation, accused, round_, p, len(peers))
    if len(proof.slices) != len(att.contributors):
        raise RemoteProtocolError("the proof lacks contributors' slices")
    authors = [peers[c] for c in att.contributors]
    for k, c in enumerate(att.contributors):
        # The slices come from the accuser, not from their authors: one that does not match its signed
        # commitment proves nothing against anybody (``judge`` would blame its author).
        try:
            commit = open_commit(att.commits[k], authors[k], round_, p)
        except RemoteProtocolError:
            break  # the reducer signed a bad commitment: judge convicts it on that alone
        if att.weights[k] > commit.weight:
            break  # ... or a raised weight
        if hash_pieces([proof.slices[k]]) != commit.hash:
            return Verdict(True, None, f"the proof's slice of member {c} is not the one it committed to")
    return judge(
        att,
        list(proof.slices),
        authors,
        size=m.sizes[p],
        mode=m.settings.mode,
        aggregation=m.settings.aggregation,
        holder=holder,
        origins=m.origins,
    )
