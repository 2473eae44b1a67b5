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
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import nacl.bindings as sodium
import nacl.exceptions

from ..errors import HandshakeRefused, InvalidSignature, LocalProtocolError, RemoteProtocolError
from ..identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded

PROTOCOL_NAME = "p2ptrain"
PROTOCOL_VERSION = 1
MAX_HANDSHAKE_FRAME = 4096
MAX_RUN_ID = 128
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
    box: bytes = bounded(max_len=512)


@dataclass(frozen=True)
class Finish(Message):
    box: bytes = bounded(max_len=512)


@dataclass(frozen=True)
class Reject(Message):
    code: str = bounded(max_len=32)
    reason: str = bounded(max_len=512)


@dataclass(frozen=True)
class _Proof(Message):
    public_key: bytes = bounded(max_len=PUBLIC_KEY_BYTES)
    signature: bytes = bounded(max_len=SIGNATURE_BYTES)


_KINDS: dict[str, type[Message]] = {"hello": Hello, "reply": Reply, "finish": Finish, "reject": Reject}


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


def _seal_proof(key: bytes, nonce: int, identity: Identity, role: bytes, th: bytes) -> bytes:
    proof = _Proof(public_key=identity.public_key, signature=identity.sign(role + th))
    return sodium.crypto_aead_aegis256_encrypt(pack(proof.to_obj()), th, _nonce(nonce), key)


def _open_proof(key: bytes, nonce: int, box: bytes, role: bytes, th: bytes) -> bytes:
    """Decrypt and verify a proof; return the prover's Ed25519 public key."""
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
    return proof.public_key


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(8, "little") + bytes(24)


def _ephemeral(rng: Callable[[int], bytes]) -> tuple[bytes, bytes]:
    private = rng(32)
    return sodium.crypto_scalarmult_base(private), private


def _raise_if_reject(msg: Message) -> None:
    if isinstance(msg, Reject):
        raise HandshakeRefused(msg.code, msg.reason, by_remote=True)


class InitiatorHandshake:
    """The dialing side. ``start()`` gives the first frame; feed each frame received to ``receive()``."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        expected_peer: PeerID | None,
        *,
        version: int = PROTOCOL_VERSION,
        rng: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._identity = identity
        self._expected = expected_peer
        self._eph_pub, self._eph_priv = _ephemeral(rng)
        dialed = expected_peer.digest if expected_peer else None
        hello = Hello(PROTOCOL_NAME, version, run_id, self._eph_pub, dialed)
        self._hello = encode_frame(hello)
        self._state = "start"
        self.result: HandshakeResult | None = None

    def start(self) -> bytes:
        if self._state != "start":
            raise LocalProtocolError("handshake already started")
        self._state = "sent-hello"
        return self._hello

    def receive(self, data: bytes) -> bytes:
        """Process the responder's reply; return the ``finish`` frame to send. Sets ``result``."""
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
        remote_key = _open_proof(k_hs, 0, msg.box, b"responder", th1)
        remote = PeerID.from_public_key(remote_key)
        if self._expected is not None and remote != self._expected:
            raise HandshakeRefused(
                "peer_id",
                f"dialed {self._expected} but the remote proved it is {remote}",
                by_remote=False,
            )
        th2 = _h(th1, data)
        finish = encode_frame(Finish(_seal_proof(k_hs, 1, self._identity, b"initiator", th2)))
        th3 = _h(th2, finish)
        self.result = HandshakeResult(
            remote_peer=remote,
            remote_public_key=remote_key,
            send_key=_kdf(secret, th3, b"p2pt-i2r"),
            recv_key=_kdf(secret, th3, b"p2pt-r2i"),
            transcript=th3,
        )
        self._state = "done"
        return finish


class ResponderHandshake:
    """The accepting side. Feed frames to ``receive()``; it returns frames to send back."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        *,
        version: int = PROTOCOL_VERSION,
        rng: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._identity = identity
        self._run_id = run_id
        self._version = version
        self._rng = rng
        self._state = "start"
        self._secret = b""
        self._k_hs = b""
        self._th2 = b""
        self.result: HandshakeResult | None = None

    def receive(self, data: bytes) -> bytes | None:
        """Process a frame; return the frame to send (``reply``), or None once done."""
        state, self._state = self._state, "failed"  # any error below ends the handshake
        msg = decode_frame(data)
        self._state = state
        _raise_if_reject(msg)
        if self._state == "start" and isinstance(msg, Hello):
            return self._on_hello(msg, data)
        if self._state == "sent-reply" and isinstance(msg, Finish):
            self._on_finish(msg, data)
            return None
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
        reply = encode_frame(Reply(eph_pub, _seal_proof(self._k_hs, 0, self._identity, b"responder", th1)))
        self._th2 = _h(th1, reply)
        self._state = "sent-reply"
        return reply

    def _on_finish(self, finish: Finish, raw: bytes) -> None:
        self._state = "failed"
        remote_key = _open_proof(self._k_hs, 1, finish.box, b"initiator", self._th2)
        remote = PeerID.from_public_key(remote_key)
        th3 = _h(self._th2, raw)
        self.result = HandshakeResult(
            remote_peer=remote,
            remote_public_key=remote_key,
            send_key=_kdf(self._secret, th3, b"p2pt-r2i"),
            recv_key=_kdf(self._secret, th3, b"p2pt-i2r"),
            transcript=th3,
        )
        self._state = "done"
