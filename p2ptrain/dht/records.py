"""DHT records: dictionary values with per-subkey expiry, owner signatures, validation and storage.

Theory of operation: every key holds a small dictionary ``subkey -> (value, expiry)``; a plain value is
the subkey ``b""``. Expiry is an absolute wall-clock time (seconds since the epoch) so that it means the
same on every peer; the clock is passed in, never read here. For each subkey the entry with the later
expiry wins (ties broken by the larger value, then by the signer fields, so every replica converges to
the same entry).

Ownership: a subkey of the form :func:`owned_subkey` (``b"\\x01" + peer id``), or a key that starts with
that prefix, may only be written by that peer: the entry carries the owner's public key and an Ed25519
signature over (key, subkey, value, expiry) in the ``dht-record`` domain. Storage checks it when the
entry arrives, and readers check it again when they read it back, so a replica cannot forge it either.

Bounds (``RecordLimits``) are enforced on every store, with a reason for each refusal: sizes of keys,
subkeys and values, subkeys per key, bytes per key, expiry in the future but not beyond ``max_ttl``,
records held per storing peer, and stores per peer per minute.

Fair shares of a full key: ids are free, so a key's subkeys and bytes are shared by *origin*, the
subnet a store came from (:func:`origin_of`: a /24 or /64; each loopback address on its own, so a
swarm on one machine behaves like one spread over the internet). A store that would overflow a key
evicts the entries of the origin holding the most of it, earliest expiry first, as long as that origin
holds more than the newcomer's would with the new entry. So a flooder fills a key only while nobody
else needs it: every other origin can always claim as much as the flooder keeps, and the flood
cannot outlast the honest records by long TTLs.

Private runs (a store given a :class:`~p2ptrain.authority.Membership`): records are relayed, so the
handshake's check of the peer that sends a STORE says nothing about who wrote each entry. Every entry
must therefore be signed, and carry its author's membership certificate (the ``cert`` field, outside
the signed payload: the certificate authenticates itself, and names the key that signed the entry).
The store refuses entries whose author is not a member and serves only entries whose author still is;
readers check again. In open runs the field (the last, empty) is left out of the encoding.

Open runs that price ids (``[run] id_work``, :class:`IdWork`): the handshake checks the work of the peer
that sends a STORE, but not of the authors of the entries it relays, and fresh keys would fill keys
with entries at no cost. So here too every entry is signed, and ``cert`` carries its author's work
nonce (8 bytes, bound to the author's id by the hash, see :mod:`p2ptrain.idwork`); the store and
readers refuse entries whose author's id carries less work than the run asks.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Protocol

from ..authority import MAX_CERT_BYTES, CertificateRejected
from ..errors import InvalidSignature, P2PError
from ..identity import PEER_ID_BYTES, Identity, PeerID, SignedEnvelope
from ..idwork import work_bits
from ..net.admission import subnet_of
from ..wire.codec import pack
from ..wire.schema import Message, bounded

OWNER_TAG = b"\x01"
SIGN_DOMAIN = "dht-record"


def key_id(key: bytes) -> bytes:
    """Where a key lives in the id space."""
    return hashlib.blake2b(key, digest_size=PEER_ID_BYTES).digest()


def owned_subkey(peer: PeerID) -> bytes:
    """A subkey that only ``peer`` may write (for example its entry in a run's peer list)."""
    return OWNER_TAG + peer.digest


def subkey_owner(subkey: bytes) -> PeerID | None:
    """The peer whose :func:`owned_subkey` this is (the DHT checked that it signed the entry), or None."""
    if len(subkey) == 1 + PEER_ID_BYTES and subkey[:1] == OWNER_TAG:
        return PeerID(subkey[1:])
    return None


def owner_of(key: bytes, subkey: bytes) -> PeerID | None:
    """Who alone may write (key, subkey): the key's owner if the key is owned, else the subkey's."""
    if len(key) >= 1 + PEER_ID_BYTES and key[:1] == OWNER_TAG:
        return PeerID(key[1 : 1 + PEER_ID_BYTES])
    return subkey_owner(subkey)


@dataclass(frozen=True)
class Entry(Message, positional=True):
    """One subkey of one key, as stored and as sent on the wire."""

    key: bytes = bounded(max_len=256)
    subkey: bytes = bounded(b"", max_len=64)
    value: bytes = bounded(b"", max_len=64 * 1024)
    expiry: float = bounded(0.0, ge=0.0)
    public_key: bytes = bounded(b"", max_len=32)
    signature: bytes = bounded(b"", max_len=64)
    # private runs: the author's membership certificate; runs that price ids: its work nonce
    cert: bytes = bounded(b"", max_len=MAX_CERT_BYTES)

    def signed_payload(self) -> bytes:
        return pack([self.key, self.subkey, self.value, self.expiry])

    def sort_key(self) -> tuple[float, bytes, bytes, bytes, bytes]:
        # Expiry, then value; the signer fields settle the last ties so that replicas converge on one
        # entry whatever the order they received copies (signed, unsigned, re-signed) in.
        return (self.expiry, self.value, self.public_key, self.signature, self.cert)

    def nbytes(self) -> int:
        return len(self.key) + len(self.subkey) + len(self.value) + len(self.cert) + 112

    @functools.cached_property
    def packed(self) -> bytes:
        """The entry as msgpack, as it travels and as reads name it (``known.tag``); packed once: a
        replica serves one entry to every reader of its key, and each read names what it holds."""
        return pack(self.to_obj())


def make_entry(
    key: bytes,
    value: bytes,
    expiry: float,
    *,
    subkey: bytes = b"",
    signer: Identity | None = None,
    cert: bytes = b"",
) -> Entry:
    """Build an entry; signs it when ``signer`` is given (required for owned keys and subkeys, and for
    every entry of a private run, which also carries the signer's membership certificate ``cert``)."""
    entry = Entry(key, subkey, value, expiry)
    if signer is None:
        return entry
    env = SignedEnvelope.seal(signer, SIGN_DOMAIN, entry.signed_payload())
    return Entry(key, subkey, value, expiry, env.public_key, env.signature, cert)


def verify_entry(entry: Entry) -> None:
    """Raise InvalidSignature if the entry is owned and not validly signed by its owner."""
    owner = owner_of(entry.key, entry.subkey)
    if owner is None and not entry.signature:
        return
    if not entry.public_key or not entry.signature:
        raise InvalidSignature(f"entry owned by {owner.short() if owner else '?'} is not signed")
    env = SignedEnvelope(SIGN_DOMAIN, entry.signed_payload(), entry.public_key, entry.signature)
    env.open(SIGN_DOMAIN, expected_signer=owner)


class Authors(Protocol):
    """Who may write entries, beyond the owners' signatures: a private run's
    :class:`~p2ptrain.authority.Membership`, or :class:`IdWork` in an open run that prices ids. Every
    entry is then signed, and carries its author's credential in ``cert``."""

    @property
    def certificate(self) -> bytes | None:
        """This node's own credential, attached to the entries it writes."""
        ...

    @property
    def refusal(self) -> str:
        """How a refused entry is described."""
        ...

    def check(self, cert: bytes | None, peer: PeerID, now: float) -> object:
        """Raise CertificateRejected unless ``cert`` admits ``peer`` as an author at ``now``."""
        ...


@dataclass(frozen=True)
class IdWork:
    """An open run that prices ids: authors show ``bits`` of work on their ids (see ``idwork``)."""

    bits: int
    certificate: bytes | None = None  # this node's work nonce
    refusal: str = "record of an id without the work this run asks for"

    def check(self, cert: bytes | None, peer: PeerID, now: float) -> int:
        got = work_bits(peer, cert)
        if got < self.bits:
            raise CertificateRejected(
                "missing", f"the id {peer} carries {got} bits of work, this run asks for {self.bits}"
            )
        return got


def check_author(entry: Entry, authors: Authors, now: float) -> None:
    """Raise RecordRefused unless ``entry`` (signature already verified) was written by an author
    ``authors`` admit at ``now``: a member of a private run, an id with the run's work."""
    if not entry.public_key or not entry.signature:
        raise RecordRefused(f"unsigned record: this run keeps only signed records ({authors.refusal})")
    try:
        author = PeerID.from_public_key(entry.public_key)
        authors.check(entry.cert or None, author, now)
    except ValueError:
        raise RecordRefused("malformed author key") from None
    except CertificateRejected as e:
        reason = e.reason if e.kind == "missing" else f"author {author}: {e.reason}"
        raise RecordRefused(f"{authors.refusal}: {reason}") from None


def admitted(entry: Entry, authors: Authors | None, now: float) -> bool:
    """Whether a stored (verified) entry may be served or used: always where any author may write."""
    if authors is None:
        return True
    try:
        check_author(entry, authors, now)
    except RecordRefused:
        return False
    return True


@dataclass(frozen=True)
class RecordLimits:
    max_key: int = 256
    max_subkey: int = 64
    max_value: int = 16 * 1024
    max_subkeys: int = 4096
    max_key_bytes: int = 768 * 1024
    max_ttl: float = 24 * 3600.0
    clock_skew: float = 60.0
    max_records_per_peer: int = 20_000
    max_stores_per_minute: int = 6_000
    max_keys: int = 200_000


class RecordRefused(P2PError):
    """A store broke a bound or carried a bad signature; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def check_entry(entry: Entry, now: float, limits: RecordLimits, authors: Authors | None = None) -> None:
    """Raise RecordRefused with a reason unless ``entry`` may be stored at time ``now`` (written by an
    author ``authors`` admit, when given)."""
    if not entry.key:
        raise RecordRefused("empty key")
    if len(entry.key) > limits.max_key:
        raise RecordRefused(f"key of {len(entry.key)} bytes exceeds {limits.max_key}")
    if len(entry.subkey) > limits.max_subkey:
        raise RecordRefused(f"subkey of {len(entry.subkey)} bytes exceeds {limits.max_subkey}")
    if len(entry.value) > limits.max_value:
        raise RecordRefused(f"value of {len(entry.value)} bytes exceeds {limits.max_value}")
    if not math.isfinite(entry.expiry):
        raise RecordRefused("expiry must be a finite time")
    if entry.expiry <= now:
        raise RecordRefused("record already expired")
    if entry.expiry > now + limits.max_ttl + limits.clock_skew:
        raise RecordRefused(
            f"expiry {entry.expiry - now:.0f} s ahead exceeds the {limits.max_ttl:.0f} s limit"
        )
    try:
        verify_entry(entry)
    except InvalidSignature as e:
        raise RecordRefused(f"bad signature: {e}") from None
    if authors is not None:
        check_author(entry, authors, now)


@dataclass
class _Stored:
    entry: Entry
    stored_by: PeerID | None
    origin: str | None = None  # the subnet the store came from (None: this node's own)


def origin_of(host: str) -> str:
    """Whose share of a full key a store from ``host`` counts against: its /24 (IPv4) or /64 (IPv6);
    a loopback address on its own (peers on one machine are told apart by address); a non-IP name as
    it is: the subnets connection limits count (:func:`~p2ptrain.net.admission.subnet_of`)."""
    return subnet_of(host)


class RecordStore:
    """The records this node holds for the DHT, with per-peer quotas (pure; time passed in)."""

    def __init__(self, limits: RecordLimits | None = None, membership: Authors | None = None) -> None:
        self.limits = limits or RecordLimits()
        self.membership = membership  # who may author entries (stored and served): None, anyone
        self._data: dict[bytes, dict[bytes, _Stored]] = {}  # key id -> subkey -> stored
        self._per_peer: defaultdict[PeerID, int] = defaultdict(int)
        self._recent: defaultdict[PeerID, deque[float]] = defaultdict(deque)

    def __len__(self) -> int:
        return sum(len(d) for d in self._data.values())

    def keys(self) -> list[bytes]:
        return list(self._data)

    def records_of(self, peer: PeerID) -> int:
        return self._per_peer.get(peer, 0)

    def contents(self) -> list[Entry]:
        """Every entry held, as stored: expired ones and those of authors no longer admitted included
        (what a test or an audit of this node inspects; a read uses :meth:`get`)."""
        return [st.entry for rec in self._data.values() for st in rec.values()]

    def clear(self) -> None:
        """Forget every entry and every count, as a node restarted empty."""
        self._data.clear()
        self._per_peer.clear()
        self._recent.clear()

    def put(self, entry: Entry, now: float, stored_by: PeerID | None, origin: str | None = None) -> str:
        """Store ``entry`` (sent by ``stored_by`` from the subnet ``origin``, see :func:`origin_of`);
        return what happened, or raise RecordRefused with the reason."""
        check_entry(entry, now, self.limits, self.membership)
        if stored_by is not None:
            self._rate_check(stored_by, now)
        kid = key_id(entry.key)
        record = self._data.get(kid)
        if record is None:
            if len(self._data) >= self.limits.max_keys:
                self.expire(now)  # expired keys give their slots back before we refuse
            if len(self._data) >= self.limits.max_keys:
                raise RecordRefused("this node holds its maximum number of keys")
            record = {}
        else:
            self._expire_key(kid, now)
            record = self._data.get(kid, {})
        old = record.get(entry.subkey)
        if old is not None and old.entry.sort_key() >= entry.sort_key():
            return "kept the existing entry (same or later expiry)"
        gains = stored_by is not None and (old is None or old.stored_by != stored_by)
        if gains and self._per_peer[stored_by] >= self.limits.max_records_per_peer:  # type: ignore[index]
            raise RecordRefused(f"peer already stores {self.limits.max_records_per_peer} records here")
        evicted = self._make_room(record, entry, old, origin)
        if old is None and len(record) - len(evicted) >= self.limits.max_subkeys:
            raise RecordRefused(f"key already has {self.limits.max_subkeys} subkeys")
        staying = [st for sub, st in record.items() if sub not in evicted and st is not old]
        size = sum(st.entry.nbytes() for st in staying)
        if size + entry.nbytes() > self.limits.max_key_bytes:
            raise RecordRefused(f"key would exceed {self.limits.max_key_bytes} bytes")
        for sub in evicted:
            self._uncount(record.pop(sub))
        if old is not None:
            self._uncount(old)
        record[entry.subkey] = _Stored(entry, stored_by, origin)
        self._data[kid] = record
        if stored_by is not None:
            self._per_peer[stored_by] += 1
        if evicted:
            return f"stored, evicting {len(evicted)} entries of the origin that held the most of the key"
        return "replaced an older entry" if old else "stored"

    def _make_room(
        self, record: dict[bytes, _Stored], entry: Entry, old: _Stored | None, origin: str | None
    ) -> list[bytes]:
        """The subkeys to evict so that ``entry`` fits (see the module docstring: fair shares); they are
        only removed once the store is sure to succeed. May leave it short: the caller refuses then."""
        if origin is None:
            return []
        kept = {sub: st for sub, st in record.items() if st is not old}
        held: defaultdict[str | None, int] = defaultdict(int)
        for st in kept.values():
            held[st.origin] += st.entry.nbytes()
        evicted: list[bytes] = []

        def full() -> bool:
            over_bytes = sum(held.values()) + entry.nbytes() > self.limits.max_key_bytes
            return over_bytes or (old is None and len(kept) >= self.limits.max_subkeys)

        while full():
            mine = held[origin] + entry.nbytes()
            top = max((o for o in held if o != origin and held[o] > 0), key=lambda o: held[o], default=None)
            if top is None or held[top] <= mine:
                break
            sub = min((s for s, st in kept.items() if st.origin == top), key=lambda s: kept[s].entry.expiry)
            held[top] -= kept.pop(sub).entry.nbytes()
            evicted.append(sub)
        return evicted

    def _rate_check(self, peer: PeerID, now: float) -> None:
        recent = self._recent[peer]
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        if len(recent) >= self.limits.max_stores_per_minute:
            raise RecordRefused(f"more than {self.limits.max_stores_per_minute} stores per minute")
        recent.append(now)

    def _uncount(self, stored: _Stored) -> None:
        if stored.stored_by is not None:
            self._per_peer[stored.stored_by] -= 1
            if self._per_peer[stored.stored_by] <= 0:
                del self._per_peer[stored.stored_by]

    def _expire_key(self, kid: bytes, now: float) -> None:
        record = self._data.get(kid)
        if record is None:
            return
        for sub in [s for s, st in record.items() if st.entry.expiry <= now]:
            self._uncount(record.pop(sub))
        if not record:
            del self._data[kid]

    def get(self, kid: bytes, now: float) -> list[Entry]:
        """Live entries under a key id (in a private run, of authors who are still members)."""
        self._expire_key(kid, now)
        stored = self._data.get(kid, {}).values()
        return [st.entry for st in stored if admitted(st.entry, self.membership, now)]

    def expire(self, now: float) -> int:
        """Drop expired entries everywhere; returns how many."""
        before = len(self)
        for kid in list(self._data):
            self._expire_key(kid, now)
        for peer in [p for p, q in self._recent.items() if not q or q[-1] <= now - 60.0]:
            del self._recent[peer]
        return before - len(self)

    def all_entries(self, now: float) -> list[Entry]:
        self.expire(now)
        return [
            st.entry
            for rec in self._data.values()
            for st in rec.values()
            if admitted(st.entry, self.membership, now)
        ]


def merge(entries: list[Entry]) -> dict[bytes, Entry]:
    """Merge entries of one key from many replicas: for each subkey the latest expiry wins."""
    out: dict[bytes, Entry] = {}
    for e in entries:
        cur = out.get(e.subkey)
        if cur is None or e.sort_key() > cur.sort_key():
            out[e.subkey] = e
    return out
