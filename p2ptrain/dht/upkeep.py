"""Joining and keeping up: a DHT node's bootstrap, its reachability checks, and its maintenance loop.

Functions of a :class:`~p2ptrain.dht.service.DHT` (its ``run`` and ``bootstrap`` call them). Until a peer
has dialed a node back at its advertised address, the node stays client-only, so one behind a NAT never
enters others' routing tables. Maintenance every ``maintenance_interval``: remember the contacts seen
(to bootstrap again from when the table runs empty), ask for a dial-back again now and then, expire
records, re-publish this node's own, refresh stale buckets, and push the records held to the closest
peers (they may have joined since).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

import trio

from ..errors import P2PError
from ..identity import PeerID
from ..net.address import PeerAddress
from .protocol import DIAL_BACK, PING, DialBackReq, PingReq
from .records import Entry, RecordRefused, key_id, origin_of
from .routing import Contact

if TYPE_CHECKING:
    from .service import DHT

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

MAX_SEEN = 32  # recently known contacts kept to bootstrap from when the table runs empty
RECHECK_EVERY = 600.0  # seconds between two dial-back checks of this node's reachability


async def bootstrap(dht: DHT, addresses: list[PeerAddress], *, attempts: int | None = 5) -> int:
    """Join through ``addresses``, retrying with capped backoff (``attempts=None``: until it works).

    Returns how many contacts we know. Until a peer has dialed us back, we stay client-only, so a
    node behind NAT never enters others' routing tables.
    """
    if dht.config.client_only is None:
        dht.client_only = True
    delay, attempt = 0.5, 0
    while attempts is None or attempt < attempts:
        attempt += 1
        seeds = await contact_seeds(dht, addresses)
        if seeds:
            if dht.config.client_only is None:
                await check_reachability(dht, seeds)
            await dht.find_node(dht.peer_id.digest)
            log.info(
                "DHT bootstrapped through %d peer(s): %d contacts known%s",
                len(seeds),
                len(dht.table),
                " (client-only)" if dht.client_only else "",
            )
            dht.bootstrapped.set()
            return len(dht.table)
        log.info("DHT: no join address answered yet; retrying in %.1f s", delay)
        await trio.sleep(delay * dht.rng.uniform(0.8, 1.2))
        delay = min(delay * 2, 30.0)
    level = logging.INFO if attempts == 1 else logging.WARNING  # (a retry in maintenance: said quietly)
    log.log(level, "DHT bootstrap failed: none of %d address(es) answered", len(addresses))
    return len(dht.table)


async def contact_seeds(dht: DHT, addresses: list[PeerAddress]) -> list[Contact]:
    seeds: list[Contact] = []

    async def one(addr: PeerAddress) -> None:
        try:
            with trio.fail_after(dht.config.rpc_timeout):
                conn = await dht.host.connect(addr)
                resp = await conn.call(PING, PingReq(dht._sender()), timeout=dht.config.rpc_timeout)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("join address %s did not answer: %s", addr, e)
            return
        if resp.observed_host.isprintable():  # (what a peer says: it goes into a log line)
            dht.observed_host = resp.observed_host or dht.observed_host
        contact = Contact(conn.peer, addr.with_peer(conn.peer))
        seeds.append(contact)
        dht.table.observe(contact, dht.clock())

    async with trio.open_nursery() as nursery:
        for addr in addresses:
            nursery.start_soon(one, addr)
    return seeds


def askers(dht: DHT, n: int) -> list[Contact]:
    """Up to ``n`` contacts to ask for a dial-back, the closest to our id first, one per origin: ids
    are free and those near ours cheap, so the ids of one host could otherwise be every peer asked
    and say no (one "yes" is enough: one honest origin among those asked decides)."""
    askers, origins = [], set()
    for c in dht.table.closest(dht.peer_id.digest, len(dht.table)):
        if (origin := origin_of(c.address.host)) not in origins:
            origins.add(origin)
            askers.append(c)
            if len(askers) == n:
                break
    return askers


async def check_reachability(dht: DHT, seeds: list[Contact]) -> None:
    """Ask up to three peers to dial this node back at its advertised address; unless one could,
    run client-only (nobody adds us to a routing table, we hold no records)."""
    dht._recheck_at = dht.clock() + RECHECK_EVERY
    try:
        if not dht.host.listen_addresses:
            dht.client_only, dht.reachable = True, False
            return
        mine = str(dht.advertised_address())
        answered = 0
        for seed in seeds[:3]:
            try:
                conn = await dht.host.connect(seed.address)
                resp = await conn.call(DIAL_BACK, DialBackReq(mine), timeout=2 * dht.config.rpc_timeout)
            except P2PError:
                continue
            answered += 1
            if resp.reachable:
                dht.client_only, dht.reachable = False, True
                return
            log.info("%s could not dial us back at %s: %s", seed.peer_id.short(), mine, resp.reason)
        if not answered and dht.reachable is not None:
            return  # nobody to ask just now: a re-check changes nothing
        dht.client_only, dht.reachable = True, False
        seen = f" (peers see it at {dht.observed_host})" if dht.observed_host else ""
        log.warning(
            "no peer can dial %s%s: behind a NAT or a firewall, this node runs as a client-only "
            "peer (queries and stores go through others; it holds no records for the swarm), and "
            "others reach it through a relay (the address it prints); to make it a full peer, forward "
            "a port to it and start it with --announce",
            mine,
            seen,
        )
    finally:
        dht.reachability_checked.set()


async def maintain(dht: DHT) -> None:
    last_refresh = last_replicate = dht.clock()
    while True:
        await trio.sleep(dht.config.maintenance_interval)
        now = dht.clock()
        for c in dht.table.contacts():
            dht._seen[c.peer_id] = c.address
            dht._seen.move_to_end(c.peer_id)
        while len(dht._seen) > MAX_SEEN:
            dht._seen.popitem(last=False)
        if dht.config.client_only is None and len(dht.table) and now >= dht._recheck_at:
            # The swarm's first peer has nobody to ask at its start: it asks the first peers it
            # meets. Every node asks again now and then: a router's mapping comes and goes.
            dht._recheck_at = now + RECHECK_EVERY
            await check_reachability(dht, askers(dht, 3))
        if not len(dht.table) and (dht._join or dht._seen):
            # Out of contacts (every peer we knew left, or our link went down): a swarm that comes
            # back, at a join address or at an address we knew, is found again.
            await bootstrap(dht, [*dht._join, *dht.recent_contacts()], attempts=1)
        dht.records.expire(now)
        await republish(dht, now)
        if now - last_refresh >= dht.config.refresh_interval:
            last_refresh = now
            await refresh(dht, now)
        if now - last_replicate >= dht.config.replicate_interval:
            last_replicate = now
            await replicate(dht)


async def republish(dht: DHT, now: float) -> None:
    for (key, subkey), pub in list(dht._published.items()):
        if now >= pub.next_at:
            pub.next_at = now + dht.config.republish_interval
            try:
                await dht.store(key, pub.value, ttl=pub.ttl, subkey=subkey, sign=pub.sign)
            except RecordRefused as e:
                log.warning("cannot re-publish %r: %s", key[:40], e.reason)


async def refresh(dht: DHT, now: float) -> None:
    for index in dht.table.stale_buckets(now, dht.config.refresh_interval):
        await dht.find_node(dht.table.random_id_in_bucket(index, dht.rng))


async def replicate(dht: DHT) -> None:
    """Push every record we hold to the closest peers we know (they may have joined since)."""
    batches: defaultdict[PeerID, list[Entry]] = defaultdict(list)
    contacts: dict[PeerID, Contact] = {}
    for entry in dht.records.all_entries(dht.clock()):
        for c in dht.table.closest(key_id(entry.key), dht.config.replication):
            batches[c.peer_id].append(entry)
            contacts[c.peer_id] = c
    async with trio.open_nursery() as nursery:
        for peer, entries in batches.items():
            for i in range(0, len(entries), 256):
                nursery.start_soon(dht._push, contacts[peer], entries[i : i + 256])
