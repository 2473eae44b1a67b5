"""Ed25519 identities, self-certifying peer ids, key files, and signed envelopes.

Theory of operation: a peer's id is the BLAKE2b-256 hash of its Ed25519 public key, so anybody holding
an id can check that a public key belongs to it; no registry is needed. The id doubles as the peer's
Kademlia node id (256 bits, XOR metric). Text form: base58 (bitcoin alphabet), as libp2p users expect.

Key files hold the 32-byte seed in a small PEM-like text file, created with mode 0600. Like ssh, we
refuse to load a key file that other users can read: a leaked key is a stolen identity.

A signed envelope carries bytes that a third party relays (DHT records, round manifests): the signer's
public key, a domain string that says what the bytes are (so a signature for one purpose cannot be
replayed for another), and an Ed25519 signature over the canonical encoding of both.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import msgpack
import nacl.exceptions
import nacl.signing

from .errors import IdentityError, InvalidSignature, RemoteProtocolError

PEER_ID_BYTES = 32
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_KEY_HEADER = "-----BEGIN P2PTRAIN ED25519 PRIVATE KEY-----"
_KEY_FOOTER = "-----END P2PTRAIN ED25519 PRIVATE KEY-----"
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise ValueError(f"invalid base58 character {c!r}")
        n = n * 58 + _B58_INDEX[c]
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


@dataclass(frozen=True, order=True)
class PeerID:
    """A peer's id: the BLAKE2b-256 hash of its Ed25519 public key."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != PEER_ID_BYTES:
            raise ValueError(f"a peer id is {PEER_ID_BYTES} bytes")

    # (written out: ids key most of the swarm's sets and maps, and the generated pair builds a tuple
    # at every call)
    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is PeerID:
            return self.digest == other.digest
        return NotImplemented

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")
        return cls(hashlib.blake2b(public_key, digest_size=PEER_ID_BYTES).digest())

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        """Parse the base58 text form; raises ValueError with a reason."""
        if len(text) > 64:  # 32 bytes are at most 44 base58 characters; refuse before decoding
            raise ValueError("not a peer id: too long")
        try:
            raw = _b58decode(text)
        except ValueError as e:
            raise ValueError(f"not a peer id: {e}") from None
        if len(raw) != PEER_ID_BYTES:
            raise ValueError(f"not a peer id: decodes to {len(raw)} bytes, expected {PEER_ID_BYTES}")
        return cls(raw)

    @functools.cached_property
    def _text(self) -> str:
        return _b58encode(self.digest)

    @functools.cached_property
    def as_int(self) -> int:
        """The id as an integer, for XOR distances."""
        return int.from_bytes(self.digest, "big")

    def to_string(self) -> str:
        return self._text

    def short(self) -> str:
        """A short form for log lines."""
        s = self.to_string()
        return f"{s[:6]}..{s[-4:]}"

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        return f"PeerID({self.short()})"


class Identity:
    """An Ed25519 key pair and the peer id it certifies."""

    def __init__(self, signing_key: nacl.signing.SigningKey) -> None:
        self._key = signing_key
        self.public_key: bytes = bytes(signing_key.verify_key)
        self.peer_id = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        if len(seed) != 32:
            raise IdentityError("an Ed25519 seed is 32 bytes")
        return cls(nacl.signing.SigningKey(seed))

    def sign(self, message: bytes) -> bytes:
        return bytes(self._key.sign(message).signature)

    def seed(self) -> bytes:
        return bytes(self._key)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id.short()})"


class _Verified:
    """Signatures this process has already checked and found good, so that one checked again (a record
    read twice, a round's signed scales served by a holder and then by a relay) costs a dict lookup, not
    an Ed25519 check (about 60 us). Only good signatures are kept, under the exact bytes checked (the key,
    the signature, the message: nothing hashed, nothing to collide), so nothing that failed or was never
    checked is ever taken as good. Small messages only, and a bounded number of them (oldest out first).

    The scale simulator runs all its nodes in one process and raises the bound
    (:func:`remember_verified_signatures`): there a scale that every member of a group checks is checked
    once for all of them. That saves the simulation's CPU, not a real node's."""

    MAX_MESSAGE = 2048  # bytes: signed scales, records, handshakes; not large manifests

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._good: dict[bytes, None] = {}
        self._lock = threading.Lock()

    def known(self, key: bytes) -> bool:
        return key in self._good

    def add(self, key: bytes) -> None:
        with self._lock:
            self._good[key] = None
            while len(self._good) > self.capacity:
                del self._good[next(iter(self._good))]


KEPT_SIGNATURES = 4096  # good signatures a process remembers by default
_verified = _Verified(KEPT_SIGNATURES)


def remember_verified_signatures(capacity: int) -> None:
    """Keep up to ``capacity`` good signatures checked in this process (0: none), so that each is checked
    once. Safe at any size (only signatures that verified are kept); it costs memory: the bytes checked,
    a signed scale's about 200, at most ``MAX_MESSAGE`` plus the key and signature each."""
    global _verified
    _verified = _Verified(max(0, capacity))


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Raise InvalidSignature unless ``signature`` is ``public_key``'s signature of ``message``."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise InvalidSignature("malformed public key or signature")
    cache = _verified
    key = b""
    if cache.capacity and len(message) <= cache.MAX_MESSAGE:
        key = public_key + signature + message  # (both of fixed length: the split is unambiguous)
        if cache.known(key):
            return
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError):
        raise InvalidSignature("signature does not verify") from None
    if key:
        cache.add(key)


# ---- key files -------------------------------------------------------------------------------


def save_identity(identity: Identity, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Write ``identity`` to ``path`` with mode 0600, refusing to overwrite unless asked."""
    p = Path(path)
    body = base64.b64encode(identity.seed()).decode()
    text = f"{_KEY_HEADER}\n{body}\n{_KEY_FOOTER}\n# peer id: {identity.peer_id}\n"
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(p, flags, 0o600)
    except FileExistsError:
        raise IdentityError(f"{p} already exists; refusing to overwrite an identity") from None
    except OSError as e:
        raise IdentityError(f"cannot write {p}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """Load a key file; refuse files that other users can read or write, as ssh does."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise IdentityError(f"key file {p} does not exist (create one with `p2ptrain keygen`)") from None
    mode = stat.S_IMODE(st.st_mode)
    if os.name == "posix" and mode & 0o077:
        raise IdentityError(
            f"key file {p} has permissions {mode:04o}: it is accessible by other users. "
            f"A private key must not be; run `chmod 600 {p}`."
        )
    try:
        lines = [ln.strip() for ln in p.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise IdentityError(f"cannot read key file {p}: {e}") from None
    try:
        start, end = lines.index(_KEY_HEADER), lines.index(_KEY_FOOTER)
        seed = base64.b64decode("".join(lines[start + 1 : end]), validate=True)
    except ValueError:
        raise IdentityError(f"{p} is not a p2ptrain key file") from None
    if len(seed) != 32:
        raise IdentityError(f"{p} is not a p2ptrain key file (bad key length)")
    return Identity.from_seed(seed)


def load_or_create_identity(path: str | os.PathLike[str]) -> tuple[Identity, bool]:
    """Load the key at ``path``, creating it (and its 0700 folder) if missing. Returns (id, created)."""
    p = Path(path)
    if p.exists():
        return load_identity(p), False
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    identity = Identity.generate()
    save_identity(identity, p)
    return identity, True


# ---- signed envelopes -----------------------------------------------------------------------

MAX_ENVELOPE_PAYLOAD = 1 << 20


@dataclass(frozen=True)
class SignedEnvelope:
    """Bytes signed by their author, for messages that third parties relay.

    ``domain`` says what the payload is (for example ``"dht-record"``); a signature made for one domain
    never verifies for another.
    """

    domain: str
    payload: bytes
    public_key: bytes
    signature: bytes

    @property
    def signer(self) -> PeerID:
        return PeerID.from_public_key(self.public_key)

    @staticmethod
    def signed_bytes(domain: str, payload: bytes) -> bytes:
        return msgpack.packb(["p2ptrain-envelope/1", domain, payload], use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def seal(cls, identity: Identity, domain: str, payload: bytes) -> SignedEnvelope:
        sig = identity.sign(cls.signed_bytes(domain, payload))
        return cls(domain, bytes(payload), identity.public_key, sig)

    def open(self, domain: str, expected_signer: PeerID | None = None) -> bytes:
        """Verify and return the payload; raise InvalidSignature with a reason otherwise."""
        if self.domain != domain:
            raise InvalidSignature(f"envelope is for {self.domain!r}, expected {domain!r}")
        if len(self.public_key) != PUBLIC_KEY_BYTES:
            raise InvalidSignature("malformed public key in envelope")
        if expected_signer is not None and self.signer != expected_signer:
            raise InvalidSignature(
                f"envelope signed by {self.signer.short()}, expected {expected_signer.short()}"
            )
        verify_signature(self.public_key, self.signed_bytes(self.domain, self.payload), self.signature)
        return self.payload

    def to_bytes(self) -> bytes:
        return msgpack.packb(  # type: ignore[no-any-return]
            [self.domain, self.payload, self.public_key, self.signature], use_bin_type=True
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedEnvelope:
        """Decode (not verify) an envelope; raise RemoteProtocolError if malformed."""
        if len(data) > MAX_ENVELOPE_PAYLOAD + 256:
            raise RemoteProtocolError("envelope too large")
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except (ValueError, msgpack.UnpackException) as e:
            raise RemoteProtocolError(f"malformed envelope: {e}") from None
        if (
            not isinstance(obj, list)
            or len(obj) != 4
            or not isinstance(obj[0], str)
            or not all(isinstance(x, bytes) for x in obj[1:])
            or len(obj[0]) > 64
        ):
            raise RemoteProtocolError("malformed envelope")
        return cls(obj[0], obj[1], obj[2], obj[3])
