"""DHT wire messages and their validation.

Requests carry the sender's contact (its id and dialable address) unless the sender is client-only;
the callee only trusts that contact when it matches the authenticated connection (same peer id) and the
address's host is the one the connection came from (otherwise it would have to verify it by dialing).

Entries travel in the reply or request *body* as a msgpack list, validated entry by entry, because a
run's peer list can outgrow a header; the body is bounded by the channel's chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RemoteProtocolError
from ..identity import PEER_ID_BYTES, PeerID
from ..net.address import PeerAddress
from ..net.channel import MAX_CHUNK
from ..net.rpc import Method
from ..wire.codec import pack_array, unpack
from ..wire.schema import Message, bounded
from .known import MAX_KNOWN, NONCE_BYTES, PROOF_BYTES, TAG_BYTES
from .records import Entry
from .routing import Contact

MAX_CONTACTS = 64
MAX_ENTRIES_PER_CALL = 4096
MAX_OFFERED = 8  # entries one offer may carry (an author offers its own new entry)


@dataclass(frozen=True)
class ContactMsg(Message, positional=True):
    peer: bytes = bounded(max_len=PEER_ID_BYTES)
    addr: str = bounded(max_len=300)

    @classmethod
    def of(cls, contact: Contact) -> ContactMsg:
        """The address says the contact's id only where it is another's (a relay's circuit): ``peer``
        says it already, and the id as text was 45 of a contact's 107 bytes, in every node lookup's
        replies (``to_contact`` puts it back)."""
        a = contact.address
        return cls(contact.peer_id.digest, a.plain if a.peer_id == contact.peer_id else str(a))

    def to_contact(self) -> Contact:
        """Raises ValueError when the contact is malformed."""
        peer = PeerID(self.peer)
        addr = PeerAddress.parse(self.addr)
        if addr.peer_id is not None and addr.peer_id != peer:
            raise ValueError("address names another peer")
        return Contact(peer, addr.with_peer(peer))


@dataclass(frozen=True)
class PingReq(Message, positional=True):
    sender: ContactMsg | None = None


@dataclass(frozen=True)
class PingResp(Message, positional=True):
    observed_host: str = bounded("", max_len=64)


@dataclass(frozen=True)
class FindNodeReq(Message, positional=True):
    target: bytes = bounded(max_len=PEER_ID_BYTES)
    sender: ContactMsg | None = None


@dataclass(frozen=True)
class NodesResp(Message, positional=True):
    contacts: tuple[ContactMsg, ...] = bounded((), max_len=MAX_CONTACTS)


@dataclass(frozen=True)
class FindValueReq(Message, positional=True):
    key_id: bytes = bounded(max_len=PEER_ID_BYTES)
    sender: ContactMsg | None = None
    # entries the reader holds, as tags; the replica leaves them out (see ``dht.known``)
    known: bytes = bounded(b"", max_len=MAX_KNOWN * TAG_BYTES)
    nonce: bytes = bounded(b"", max_len=NONCE_BYTES)
    # False: the reader asks replicas it knows (it stored there lately) and needs no nearer contacts
    contacts: bool = True


@dataclass(frozen=True)
class ValueResp(Message, positional=True):
    contacts: tuple[ContactMsg, ...] = bounded((), max_len=MAX_CONTACTS)
    held: bytes = bounded(b"", max_len=MAX_KNOWN // 8)  # which of the named entries the replica holds
    proof: bytes = bounded(b"", max_len=PROOF_BYTES)  # that it holds them


@dataclass(frozen=True)
class StoreReq(Message, positional=True):
    sender: ContactMsg | None = None


@dataclass(frozen=True)
class StoreResp(Message, positional=True):
    stored: int = bounded(0, ge=0, le=MAX_ENTRIES_PER_CALL)
    refused: tuple[str, ...] = bounded((), max_len=MAX_ENTRIES_PER_CALL)


@dataclass(frozen=True)
class OfferReq(Message, positional=True):
    """An author's new entries for a key the receiver reads (``dht.known``); they ride in the body."""


@dataclass(frozen=True)
class OfferResp(Message, positional=True):
    taken: int = bounded(0, ge=0, le=MAX_OFFERED)


@dataclass(frozen=True)
class PullReq(Message, positional=True):
    """A reader asks a fellow reader of a key for the entries it holds and the asker lacks (``known``:
    the tags of those the asker holds, see ``dht.known``); they ride in the reply body."""

    key_id: bytes = bounded(max_len=PEER_ID_BYTES)
    known: bytes = bounded(b"", max_len=MAX_KNOWN * TAG_BYTES)


@dataclass(frozen=True)
class PullResp(Message, positional=True):
    """The entries ride in the body."""


@dataclass(frozen=True)
class DialBackReq(Message, positional=True):
    addr: str = bounded(max_len=300)


@dataclass(frozen=True)
class DialBackResp(Message, positional=True):
    reachable: bool = False
    reason: str = bounded("", max_len=512)


PING = Method("dht.ping", PingReq, PingResp)
FIND_NODE = Method("dht.find_node", FindNodeReq, NodesResp)
FIND_VALUE = Method("dht.find_value", FindValueReq, ValueResp)  # entries ride in the reply body
STORE = Method("dht.store", StoreReq, StoreResp)  # entries ride in the request body
DIAL_BACK = Method("dht.dial_back", DialBackReq, DialBackResp)
OFFER = Method("dht.offer", OfferReq, OfferResp)  # entries ride in the request body
PULL = Method("dht.pull", PullReq, PullResp)  # entries ride in the reply body


def encode_entries(entries: list[Entry]) -> bytes:
    data = pack_array([e.packed for e in entries])
    if len(data) > MAX_CHUNK:
        raise ValueError("too many entries for one message")
    return data


def decode_entries(body: bytes | memoryview) -> list[Entry]:
    """Validate a body of entries; RemoteProtocolError if the list itself is malformed."""
    if not body:
        return []
    obj = unpack(bytes(body), max_bytes=MAX_CHUNK)
    if not isinstance(obj, list) or len(obj) > MAX_ENTRIES_PER_CALL:
        raise RemoteProtocolError("entries must be a list of at most 4096")
    return [Entry.from_obj(x) for x in obj]


def parse_contacts(msgs: tuple[ContactMsg, ...]) -> list[Contact]:
    """Contacts from a response; malformed ones are skipped, not fatal."""
    out = []
    for m in msgs:
        try:
            out.append(m.to_contact())
        except ValueError:
            continue
    return out
