"""Whether peers can dial this node, and the contact it gives them for their routing tables.

Theory of operation: a node is a full DHT peer (it answers as a routing-table contact and holds
records) only where others can dial it. One that joins through others does not know that, so it asks
up to three of them, one per origin, to dial its advertised address back (``DIAL_BACK``); until one
could, it runs client-only: it sends no contact in its requests (so nobody adds it to a routing table)
and stores nothing for others, but it still looks up, stores and reads through the swarm. A router's
mapping comes and goes, so every node asks again every ``RECHECK_EVERY`` seconds; a re-check that
nobody answered says nothing about this node's address and changes nothing.

A node behind a NAT whose hole punching works may serve the DHT anyway at its relayed address
(``relayed_address``, handed in by the node that owns the relay reservation): peers reach it there
through the relay, and directly once they punched a hole to it. Without that, the peers behind NATs
would keep no record among themselves and could not go on as one swarm when the public peers leave.

:class:`Reachability` owns ``client_only`` and answers the question the rest of the DHT asks it: which
contact, if any, to tell a peer. What it finds out about the network (``reachable``, the address peers
see this node at) it reports into the host's ``Location`` (see ``net.location``), which hole punching
reads too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ..errors import P2PError
from ..net.address import PeerAddress
from ..net.host import Host
from .config import DHTConfig
from .protocol import DIAL_BACK, ContactMsg, DialBackReq
from .records import origin_of
from .routing import Contact, RoutingTable

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

RECHECK_EVERY = 600.0  # seconds between two dial-back checks of this node's reachability


def askers(table: RoutingTable, n: int) -> list[Contact]:
    """Up to ``n`` contacts to ask for a dial-back, the closest to our id first, one per origin: ids
    are free and those near ours cheap, so the ids of one host could otherwise be every peer asked
    and say no (one "yes" is enough: one honest origin among those asked decides)."""
    chosen, origins = [], set()
    for c in table.closest(table.local.digest, len(table)):
        if (origin := origin_of(c.address.host)) not in origins:
            origins.add(origin)
            chosen.append(c)
            if len(chosen) == n:
                break
    return chosen


class Reachability:
    """This node's reachability and the contact it tells peers (see the module docstring)."""

    def __init__(
        self,
        host: Host,
        config: DHTConfig,
        *,
        clock: Callable[[], float],
        relayed_address: Callable[[], PeerAddress | None] | None = None,
    ) -> None:
        self._host = host
        self._config = config
        self._clock = clock
        self._relayed_address = relayed_address or (lambda: None)
        self.client_only = bool(config.client_only)
        # Whether peers can dial this node at its advertised address: None until a peer was asked to
        # dial it back (at the bootstrap, or for the swarm's first peer once it knows a contact).
        self._location = host.location
        self._location.checking()  # (its ``checked`` is set after our first check, whatever it found)
        self._recheck_at = 0.0  # (the clock's) when to ask peers to dial us back again
        self._sender: tuple[tuple[object, ...], ContactMsg | None] | None = None  # (made of, the contact)

    @property
    def reachable(self) -> bool | None:
        return self._location.reachable

    @property
    def observed_host(self) -> str | None:
        """The address the last peer that answered a ping saw this node at."""
        return self._location.observed_host

    @property
    def checked(self) -> trio.Event:
        """Set after the first check, whatever it found."""
        return self._location.checked

    @property
    def finds_out(self) -> bool:
        """Whether this node learns its reachability by dial-backs (the setting left it open)."""
        return self._config.client_only is None

    def advertised_address(self) -> PeerAddress:
        return self._host.advertised_addresses()[0]

    def relayed_address(self) -> PeerAddress | None:
        return self._relayed_address()

    def my_contact(self) -> Contact | None:
        if not self._host.listen_addresses:
            return None
        if self.client_only:
            relayed = self._relayed_address()
            return None if relayed is None else Contact(self._host.peer_id, relayed)
        return Contact(self._host.peer_id, self.advertised_address())

    def sender(self) -> ContactMsg | None:
        """The contact a request carries (None: this node is no routing-table contact); built again
        only when what it is made of changed (every request carries it: building it parsed the host's
        addresses each time)."""
        host = self._host
        relayed = self._relayed_address() if self.client_only else None
        made_of = (
            self.client_only,
            relayed,
            tuple(host.listen_addresses),
            host.config.announce_host,
            host.config.announce_port,
        )
        if self._sender is None or self._sender[0] != made_of:
            me = self.my_contact()
            self._sender = (made_of, ContactMsg.of(me) if me else None)
        return self._sender[1]

    @property
    def serving(self) -> bool:
        """Whether this node holds records and answers as a routing-table contact: a reachable one, or
        one behind a NAT that can serve through its relayed address (see the module docstring)."""
        return not self.client_only or self._relayed_address() is not None

    def joining(self) -> None:
        """A join begins: until a peer has dialed it back, a node that finds out stays client-only, so
        one behind a NAT never enters others' routing tables."""
        if self.finds_out:
            self.client_only = True

    def seen_at(self, observed_host: str) -> None:
        """A peer that answered a ping saw this node's calls come from ``observed_host`` (what a peer
        says: printable text only, since it goes into a log line; empty: it did not say)."""
        self._location.seen_at(observed_host)

    async def recheck(self, table: RoutingTable, now: float) -> None:
        """Ask again when a re-check is due. The swarm's first peer has nobody to ask at its start: it
        asks the first peers it meets. Every node asks again now and then: a router's mapping comes and
        goes."""
        if self.finds_out and len(table) and now >= self._recheck_at:
            self._recheck_at = now + RECHECK_EVERY
            await self.check(askers(table, 3))

    async def check(self, seeds: list[Contact]) -> None:
        """Ask up to three peers to dial this node back at its advertised address; unless one could,
        run client-only (nobody adds us to a routing table, we hold no records)."""
        self._recheck_at = self._clock() + RECHECK_EVERY
        try:
            if not self._host.listen_addresses:
                self.client_only = True
                self._location.found(False)
                return
            mine = str(self.advertised_address())
            answered = 0
            for seed in seeds[:3]:
                try:
                    conn = await self._host.connect(seed.address)
                    resp = await conn.call(DIAL_BACK, DialBackReq(mine), timeout=2 * self._config.rpc_timeout)
                except P2PError:
                    continue
                answered += 1
                if resp.reachable:
                    self.client_only = False
                    self._location.found(True)
                    return
                log.info("%s could not dial us back at %s: %s", seed.peer_id.short(), mine, resp.reason)
            if not answered and self.reachable is not None:
                return  # nobody to ask just now: a re-check changes nothing
            self.client_only = True
            self._location.found(False)
            seen = f" (peers see it at {self.observed_host})" if self.observed_host else ""
            log.warning(
                "no peer can dial %s%s: behind a NAT or a firewall, this node runs as a client-only "
                "peer (queries and stores go through others; it holds no records for the swarm), and "
                "others reach it through a relay (the address it prints); to make it a full peer, forward "
                "a port to it and start it with --announce",
                mine,
                seen,
            )
        finally:
            self._location.checked.set()
