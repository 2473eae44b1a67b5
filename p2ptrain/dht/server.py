"""The DHT's incoming calls: what this node answers each Kademlia RPC with.

Theory of operation: every handler first learns from the call (:meth:`~p2ptrain.dht.contacts.Contacts.
heard_from`: a caller whose contact checks out joins the routing table), then answers from what this
node holds, bounded and checked as :mod:`~p2ptrain.dht.protocol` and :mod:`~p2ptrain.dht.records` say:

- ``PING`` answers the address the call came from (a node behind a NAT learns what peers see it at);
- ``FIND_NODE`` the ``k`` closest contacts to a 32-byte target (never the asker itself);
- ``FIND_VALUE`` the entries held under a key, less those the reader proves it holds (see
  :mod:`~p2ptrain.dht.known`), with the nearest contacts where asked;
- ``STORE`` takes entries as a replica, each checked and counted against its sender's quotas and its
  origin's share of the key, and only where this node serves (a client-only one holds no records);
- ``OFFER`` takes entries an author pushes to its readers (at most ``OFFERS_PER_MINUTE`` a minute from
  one peer: the rest are answered 0, and reads find them), as the reader would take a read;
- ``PULL`` the entries of a key this node reads or holds as a replica, less those the asker names (a
  fellow reader's pull, see :meth:`~p2ptrain.dht.reads.Reader.pull`);
- ``DIAL_BACK`` dials the asker at the address it names, only its own and only on the host the request
  came from (else this node would dial anyone an attacker names).

Replies that carry entries or contacts (``FIND_NODE``, ``FIND_VALUE``, ``PULL``) are charged to the
asker's origin (:class:`~p2ptrain.net.slots.ReplyBudget`): a read asks in a hundred bytes for up to a
full key's, so ids from one subnet could otherwise spend this node's uplink on them at will. And the
node's replies in all are held to a share of its uplink (:func:`reply_total`), shared max-min among the
origins asking, so that k origins do not take k origins' worth. An origin out of tokens is answered
``busy``, which readers take as "ask another replica", not as a failure.

A reader of a hot key may :meth:`Server.watch` it: whenever an entry under it arrives here (stored as
a replica, or offered by its author), its callback runs, so that it hears of a new record without
polling. :class:`Server` owns those callbacks and the offer rates.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable

from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.channel import MAX_CHUNK
from ..net.host import Host
from ..net.rpc import CallContext, Reply
from ..net.slots import ReplyBudget
from .config import DHTConfig
from .contacts import Contacts
from .known import answer, lacking
from .protocol import (
    MAX_OFFERED,
    ContactMsg,
    DialBackReq,
    DialBackResp,
    FindNodeReq,
    FindValueReq,
    NodesResp,
    OfferReq,
    OfferResp,
    PingReq,
    PingResp,
    PullReq,
    PullResp,
    StoreReq,
    StoreResp,
    ValueResp,
    decode_entries,
    encode_entries,
)
from .reachability import Reachability
from .reads import Reader
from .records import RecordRefused, RecordStore, key_id, origin_of

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

CONTACT_BYTES = 64  # about what a contact takes in a reply (its id and an address: 61 B at IPv4)
OFFERS_PER_MINUTE = 120  # offers taken from one peer (the rest are answered 0: reads find them)
MAX_OFFERING_PEERS = 1024


REPLY_TOTAL = 4e6  # a node's reply bytes a second in all while its uplink is not measured
REPLY_SHARE = 0.5  # the share of a measured uplink a node's replies may take in all
REPLY_FLOOR = 512e3  # ... but never less than this (reads of the keys it holds must go on)


def reply_total(uplink: float) -> float:
    """The most reply bytes a second a node sends in all, for an ``uplink`` of that many bytes a second
    (0: not measured yet)."""
    return REPLY_TOTAL if uplink <= 0 else max(REPLY_FLOOR, REPLY_SHARE * uplink)


class Server:
    """The handlers of the DHT's RPCs (see the module docstring)."""

    def __init__(
        self,
        host: Host,
        contacts: Contacts,
        me: Reachability,
        reader: Reader,
        records: RecordStore,
        *,
        config: DHTConfig,
        clock: Callable[[], float],
        uplink: Callable[[], float],
    ) -> None:
        """``uplink``: this node's uplink in bytes a second as measured, 0 while it is not."""
        self._host = host
        self._contacts = contacts
        self._me = me
        self._reader = reader
        self._records = records
        self._config = config
        self._clock = clock
        self._offers: OrderedDict[PeerID, deque[float]] = OrderedDict()  # when each peer last offered
        self._watch: dict[bytes, Callable[[], None]] = {}  # key id -> called when an entry arrives
        # reply bytes per origin and in all (reads' entries and contacts)
        self.replies = ReplyBudget(total=lambda: reply_total(uplink()))

    def watch(self, key: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever an entry under ``key`` arrives here (stored as a replica, or offered
        by its author)."""
        self._watch[key_id(key)] = callback

    def _arrived(self, kids: set[bytes]) -> None:
        for kid in kids:
            if (callback := self._watch.get(kid)) is not None:
                callback()

    async def on_ping(self, ctx: CallContext, req: PingReq) -> PingResp:
        self._contacts.heard_from(ctx, req.sender)
        return PingResp("" if ctx.relayed else ctx.remote_host[:64])  # (through a relay: the relay's)

    async def on_find_node(self, ctx: CallContext, req: FindNodeReq) -> NodesResp:
        origin = self._afford(ctx)
        self._contacts.heard_from(ctx, req.sender)
        near = self._nodes_near(req.target, ctx.peer)
        self.replies.charge(origin, CONTACT_BYTES * len(near.contacts), self._clock())
        return near

    def _afford(self, ctx: CallContext) -> str:
        """The caller's origin, once its reply budget is checked (``busy`` while it is spent)."""
        origin = origin_of(ctx.remote_host)
        self.replies.check(origin, self._clock())
        return origin

    def _nodes_near(self, target: bytes, asker: PeerID) -> NodesResp:
        if len(target) != 32:
            raise RemoteProtocolError("target must be 32 bytes")
        close = self._contacts.table.closest(target, self._config.k, exclude={asker})
        return NodesResp(tuple(ContactMsg.of(c) for c in close))

    async def on_find_value(self, ctx: CallContext, req: FindValueReq) -> Reply[ValueResp]:
        origin = self._afford(ctx)
        self._contacts.heard_from(ctx, req.sender)
        entries = self._records.get(req.key_id, self._clock())
        send, held, proof = answer(entries, req.known, req.nonce)
        near = self._nodes_near(req.key_id, ctx.peer).contacts if req.contacts else ()
        body = encode_entries(send)
        self.replies.charge(origin, len(body) + CONTACT_BYTES * len(near), self._clock())
        return Reply(ValueResp(near, held, proof), body)

    async def on_store(self, ctx: CallContext, req: StoreReq) -> StoreResp:
        self._contacts.heard_from(ctx, req.sender)
        if not self._me.serving:
            return StoreResp(0, ("this peer is client-only and holds no records",))
        now, stored, refused, keys = self._clock(), 0, [], set()
        for entry in decode_entries(ctx.body):
            try:
                self._records.put(entry, now, ctx.peer, origin_of(ctx.remote_host))
                stored += 1
                keys.add(key_id(entry.key))
            except RecordRefused as e:
                refused.append(e.reason[:200])
        self._arrived(keys)
        if refused:
            log.info("refused %d record(s) from %s: %s", len(refused), ctx.peer.short(), refused[0])
        return StoreResp(stored, tuple(refused[:64]))

    async def on_offer(self, ctx: CallContext, req: OfferReq) -> OfferResp:
        """Entries of a key this node reads, pushed by their authors (see ``Reader.offered``), at a
        bounded rate per peer."""
        now = self._clock()
        recent = self._offers.pop(ctx.peer, None) or deque()
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        self._offers[ctx.peer] = recent
        while len(self._offers) > MAX_OFFERING_PEERS:
            self._offers.popitem(last=False)
        if len(recent) >= OFFERS_PER_MINUTE:
            return OfferResp(0)
        recent.append(now)
        entries = decode_entries(ctx.body)
        if len(entries) > MAX_OFFERED:
            raise RemoteProtocolError(f"an offer carries at most {MAX_OFFERED} entries")
        took = self._reader.offered(ctx.peer, entries, now)
        for kid in took:
            self._arrived({kid})
        return OfferResp(len(took))

    async def on_pull(self, ctx: CallContext, req: PullReq) -> Reply[PullResp]:
        """A fellow reader's pull: what this node holds of the key (read, offered, or held as a replica)
        that the asker does not name, newest first, as much as half a reply holds."""
        origin = self._afford(ctx)
        entries = self._reader.serving(req.key_id, self._clock())
        body = encode_entries(lacking(entries, req.known, MAX_CHUNK // 2))
        self.replies.charge(origin, len(body), self._clock())
        return Reply(PullResp(), body)

    async def on_dial_back(self, ctx: CallContext, req: DialBackReq) -> DialBackResp:
        try:
            addr = PeerAddress.parse(req.addr)
        except ValueError as e:
            return DialBackResp(False, f"bad address: {e}")
        if addr.peer_id != ctx.peer:
            return DialBackResp(False, "the address must carry the asker's own peer id")
        if addr.kind in ("ip4", "ip6") and addr.host != ctx.remote_host:
            return DialBackResp(False, "dial-back only to the host the request came from")
        try:
            await self._host.probe(addr, timeout=self._config.rpc_timeout)
        except P2PError as e:
            return DialBackResp(False, str(e)[:500])
        return DialBackResp(True, "reachable")
