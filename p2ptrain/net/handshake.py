"""The connection handshake, sans-IO: mutual authentication, forward secrecy, transcript binding.

Theory of operation (three messages, SIGMA-style, in the spirit of Noise XX):

1. initiator -> responder ``hello``: protocol version, run id, a fresh X25519 ephemeral key, and the peer
   id the initiator meant to dial (if it knows it). The responder refuses at once, with a reason the
   initiator can print, when the version, the run id or the dialed peer id does not match.
2. responder -> initiator ``reply``: its ephemeral key and, encrypted under a key derived from the
   ephemeral Diffie-Hellman secret, its Ed25519 public key and a signature over the transcript so far.
3. initiator -> responder ``finish``: the same for the initiator.

Each signature covers the hash of every message before it (so the version and run id are bound to the
session, and nothing can be altered in flight); encrypting the identity part under the DH-derived key
proves that the signer also took part in the key exchange (no identity misbinding by a relay). The two
session keys (one per direction) come from the DH secret and the whole transcript: the long-term keys
only sign, so recorded traffic stays secret if they leak later (forward secrecy).

After the handshake every frame is AEAD-encrypted (AEGIS-256) with a per-direction counter as nonce:
nonces never repeat, and a dropped, replayed, reordered or altered frame fails authentication, which
closes the connection.

Frames during the handshake are plaintext msgpack maps of at most ``MAX_HANDSHAKE_FRAME`` bytes.
A ``reject`` frame (code + human-readable reason) may replace any message, in either direction.

Private runs (see :mod:`p2ptrain.authority`): each side also puts its membership certificate inside its
encrypted proof, and the responder names its run's authority in its proof. The initiator checks the
responder's certificate when it reads the reply; the responder checks the initiator's when it reads the
finish, and only then, because the initiator's identity is revealed in the finish, answers with a 4th
frame: ``accept`` (an empty AEAD box under the handshake key, bound to the whole transcript) or a
``reject`` with code ``membership``. An initiator waits for that verdict only when the responder's
proof named an authority. In open runs the proof fields for private runs are omitted, not sent empty.
Peers without certificates cannot join a private run: they send none and are refused.

Runs that price ids (``[run] id_work``, see :mod:`p2ptrain.idwork`): each proof carries its prover's id
work nonce, and the responder's proof says how many bits it asks of dialers (``needs``). Each side
refuses a remote whose id carries less (code ``id_work``); an initiator that carries less than the
responder asks refuses itself with :class:`WorkRefused`, which says how much, so its host can do the
work and dial again. Without id work these fields are omitted too.

Versions: 2 seals each record as two AEAD boxes (see :mod:`p2ptrain.net.channel`); version-1 peers
sealed one, so the two cannot talk, and the hello refuses the mismatch before any key is derived. 3 sends
frame headers as arrays (see :mod:`p2ptrain.net.rpc`), which a version-2 peer cannot read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import nacl.bindings as sodium
import nacl.exceptions

from ..authority import MAX_CERT_BYTES, Certificate, CertificateRejected, Membership
from ..errors import HandshakeRefused, InvalidSignature, LocalProtocolError, RemoteProtocolError
from ..identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature
from ..idwork import MAX_WORK_BITS, WORK_BYTES, work_bits
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded

PROTOCOL_NAME = "p2ptrain"
PROTOCOL_VERSION = 4  # 4: slices carry signed scales, results their contributors' (averaging.bounds)
MAX_HANDSHAKE_FRAME = 4096
MAX_RUN_ID = 128
MAX_PROOF_BOX = 2048  # a proof with a certificate of MAX_CERT_BYTES (was 512 before private runs)
_HS_LABEL = b"p2ptrain-handshake/1"


@dataclass(frozen=True)
class Hello(Message):
    proto: str = bounded(max_len=32)
    version: int = bounded(ge=0, le=2**31)
    run_id: str = bounded(max_len=MAX_RUN_ID)
    ephemeral: bytes = bounded(max_len=32)
    dialed: bytes | None = bounded(None, max_len=32)


@dataclass(frozen=True)
class Reply(Message):
    ephemeral: bytes = bounded(max_len=32)
    box: bytes = bounded(max_len=MAX_PROOF_BOX)


@dataclass(frozen=True)
class Finish(Message):
    box: bytes = bounded(max_len=MAX_PROOF_BOX)


@dataclass(frozen=True)
class Accept(Message):
    """A private-run responder's verdict on the initiator's certificate: admitted (sealed, empty)."""

    box: bytes = bounded(max_len=64)


@dataclass(frozen=True)
class Reject(Message):
    code: str = bounded(max_len=32)
    reason: str = bounded(max_len=512)


@dataclass(frozen=True)
class _Proof(Message):
    public_key: bytes = bounded(max_len=PUBLIC_KEY_BYTES)
    signature: bytes = bounded(max_len=SIGNATURE_BYTES)
    # Private runs only; left out of the encoding when None (see the theory of operation).
    cert: bytes | None = bounded(None, max_len=MAX_CERT_BYTES)  # the prover's membership certificate
    authority: bytes | None = bounded(None, max_len=PUBLIC_KEY_BYTES)  # responder: "I will judge yours"
    # Runs that price ids (see ``idwork``); left out when None, so the wire is unchanged without them.
    work: bytes | None = bounded(None, max_len=WORK_BYTES)  # the prover's id work nonce
    needs: int | None = bounded(None, ge=0, le=MAX_WORK_BITS)  # responder: the id work it asks of dialers


_KINDS: dict[str, type[Message]] = {
    "hello": Hello,
    "reply": Reply,
    "finish": Finish,
    "accept": Accept,
    "reject": Reject,
}


def encode_frame(msg: Message) -> bytes:
    kind = next(k for k, cls in _KINDS.items() if isinstance(msg, cls))
    return pack({"t": kind, "m": msg.to_obj()})


def decode_frame(data: bytes) -> Message:
    if len(data) > MAX_HANDSHAKE_FRAME:
        raise RemoteProtocolError("handshake frame too large")
    obj = unpack(data, max_bytes=MAX_HANDSHAKE_FRAME)
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str) or obj["t"] not in _KINDS:
        raise RemoteProtocolError("not a handshake frame")
    return _KINDS[obj["t"]].from_obj(obj.get("m"))


def reject_frame(code: str, reason: str) -> bytes:
    """Encode a refusal for the remote to read before we close."""
    return encode_frame(Reject(code=code[:32], reason=reason[:512]))


@dataclass(frozen=True)
class HandshakeResult:
    """What a completed handshake proves and yields."""

    remote_peer: PeerID
    remote_public_key: bytes
    send_key: bytes
    recv_key: bytes
    transcript: bytes
    remote_certificate: Certificate | None = None  # private runs: what admitted the remote


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for p in parts:
        h.update(p)
    return h.digest()


def _kdf(secret: bytes, transcript: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(transcript, key=secret, person=label.ljust(16, b"\0"), digest_size=32).digest()


def _dh(private: bytes, public: bytes) -> bytes:
    try:
        shared: bytes = sodium.crypto_scalarmult(private, public)
    except (nacl.exceptions.RuntimeError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
        raise RemoteProtocolError("invalid ephemeral key") from None
    if shared == bytes(32):
        raise RemoteProtocolError("invalid ephemeral key (low order point)")
    return shared


def _seal_proof(
    key: bytes,
    nonce: int,
    identity: Identity,
    role: bytes,
    th: bytes,
    *,
    cert: bytes | None = None,
    authority: bytes | None = None,
    work: bytes | None = None,
    needs: int | None = None,
) -> bytes:
    proof = _Proof(identity.public_key, identity.sign(role + th), cert, authority, work, needs)
    fields = {k: v for k, v in proof.to_obj().items() if v is not None}
    return sodium.crypto_aead_aegis256_encrypt(pack(fields), th, _nonce(nonce), key)


def _open_proof(key: bytes, nonce: int, box: bytes, role: bytes, th: bytes) -> _Proof:
    """Decrypt and verify a proof; return it (the prover's Ed25519 public key and what it carries)."""
    if len(box) < sodium.crypto_aead_aegis256_ABYTES:
        raise RemoteProtocolError("handshake proof is shorter than its authentication tag")
    try:
        plain = sodium.crypto_aead_aegis256_decrypt(box, th, _nonce(nonce), key)
    except nacl.exceptions.CryptoError:
        raise RemoteProtocolError("handshake proof does not authenticate (transcript mismatch)") from None
    proof = _Proof.from_obj(unpack(plain, max_bytes=MAX_HANDSHAKE_FRAME))
    if len(proof.public_key) != PUBLIC_KEY_BYTES:
        raise RemoteProtocolError("handshake proof carries a malformed public key")
    try:
        verify_signature(proof.public_key, role + th, proof.signature)
    except InvalidSignature:
        raise RemoteProtocolError("handshake signature does not verify") from None
    return proof


class WorkRefused(HandshakeRefused):
    """This node's id carries less work than the listener asks (``needs`` bits): do the work, dial again."""

    def __init__(self, needs: int, reason: str) -> None:
        super().__init__("id_work", reason, by_remote=False)
        self.needs = needs


def _check_work(peer: PeerID, nonce: bytes | None, required: int, who: str) -> None:
    got = work_bits(peer, nonce)
    if got < required:
        raise HandshakeRefused(
            "id_work",
            f"the {who}'s id carries {got} bits of work, this run asks for {required}",
            by_remote=False,
        )


def _admit(membership: Membership, cert: bytes | None, peer: PeerID, now: float) -> Certificate:
    """The remote's certificate if it admits ``peer`` to this private run, else a ``membership`` refusal."""
    try:
        return membership.check(cert, peer, now)
    except CertificateRejected as e:
        reason = e.reason if e.kind == "missing" else f"peer {peer}: {e.reason}"
        raise HandshakeRefused("membership", reason, by_remote=False) from None


def _private(membership: Membership | None, now: float | None) -> float:
    if membership is not None and now is None:
        raise LocalProtocolError("a private run's handshake needs the current time to check certificates")
    return now or 0.0


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(8, "little") + bytes(24)


def _ephemeral(rng: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    private = rng(32)
    return sodium.crypto_scalarmult_base(private), private


def _raise_if_reject(msg: Message) -> None:
    if isinstance(msg, Reject):
        raise HandshakeRefused(msg.code, msg.reason, by_remote=True)


class InitiatorHandshake:
    """The dialing side. ``start()`` gives the first frame; feed each frame received to ``receive()``.

    In a private run (``membership``, checked at time ``now``) the responder's certificate must admit it.
    When the responder judges ours (``expects_verdict`` after ``receive``), feed its next frame to
    ``receive_verdict()``; ``result`` is set once the handshake is complete.
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        expected_peer: PeerID | None,
        *,
        version: int = PROTOCOL_VERSION,
        rng: Callable[[int], bytes] = os.urandom,
        membership: Membership | None = None,
        now: float | None = None,
        work: bytes | None = None,
        required_work: int = 0,
    ) -> None:
        """``work``: this node's id work nonce; ``required_work``: the bits the listener's id must carry."""
        self._identity = identity
        self._work, self._required_work = work, required_work
        self._expected = expected_peer
        self._membership = membership
        self._now = _private(membership, now)
        self._eph_pub, self._eph_priv = _ephemeral(rng)
        dialed = expected_peer.digest if expected_peer else None
        hello = Hello(PROTOCOL_NAME, version, run_id, self._eph_pub, dialed)
        self._hello = encode_frame(hello)
        self._state = "start"
        self._k_hs = b""
        self._pending: HandshakeResult | None = None  # complete once the responder accepts us
        self.result: HandshakeResult | None = None

    @property
    def expects_verdict(self) -> bool:
        """True after ``receive()`` when the responder (a private run's) will accept or refuse us."""
        return self._state == "sent-finish"

    def start(self) -> bytes:
        if self._state != "start":
            raise LocalProtocolError("handshake already started")
        self._state = "sent-hello"
        return self._hello

    def receive(self, data: bytes) -> bytes:
        """Process the responder's reply; return the ``finish`` frame to send. Sets ``result`` (unless
        ``expects_verdict``)."""
        if self._state != "sent-hello":
            raise LocalProtocolError(f"unexpected handshake frame in state {self._state}")
        self._state = "failed"
        msg = decode_frame(data)
        _raise_if_reject(msg)
        if not isinstance(msg, Reply):
            raise RemoteProtocolError(f"expected a reply, got {type(msg).__name__}")
        if len(msg.ephemeral) != 32:
            raise RemoteProtocolError("malformed ephemeral key")
        secret = _dh(self._eph_priv, msg.ephemeral)
        th1 = _h(_HS_LABEL, self._hello, msg.ephemeral)
        k_hs = _kdf(secret, th1, b"p2pt-hs")
        proof = _open_proof(k_hs, 0, msg.box, b"responder", th1)
        remote = PeerID.from_public_key(proof.public_key)
        if self._expected is not None and remote != self._expected:
            raise HandshakeRefused(
                "peer_id",
                f"dialed {self._expected} but the remote proved it is {remote}",
                by_remote=False,
            )
        _check_work(remote, proof.work, self._required_work, "listener")
        self._check_own_work(proof.needs)
        m = self._membership
        remote_cert = _admit(m, proof.cert, remote, self._now) if m is not None else None
        th2 = _h(th1, data)
        own = m.certificate if m is not None else None
        box = _seal_proof(k_hs, 1, self._identity, b"initiator", th2, cert=own, work=self._work)
        finish = encode_frame(Finish(box))
        th3 = _h(th2, finish)
        result = HandshakeResult(
            remote_peer=remote,
            remote_public_key=proof.public_key,
            send_key=_kdf(secret, th3, b"p2pt-i2r"),
            recv_key=_kdf(secret, th3, b"p2pt-r2i"),
            transcript=th3,
            remote_certificate=remote_cert,
        )
        if proof.authority is not None:  # a private responder: it judges our certificate first
            self._k_hs, self._pending, self._state = k_hs, result, "sent-finish"
        else:
            self.result, self._state = result, "done"
        return finish

    def _check_own_work(self, needs: int | None) -> None:
        own = work_bits(self._identity.peer_id, self._work)
        if needs is not None and own < needs:
            raise WorkRefused(
                needs, f"the listener asks for {needs} bits of id work, this node's id carries {own}"
            )

    def receive_verdict(self, data: bytes) -> None:
        """Process a private responder's verdict: sets ``result``, or raises its refusal."""
        if self._state != "sent-finish" or self._pending is None:
            raise LocalProtocolError(f"unexpected handshake verdict in state {self._state}")
        self._state = "failed"
        msg = decode_frame(data)
        _raise_if_reject(msg)
        if not isinstance(msg, Accept):
            raise RemoteProtocolError(f"expected an accept, got {type(msg).__name__}")
        _open_accept(self._k_hs, msg.box, self._pending.transcript)
        self.result, self._state = self._pending, "done"


class ResponderHandshake:
    """The accepting side. Feed frames to ``receive()``; it returns frames to send back.

    In a private run (``membership``, checked at time ``now``) the initiator's certificate must admit it:
    ``receive(finish)`` then returns the ``accept`` frame to send, or raises a ``membership`` refusal.
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        *,
        version: int = PROTOCOL_VERSION,
        rng: Callable[[int], bytes] = os.urandom,
        membership: Membership | None = None,
        now: float | None = None,
        work: bytes | None = None,
        required_work: int = 0,
    ) -> None:
        """``work``: this node's id work nonce; ``required_work``: the bits a dialer's id must carry."""
        self._identity = identity
        self._work, self._required_work = work, required_work
        self._run_id = run_id
        self._version = version
        self._rng = rng
        self._membership = membership
        self._now = _private(membership, now)
        self._state = "start"
        self._secret = b""
        self._k_hs = b""
        self._th2 = b""
        self.result: HandshakeResult | None = None

    def receive(self, data: bytes) -> bytes | None:
        """Process a frame; return the frame to send (``reply``; ``accept`` in a private run), or None
        once done."""
        state, self._state = self._state, "failed"  # any error below ends the handshake
        msg = decode_frame(data)
        self._state = state
        _raise_if_reject(msg)
        if self._state == "start" and isinstance(msg, Hello):
            return self._on_hello(msg, data)
        if self._state == "sent-reply" and isinstance(msg, Finish):
            return self._on_finish(msg, data)
        state, self._state = self._state, "failed"
        raise RemoteProtocolError(f"unexpected {type(msg).__name__} in handshake state {state}")

    def _on_hello(self, hello: Hello, raw: bytes) -> bytes:
        self._state = "failed"
        if hello.proto != PROTOCOL_NAME:
            raise HandshakeRefused("protocol", f"not a {PROTOCOL_NAME} peer", by_remote=False)
        if hello.version != self._version:
            raise HandshakeRefused(
                "version",
                f"the dialer speaks protocol version {hello.version}, the listener speaks {self._version}",
                by_remote=False,
            )
        if hello.run_id != self._run_id:
            raise HandshakeRefused(
                "run_id",
                f"the listener is in run {self._run_id!r}, the dialer asked for run {hello.run_id!r}",
                by_remote=False,
            )
        me = self._identity.peer_id
        if hello.dialed is not None and hello.dialed != me.digest:
            asked = PeerID(hello.dialed) if len(hello.dialed) == 32 else None
            raise HandshakeRefused(
                "peer_id", f"the dialer asked for peer {asked}, but the listener is {me}", by_remote=False
            )
        if len(hello.ephemeral) != 32:
            raise RemoteProtocolError("malformed ephemeral key")
        eph_pub, eph_priv = _ephemeral(self._rng)
        self._secret = _dh(eph_priv, hello.ephemeral)
        th1 = _h(_HS_LABEL, raw, eph_pub)
        self._k_hs = _kdf(self._secret, th1, b"p2pt-hs")
        m = self._membership
        box = _seal_proof(
            self._k_hs,
            0,
            self._identity,
            b"responder",
            th1,
            cert=m.certificate if m is not None else None,
            authority=m.authority if m is not None else None,
            work=self._work,
            needs=self._required_work or None,
        )
        reply = encode_frame(Reply(eph_pub, box))
        self._th2 = _h(th1, reply)
        self._state = "sent-reply"
        return reply

    def _on_finish(self, finish: Finish, raw: bytes) -> bytes | None:
        self._state = "failed"
        proof = _open_proof(self._k_hs, 1, finish.box, b"initiator", self._th2)
        remote = PeerID.from_public_key(proof.public_key)
        _check_work(remote, proof.work, self._required_work, "dialer")
        m = self._membership
        remote_cert = _admit(m, proof.cert, remote, self._now) if m is not None else None
        th3 = _h(self._th2, raw)
        self.result = HandshakeResult(
            remote_peer=remote,
            remote_public_key=proof.public_key,
            send_key=_kdf(self._secret, th3, b"p2pt-r2i"),
            recv_key=_kdf(self._secret, th3, b"p2pt-i2r"),
            transcript=th3,
            remote_certificate=remote_cert,
        )
        self._state = "done"
        if m is None:
            return None
        return encode_frame(Accept(_seal_accept(self._k_hs, th3)))


def _seal_accept(key: bytes, th3: bytes) -> bytes:
    return sodium.crypto_aead_aegis256_encrypt(b"", th3, _nonce(2), key)


def _open_accept(key: bytes, box: bytes, th3: bytes) -> None:
    plain = None
    if len(box) >= sodium.crypto_aead_aegis256_ABYTES:
        with contextlib.suppress(nacl.exceptions.CryptoError):
            plain = sodium.crypto_aead_aegis256_decrypt(box, th3, _nonce(2), key)
    if plain != b"":
        raise RemoteProtocolError("handshake acceptance does not authenticate (transcript mismatch)")
