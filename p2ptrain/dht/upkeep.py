"""Joining and keeping up: a DHT node's bootstrap and its maintenance loop.

Theory of operation: a node joins through the addresses it was given (and the peers it remembers from
an earlier run): it pings them, asks them to dial it back where it finds out its reachability (see
:mod:`~p2ptrain.dht.reachability`), and looks up its own id, which fills its routing table and puts it
in the tables of the peers near it. Join peers that do not answer are tried again with capped backoff,
for as long as it takes: a node whose join peers are down still starts, and :attr:`Upkeep.bootstrapped`
is set once it has joined. Where a join peer answered "busy" (its inbound slots full: a passing
refusal, ``errors.passing``), they are tried again every ``BUSY_RETRY`` seconds at most, not on the
backoff for peers that are down, which grows to 30 s: a full node turns an idle connection over for a
newcomer about once a second (``net.admission``), and at 128 simulated peers with 48 slots a node the
late joiners waited out the long backoff (the slowest joined 32 and 66 s after they started, one never
in 80 s). A refused try costs the refusing node a lingering socket of bounded count (``net.linger``).

Maintenance every ``maintenance_interval``: remember the contacts known (to bootstrap again from when
the table runs empty, as it does when every peer left or the link went down), ask for a dial-back again
when one is due, expire records, re-publish this node's own, refresh stale buckets with lookups of
random ids in them, and push the records held to the closest peers (they may have joined since).

:class:`Upkeep` owns the join addresses and the ``bootstrapped`` event; it is handed the parts it
keeps up (contacts, reachability, records) and those it acts through (client, reader, writer).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import trio

from ..errors import P2PError, passing
from ..net.address import PeerAddress
from .client import Client
from .config import DHTConfig
from .contacts import Contacts
from .reachability import Reachability
from .reads import Reader
from .records import RecordStore
from .routing import Contact
from .writes import Writer

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

BUSY_RETRY = 2.0  # the longest wait between joins refused only "busy" (see the module docstring)


class Upkeep:
    """Bootstrap and maintenance (see the module docstring)."""

    def __init__(
        self,
        client: Client,
        contacts: Contacts,
        me: Reachability,
        reader: Reader,
        writer: Writer,
        records: RecordStore,
        *,
        config: DHTConfig,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._client = client
        self._contacts = contacts
        self._table = contacts.table
        self._me = me
        self._reader = reader
        self._writer = writer
        self._records = records
        self._config = config
        self._clock = clock
        self._rng = rng
        self._join: list[PeerAddress] = []  # the join addresses, to bootstrap again from
        self.bootstrapped = trio.Event()

    async def run(self, join: list[PeerAddress]) -> None:
        """Join through ``join`` (none: the swarm's first peer), then maintain until cancelled."""
        self._join = list(join)
        if join:  # (with the peers remembered from an earlier run: the join peers may be gone)
            await self.bootstrap([*join, *self._contacts.recent()], attempts=None)
        else:  # the swarm's first peer; one with remembered peers finds them in maintenance
            self.bootstrapped.set()
        await self._maintain()

    async def bootstrap(self, addresses: list[PeerAddress], *, attempts: int | None = 5) -> int:
        """Join through ``addresses``, retrying with capped backoff (``attempts=None``: until it works).

        Returns how many contacts we know. Until a peer has dialed us back, we stay client-only, so a
        node behind NAT never enters others' routing tables.
        """
        self._me.joining()
        delay, attempt = 0.5, 0
        while attempts is None or attempt < attempts:
            attempt += 1
            seeds, busy = await self._contact_seeds(addresses)
            if seeds:
                if self._me.finds_out:
                    await self._me.check(seeds)
                await self._reader.find_node(self._table.local.digest)
                log.info(
                    "DHT bootstrapped through %d peer(s): %d contacts known%s",
                    len(seeds),
                    len(self._table),
                    " (client-only)" if self._me.client_only else "",
                )
                self.bootstrapped.set()
                return len(self._table)
            wait = min(delay, BUSY_RETRY) if busy else delay
            said = " (busy)" if busy else ""
            log.info("DHT: no join address answered yet%s; retrying in %.1f s", said, wait)
            await trio.sleep(wait * self._rng.uniform(0.8, 1.2))
            delay = min(delay * 2, 30.0)
        level = logging.INFO if attempts == 1 else logging.WARNING  # (a retry in maintenance: said quietly)
        log.log(level, "DHT bootstrap failed: none of %d address(es) answered", len(addresses))
        return len(self._table)

    async def _contact_seeds(self, addresses: list[PeerAddress]) -> tuple[list[Contact], bool]:
        """The join addresses that answer a ping, as contacts (added to the routing table), and whether
        one answered with a passing refusal ("busy": ``errors.passing``), alive and soon to admit us."""
        seeds: list[Contact] = []
        busy: list[PeerAddress] = []

        async def one(addr: PeerAddress) -> None:
            try:
                contact, observed_host = await self._client.hello(addr)
            except (P2PError, trio.TooSlowError) as e:
                log.debug("join address %s did not answer: %s", addr, e)
                if passing(e):
                    busy.append(addr)
                return
            self._me.seen_at(observed_host)
            seeds.append(contact)
            self._table.observe(contact, self._clock())

        async with trio.open_nursery() as nursery:
            for addr in addresses:
                nursery.start_soon(one, addr)
        return seeds, bool(busy)

    async def _maintain(self) -> None:
        last_refresh = last_replicate = self._clock()
        while True:
            await trio.sleep(self._config.maintenance_interval)
            now = self._clock()
            self._contacts.note_known()
            await self._me.recheck(self._table, now)
            if not len(self._table) and (recent := [*self._join, *self._contacts.recent()]):
                # Out of contacts (every peer we knew left, or our link went down): a swarm that comes
                # back, at a join address or at an address we knew, is found again.
                await self.bootstrap(recent, attempts=1)
            self._records.expire(now)
            await self._writer.republish(now)
            if now - last_refresh >= self._config.refresh_interval:
                last_refresh = now
                await self._refresh(now)
            if now - last_replicate >= self._config.replicate_interval:
                last_replicate = now
                await self._writer.replicate()

    async def _refresh(self, now: float) -> None:
        """Look up a random id in each bucket nobody was heard from lately."""
        for index in self._table.stale_buckets(now, self._config.refresh_interval):
            await self._reader.find_node(self._table.random_id_in_bucket(index, self._rng))
