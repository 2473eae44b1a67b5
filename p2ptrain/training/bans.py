"""Bans the swarm publishes: this peer's own verdicts out, others' read and weighed.

Theory of operation: when this peer's auditor catches a peer (see ``averaging.auditor``), it publishes
its verdicts under the run's ban key (one owned subkey per accuser, signed); every ``BAN_READ_INTERVAL``
it reads everyone's and lets its auditor weigh them (``Auditor.weigh``). :class:`BanRecords` is a mixin
of :class:`~p2ptrain.training.collaborative.CollaborativeOptimizer`.
"""

from __future__ import annotations

import logging

import trio

from ..dht.records import owned_subkey, subkey_owner
from ..errors import P2PError, RemoteProtocolError
from ..identity import PEER_ID_BYTES, PeerID
from ..node import Node
from ..wire.codec import pack, unpack

log = logging.getLogger(__name__)

BAN_READ_INTERVAL = 10.0  # seconds between reads of the swarm's ban records
BAN_TTL = 3600.0
MAX_BANS_PUBLISHED = 64
MAX_BAN_REASON = 240


def _parse_bans(value: bytes) -> list[tuple[PeerID, str]]:
    """A peer's published verdicts: [[accused peer id, reason], ...]; malformed entries are skipped."""
    try:
        items = unpack(value)
    except RemoteProtocolError:
        return []
    out = []
    if isinstance(items, list):
        for item in items[:MAX_BANS_PUBLISHED]:
            if (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], bytes)
                and len(item[0]) == PEER_ID_BYTES
                and isinstance(item[1], str)
            ):
                out.append((PeerID(item[0]), item[1][:MAX_BAN_REASON]))
    return out


class BanRecords:
    """Publishing and reading the swarm's ban verdicts (a mixin)."""

    node: Node
    bans_key: bytes
    _nursery: trio.Nursery | None

    def _on_ban(self, peer: PeerID, reason: str) -> None:
        """Our auditor caught ``peer``: publish our verdicts (others weigh them, see ``Auditor.weigh``)."""
        assert self._nursery is not None
        self._nursery.start_soon(self._publish_bans)

    async def _publish_bans(self) -> None:
        auditor = self.node.averager.auditor
        verdicts = [[p.digest, auditor.banned[p][:MAX_BAN_REASON]] for p in sorted(auditor.own)][
            :MAX_BANS_PUBLISHED
        ]
        try:
            await self.node.dht.store(
                self.bans_key,
                pack(verdicts),
                ttl=BAN_TTL,
                subkey=owned_subkey(self.node.peer_id),
                sign=True,
                republish=True,
            )
        except P2PError as e:
            log.warning("could not publish our bans: %s", e)

    async def _read_bans(self) -> None:
        try:
            entries = await self.node.dht.get(self.bans_key, quorum=3)
        except P2PError as e:
            log.info("could not read ban records: %s", e)
            return
        accusations: dict[PeerID, list[tuple[PeerID, str]]] = {}
        for subkey, entry in entries.items():
            accuser = subkey_owner(subkey)
            if accuser is not None:
                accusations[accuser] = _parse_bans(entry.value)
        for peer in self.node.averager.auditor.weigh(accusations):
            log.warning("adopted the swarm's ban of %s", peer.short())
