"""Bans the swarm publishes: this peer's provable verdicts out, others' read and re-checked.

Theory of operation: when this peer's auditor convicts a reducer (see ``averaging.auditor``), it keeps
the proof and publishes the accusation under the run's ban key (one owned subkey per accuser, signed):
where to ask for the proof (the accuser's address) and, per accused peer, the round and partition.
Where the run spreads its keys (``dht.spread``), an accusation goes under the key of the *accused's*
bucket (an accuser writes one record per bucket it accuses peers of), and counts only there. In a run
that audits its rounds (only those convict), every ``BAN_READ_INTERVAL`` it reads the ban keys of the
buckets whose peers it may average with (a split swarm's region's, at its step and the next; every
key with one region: ``ProgressBoard.ban_buckets``) and lets its auditor examine the accusations it
has not seen: fetch the proof from the accuser and re-check it, banning the accused if it convicts and
the accuser if it does not (``Auditor.examine``). Read whole, the ban keys were ``B`` lookups a peer a
read, O(N) as the buckets grow with the swarm; a peer needs the verdicts on the peers it meets, and
those are in the few keys it reads. Nothing is adopted because of who, or how many, published it.
Proofs are fetched one at a time, at most
``MAX_EXAMINED_PER_READ`` per read: each can be as large as one partition's slices of every
contributor. :class:`BanBook` owns the reads and the examinations under way; the averager's auditor calls
:meth:`BanBook.on_ban` (handed to it in the run's ``RoundPolicy``) when it convicts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from ...averaging.auditor import Accusation
from ...dht.records import Entry, owned_subkey, subkey_owner
from ...dht.spread import SpreadKey
from ...errors import P2PError, RemoteProtocolError
from ...identity import PEER_ID_BYTES, PeerID
from ...node import Node
from ...wire.codec import pack, unpack

log = logging.getLogger("p2ptrain.training.bans")  # (its lines, as before)

# Seconds between reads of the swarm's ban records: those that meet a convicted reducer next, its
# round's members, are told at once (``averaging.auditor``); the rest ban it when they read, or when their
# own round with it is audited.
BAN_READ_INTERVAL = 30.0
BAN_TTL = 3600.0
MAX_BANS_PUBLISHED = 64
MAX_BAN_REASON = 240
MAX_EXAMINED_PER_READ = 2
ROUND_BYTES = 16
SETTLED = ("convicted", "false accusation")  # examinations that banned someone (said out loud)


def _parse_bans(value: bytes) -> tuple[str, list[Accusation]]:
    """An accuser's record: {"addr": where to fetch proofs, "bans": [[accused, reason, round, partition],
    ...]}; malformed entries are skipped (a record of the older form, without proofs, holds none)."""
    try:
        doc = unpack(value)
    except RemoteProtocolError:
        return "", []
    if not isinstance(doc, dict) or not isinstance(doc.get("addr"), str) or len(doc["addr"]) > 300:
        return "", []
    items = doc.get("bans")
    out = []
    for item in items[:MAX_BANS_PUBLISHED] if isinstance(items, list) else ():
        if (
            isinstance(item, list)
            and len(item) == 4
            and isinstance(item[0], bytes)
            and len(item[0]) == PEER_ID_BYTES
            and isinstance(item[1], str)
            and isinstance(item[2], bytes)
            and len(item[2]) == ROUND_BYTES
            and type(item[3]) is int
            and 0 <= item[3] < 64
        ):
            out.append(Accusation(PeerID(item[0]), item[1][:MAX_BAN_REASON], item[2], item[3]))
    return doc["addr"], out


class BanBook:
    """Publishing and reading the swarm's ban verdicts."""

    def __init__(self, node: Node, bits: int = 0) -> None:
        """``bits``: the records spread over ``2^bits`` keys, each accuser's under its bucket's, all
        read (``dht.spread``; the run's ``progress.buckets``), so that no key's replicas serve every
        peer's read of every record."""
        self.node = node
        self.spread = SpreadKey.of(f"p2ptrain/{node.config.run_id}/bans", bits)
        self.key = self.spread.key_of(node.peer_id)  # where accusations of this peer go
        self._examining = False  # an examination of published bans runs
        self._published: set[bytes] = set()  # the keys our accusations are published (republished) under
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the publications and examinations, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def on_ban(self, peer: PeerID, reason: str) -> None:
        """Our auditor convicted ``peer``: publish our accusations (others re-check their proofs)."""
        assert self._nursery is not None
        self._nursery.start_soon(self._publish_bans)

    async def _publish_bans(self) -> None:
        auditor = self.node.averager.auditor
        if self.node.dht.client_only:
            log.info("client-only: nobody can fetch our proofs, so our bans stay ours")
            return
        accusations = list(auditor.accusations.values())[-MAX_BANS_PUBLISHED:]
        addr = str(self.node.dht.advertised_address())
        by_key: dict[bytes, list[list[object]]] = {}
        for a in accusations:  # (each under its accused's bucket's key)
            by_key.setdefault(self.spread.key_of(a.accused), []).append(
                [a.accused.digest, a.reason[:MAX_BAN_REASON], a.round, a.partition]
            )
        # A key whose accusations all fell out of the last ``MAX_BANS_PUBLISHED`` gets a record that
        # accuses nobody there, not re-published (it expires with the old one's TTL): re-published as it
        # was, its old accusations stood there for as long as this peer ran.
        records = {key: pack({"addr": addr, "bans": bans}) for key, bans in by_key.items()}
        stale = self._published - records.keys()
        self._published = set(records)
        subkey = owned_subkey(self.node.peer_id)
        for key in stale:
            self.node.dht.unpublish(key, subkey)
            records[key] = pack({"addr": addr, "bans": []})
        for key, value in records.items():
            try:
                await self.node.dht.store(
                    key, value, ttl=BAN_TTL, subkey=subkey, sign=True, republish=key not in stale
                )
            except P2PError as e:
                log.warning("could not publish our bans: %s", e)

    async def read(self, buckets: Iterable[int] | None = None) -> None:
        """Read the ban records of ``buckets`` (every bucket's: None); examine (in the background) the
        accusations not seen yet."""
        read: dict[bytes, dict[bytes, Entry]] = {}
        keys = self.spread.keys if buckets is None else [self.spread.keys[b] for b in sorted(set(buckets))]

        async def get(key: bytes) -> None:
            try:
                read[key] = await self.node.dht.get(key, quorum=3)
            except P2PError as e:
                log.info("could not read ban records: %s", e)

        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(get, key)
        auditor = self.node.averager.auditor
        todo: list[tuple[PeerID, str, Accusation]] = []
        # (an accusation counts only under its accused's bucket's key, in a record its accuser signed)
        for key, held in read.items():
            for subkey, entry in held.items():
                accuser = subkey_owner(subkey)
                if accuser is None:
                    continue
                addr, accusations = _parse_bans(entry.value)
                for a in accusations:
                    case = (accuser, a.accused, a.round, a.partition)
                    if (
                        self.spread.key_of(a.accused) == key
                        and case not in auditor.examined
                        and not {accuser, a.accused} & auditor.banned.keys()
                    ):
                        todo.append((accuser, addr, a))
        if todo and not self._examining and self._nursery is not None:
            self._examining = True  # in the background: a proof may take a while to fetch
            self._nursery.start_soon(self._examine, todo[:MAX_EXAMINED_PER_READ])

    async def _examine(self, todo: list[tuple[PeerID, str, Accusation]]) -> None:
        try:
            for accuser, addr, accusation in todo:
                outcome = await self.node.averager.auditor.examine(accuser, addr, accusation)
                level = logging.WARNING if outcome in SETTLED else logging.INFO
                what = (accuser.short(), accusation.accused.short(), outcome)
                log.log(level, "examined %s's accusation of %s: %s", *what)
        finally:
            self._examining = False
