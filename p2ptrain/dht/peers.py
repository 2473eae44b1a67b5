"""The run's peer list: one owner-signed DHT subkey per member.

Each member publishes, under the key ``p2ptrain/<run id>/peers``, a subkey that only it may write
(:func:`~p2ptrain.dht.records.owned_subkey`), holding its addresses, whether others can dial it, its
advertised throughput and when it published; it publishes a fresh one every ``announce_ttl / 3``
seconds (so "published" says when it was last heard of), and a member that stops cleanly overwrites its
entry with one that says it ``left`` (a later expiry wins), which readers skip. Readers verify every
signature (the DHT does) and decode each value against the schema below, skipping anything malformed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RemoteProtocolError
from ..identity import PeerID
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded
from .records import owned_subkey, subkey_owner
from .service import DHT


@dataclass(frozen=True)
class PeerRecord(Message, positional=True):
    addresses: tuple[str, ...] = bounded((), max_len=8)
    reachable: bool = True
    throughput: float = bounded(0.0, ge=0.0, le=1e12)
    version: str = bounded("", max_len=32)
    published: float = bounded(0.0, ge=0.0)
    left: bool = False  # the member stopped cleanly: not a member any more


@dataclass(frozen=True)
class Member:
    peer_id: PeerID
    record: PeerRecord
    expiry: float


def peers_key(run_id: str) -> bytes:
    return f"p2ptrain/{run_id}/peers".encode()


async def announce(dht: DHT, run_id: str, record: PeerRecord, *, ttl: float) -> int:
    """Publish (and keep re-publishing) our entry in the run's peer list; returns replicas reached."""
    return await dht.store(
        peers_key(run_id),
        pack(record.to_obj()),
        ttl=ttl,
        subkey=owned_subkey(dht.peer_id),
        sign=True,
        republish=True,
    )


async def withdraw(dht: DHT, run_id: str, *, now: float, ttl: float) -> int:
    """Overwrite our entry in the run's peer list with one that says we left (``ttl``: at least the
    announced entry's, so that its later expiry wins everywhere), and stop re-publishing it."""
    dht.unpublish(peers_key(run_id), owned_subkey(dht.peer_id))
    record = PeerRecord(reachable=False, published=now, left=True)
    return await dht.store(
        peers_key(run_id), pack(record.to_obj()), ttl=ttl, subkey=owned_subkey(dht.peer_id), sign=True
    )


async def list_members(dht: DHT, run_id: str, *, quorum: int = 3) -> list[Member]:
    """The run's members as the swarm knows them (signatures verified, malformed entries skipped)."""
    entries = await dht.get(peers_key(run_id), quorum=quorum)
    members = []
    for subkey, entry in entries.items():
        owner = subkey_owner(subkey)
        if owner is None:
            continue
        try:
            record = PeerRecord.from_obj(unpack(entry.value))
        except RemoteProtocolError:
            continue
        if not record.left:
            members.append(Member(owner, record, entry.expiry))
    members.sort(key=lambda m: m.peer_id)
    return members
