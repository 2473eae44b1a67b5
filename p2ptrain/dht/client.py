"""The DHT's outgoing calls: each Kademlia RPC this node sends, one peer at a time.

Theory of operation: every call here dials (or reuses) a connection to one peer, sends one request and
returns its answer, all within ``rpc_timeout``; a failure raises (``P2PError`` or ``trio.TooSlowError``)
for the caller to count against that peer, except where noted. Nothing here decides what to ask or
whom: lookups, reads and stores do (:mod:`~p2ptrain.dht.reads`, :mod:`~p2ptrain.dht.writes`).

A request carries this node's contact (its id and dialable address) so that the callee can add it to
its routing table; that is about 150 bytes, on every store and read. So :class:`Client` remembers which
contact each peer last answered a call that carried it (``_told``), and leaves it out of calls to that
peer for ``SENDER_REFRESH`` seconds after: in between, a call from a known peer refreshes it in the
callee's table as it is. Pings and join calls always carry it.

A query also says which contact the connection itself proved (:func:`proven_contact`: the address we
dialed, where the handshake found that peer), since the connection may be one dialed elsewhere and a
contact's claimed address is hearsay.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import trio

from ..errors import P2PError
from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.connection import Connection
from ..net.host import Host
from .known import NONCE_BYTES, held_entries
from .protocol import (
    FIND_NODE,
    FIND_VALUE,
    OFFER,
    PING,
    PULL,
    STORE,
    ContactMsg,
    FindNodeReq,
    FindValueReq,
    OfferReq,
    PingReq,
    PullReq,
    StoreReq,
    StoreResp,
    decode_entries,
    encode_entries,
    parse_contacts,
)
from .reachability import Reachability
from .records import Entry
from .routing import Contact

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

# A node tells a peer its contact (id and address, about 150 bytes) on its first call, then again once
# this long has passed or its address changed: in between, a call from a known peer refreshes it as is.
SENDER_REFRESH = 60.0
MAX_TOLD = 4096


class Answer(NamedTuple):
    """What one query brought back."""

    contacts: list[Contact]  # the peer's nearest contacts to the target (hearsay)
    entries: list[Entry]  # the entries it sent (value queries; unverified)
    held: bool  # whether it proved it holds some of the entries the query named as known
    proven: Contact | None  # the contact the connection proved (see ``proven_contact``)
    remote: str  # the address the connection runs to, whatever the contact claimed


def proven_contact(conn: Connection) -> Contact | None:
    """The contact a connection proves: the address we dialed, where the handshake found that peer.

    An accepted connection proves no address the peer can be dialed at.
    """
    if not conn.outbound:
        return None
    return Contact(conn.peer, PeerAddress.for_host(conn.remote_host, conn.remote_port, conn.peer))


class Client:
    """This node's side of the DHT's RPCs (see the module docstring)."""

    def __init__(
        self,
        host: Host,
        me: Reachability,
        *,
        rpc_timeout: float,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._host = host
        self._me = me
        self._timeout = rpc_timeout
        self._clock = clock
        self._rng = rng
        self._told: OrderedDict[PeerID, tuple[str, float]] = OrderedDict()  # our contact, as last sent

    def _sender_for(self, peer: PeerID) -> ContactMsg | None:
        """Our contact for a call to ``peer``, or None where it has it: it answered a call that carried
        this very contact less than ``SENDER_REFRESH`` ago (see ``_told_to``)."""
        sender = self._me.sender()
        told = self._told.get(peer)
        if sender is None or told is None or told[0] != sender.addr:
            return sender
        return None if self._clock() - told[1] < SENDER_REFRESH else sender

    def _told_to(self, peer: PeerID, sender: ContactMsg | None) -> None:
        """``peer`` answered a call that carried ``sender``."""
        if sender is not None:
            self._told.pop(peer, None)
            self._told[peer] = (sender.addr, self._clock())
            while len(self._told) > MAX_TOLD:
                self._told.popitem(last=False)

    async def ping(self, contact: Contact) -> bool:
        """Whether ``contact`` answers a ping (never raises)."""
        try:
            with trio.fail_after(self._timeout):
                conn = await self._host.connect(contact.address)
                await conn.call(PING, PingReq(self._me.sender()), timeout=self._timeout)
        except (P2PError, trio.TooSlowError):
            return False
        return True

    async def hello(self, addr: PeerAddress) -> tuple[Contact, str]:
        """Ping a join address: the contact it proved to be (its id, as the handshake found it, at
        ``addr``), and the address it says our call came from."""
        with trio.fail_after(self._timeout):
            conn = await self._host.connect(addr)
            resp = await conn.call(PING, PingReq(self._me.sender()), timeout=self._timeout)
        return Contact(conn.peer, addr.with_peer(conn.peer)), resp.observed_host

    async def query(
        self,
        contact: Contact,
        target: bytes,
        value: bool,
        known: list[Entry],
        tags: bytes,
        nearest: bool = True,
    ) -> Answer:
        """Ask ``contact`` for the nodes nearest ``target`` or (``value``) for its entries under the key
        id ``target``, telling it which entries we hold already (``known``, named by their ``tags``),
        so that it proves it holds those instead of sending them. ``nearest``: whether a value query
        asks for the nearest contacts too."""
        held = False
        with trio.fail_after(self._timeout):
            conn = await self._host.connect(contact.address)
            sender = self._sender_for(conn.peer)
            if value:
                nonce = self._rng.randbytes(NONCE_BYTES) if known else b""
                reply = await conn.call_with_body(
                    FIND_VALUE,
                    FindValueReq(target, sender, tags, nonce, nearest),
                    timeout=self._timeout,
                )
                entries = decode_entries(reply.body)
                contacts = parse_contacts(reply.message.contacts)
                held = bool(held_entries(known, reply.message.held, reply.message.proof, nonce))
            else:
                req = FindNodeReq(target, sender)
                resp = await conn.call(FIND_NODE, req, timeout=self._timeout)
                entries, contacts = [], parse_contacts(resp.contacts)
        self._told_to(conn.peer, sender)
        return Answer(contacts, entries, held, proven_contact(conn), conn.remote_host)

    async def store(self, contact: Contact, entries: list[Entry]) -> StoreResp:
        """Ask ``contact`` to hold ``entries`` as a replica; its answer says how many it took, and why
        it refused the others."""
        with trio.fail_after(self._timeout):
            conn = await self._host.connect(contact.address)
            sender = self._sender_for(conn.peer)
            resp = await conn.call(
                STORE, StoreReq(sender), body=encode_entries(entries), timeout=self._timeout
            )
            self._told_to(conn.peer, sender)
        return resp

    async def pull(self, addr: PeerAddress, kid: bytes, tags: bytes) -> list[Entry]:
        """Ask a fellow reader of the key ``kid`` for the entries it holds that we lack (we hold those
        named by ``tags``); unchecked: the caller checks each (see ``Reader.pull``)."""
        with trio.fail_after(self._timeout):
            conn = await self._host.connect(addr)
            reply = await conn.call_with_body(PULL, PullReq(kid, tags), timeout=self._timeout)
        return decode_entries(reply.body)

    async def offer(self, addr: PeerAddress, entry: Entry) -> None:
        """Push our own new ``entry`` to a peer that reads its key (a failure is logged, not raised:
        an offer is a shortcut, and the peer reads the replicas anyway)."""
        try:
            with trio.fail_after(self._timeout):
                conn = await self._host.connect(addr)
                body = encode_entries([entry])
                await conn.call(OFFER, OfferReq(), body=body, timeout=self._timeout)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("offer to %s failed: %s", addr, e)
