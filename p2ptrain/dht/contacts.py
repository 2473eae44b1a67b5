"""Who this node knows: the routing table's driver, fed by the calls it gets and the answers it hears.

Theory of operation: the routing table (:mod:`~p2ptrain.dht.routing`, pure) decides who stays; this
object does what its decisions ask and keeps it fed. A peer that calls us is added at the contact it
tells (``heard_from``) only where that contact matches the authenticated connection: its id, and an
address on the host the call came from (or a circuit to it through a relay this node is connected to:
how a peer behind a NAT serves the DHT); a peer that tells nothing (it told us lately) is refreshed as
we know it. An answer to a lookup adds the contact the connection proved, never a claimed one
(``observe``). When a bucket is full the table asks us to ping its least-recently-seen contact before
evicting it: that ping runs in this object's own nursery (:meth:`run`), one per contact at a time.

It also remembers the peers known recently (``recent``, at most ``MAX_SEEN``, newest first, including
those a node saved from its last run: ``remember``), so that a node whose table runs empty can bootstrap
again from them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import trio

from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.host import Host
from ..net.rpc import CallContext
from .client import Client
from .protocol import ContactMsg
from .routing import Contact, RoutingTable

MAX_SEEN = 32  # recently known contacts kept to bootstrap from when the table runs empty


class Contacts:
    """The routing table and what keeps it up to date (see the module docstring)."""

    def __init__(
        self, table: RoutingTable, host: Host, client: Client, *, clock: Callable[[], float]
    ) -> None:
        self.table = table
        self._host = host
        self._client = client
        self._clock = clock
        self._pinging: set[PeerID] = set()
        self._nursery: trio.Nursery | None = None
        self._seen: OrderedDict[PeerID, PeerAddress] = OrderedDict()  # recently known contacts, newest last

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the pings the table asks for (before it evicts a contact) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                # The host may still serve calls, and they must not spawn into a closing nursery: trio
                # closes it when its last child ends, and other tasks run before this one resumes.
                self._nursery = None

    def heard_from(self, ctx: CallContext, sender: ContactMsg | None) -> None:
        """A peer called us, telling ``sender`` as its contact (None: it told us lately)."""
        if sender is None:  # (it told us its contact lately: refreshed as we know it)
            if (known := self.table.get(ctx.peer)) is not None:
                self.observe(known)
            return
        if sender.peer != ctx.peer.digest:
            return
        try:
            contact = sender.to_contact()
        except ValueError:
            return
        relay = contact.address.relay
        # A circuit to the caller through a peer this node is connected to (so a real peer, not a third
        # party an attacker names for others to dial) is taken unchecked: that relay passes nothing on
        # to a peer without a reservation there.
        circuit = (
            relay is not None
            and contact.address.peer_id == ctx.peer
            # (the relay itself takes a circuit through it from a peer holding a reservation there)
            and (
                self._host.connection(relay)
                or (relay == self._host.peer_id and self._host.relay.holds(ctx.peer))
            )
        )
        if contact.address.host != ctx.remote_host and contact.address.kind in ("ip4", "ip6") and not circuit:
            return  # claimed address is not where the call came from: not verified, not added
        self.observe(contact)

    def observe(self, contact: Contact) -> None:
        """``contact`` answered us, or called us at a verified address."""
        obs = self.table.observe(contact, self._clock())
        if obs.ping is not None and self._nursery is not None and obs.ping.peer_id not in self._pinging:
            self._pinging.add(obs.ping.peer_id)
            self._nursery.start_soon(self._ping_before_evict, obs.ping)

    def failed(self, peer: PeerID) -> None:
        """``peer`` failed a call at the address the table holds for it."""
        self.table.failed(peer, self._clock())

    async def _ping_before_evict(self, contact: Contact) -> None:
        try:
            alive = await self._client.ping(contact)
        finally:
            self._pinging.discard(contact.peer_id)
        self.table.ping_result(contact.peer_id, alive, self._clock())

    def note_known(self) -> None:
        """Remember the table's contacts as the peers known most recently."""
        for c in self.table.contacts():
            self._seen[c.peer_id] = c.address
            self._seen.move_to_end(c.peer_id)
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)

    def recent(self) -> list[PeerAddress]:
        """The addresses of the peers this node knows now and knew most recently (newest first; at most
        ``MAX_SEEN``), for a bootstrap."""
        now = {c.peer_id: c.address for c in self.table.contacts()}
        before = [a for p, a in reversed(self._seen.items()) if p not in now]
        return [*now.values(), *before][:MAX_SEEN]

    def remember(self, addresses: list[PeerAddress]) -> None:
        """Take ``addresses`` (newest first: a saved :meth:`recent`) as peers known recently. They go
        behind the peers this run has seen itself, in their order; an address that names no peer id,
        or this node's, is skipped."""
        for addr in addresses[:MAX_SEEN]:
            if (
                addr.peer_id is not None
                and addr.peer_id != self._host.peer_id
                and addr.peer_id not in self._seen
            ):
                self._seen[addr.peer_id] = addr
                self._seen.move_to_end(addr.peer_id, last=False)  # behind what this run has seen
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
