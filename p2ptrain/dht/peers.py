"""The run's peer list: one owner-signed DHT subkey per member.

Each member publishes, under the key ``p2ptrain/<run id>/peers`` (or its bucket's key of it, where the
run spreads the list: below), a subkey that only it may write
(:func:`~p2ptrain.dht.records.owned_subkey`), holding its addresses, whether others can dial it, its
advertised throughput and when it published; it publishes a fresh one every ``announce_ttl / 3``
seconds (so "published" says when it was last heard of), and a member that stops cleanly overwrites its
entry with one that says it ``left`` (a later expiry wins), which readers skip. Readers verify every
signature (the DHT does) and decode each value against the schema below, skipping anything malformed.

A list every member writes and every member reads whole costs each reader every entry once per
``announce_ttl / 3`` (each entry is new that often), O(N) bytes a second, and the key's few replicas
O(N^2), however seldom each reader reads (a read brings every entry changed since the last). A run of
many peers spreads the list over ``buckets`` keys (``dht.spread``; the node's ``peer_list_buckets``,
the run's ``progress.buckets``): each member writes under its own bucket's key, a node reads its own
bucket's (the members near it, ``N / buckets`` of them), and a tool that lists the whole run reads
every bucket once (``p2ptrain peers ADDR --buckets``). An entry counts only under its owner's
bucket's key (``SpreadKey.owned``), so no id lists itself in another bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import RemoteProtocolError
from ..identity import PeerID
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded
from .records import owned_subkey
from .service import DHT
from .spread import SpreadKey, bucket_of


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
    """The run's peer list's key as it always was (one bucket)."""
    return f"p2ptrain/{run_id}/peers".encode()


def peer_list(run_id: str, buckets: int = 1) -> SpreadKey:
    """The run's peer list spread over ``buckets`` keys (a power of 2; 1: the one key, ``peers_key``)."""
    if buckets < 1 or buckets & (buckets - 1):
        raise ValueError(f"a peer list spreads over a power of 2 of keys, not {buckets}")
    return SpreadKey.of(f"p2ptrain/{run_id}/peers", buckets.bit_length() - 1)


async def announce(dht: DHT, run_id: str, record: PeerRecord, *, ttl: float, buckets: int = 1) -> int:
    """Publish (and keep re-publishing) our entry in the run's peer list, under our bucket's key;
    returns replicas reached."""
    return await dht.store(
        peer_list(run_id, buckets).key_of(dht.peer_id),
        pack(record.to_obj()),
        ttl=ttl,
        subkey=owned_subkey(dht.peer_id),
        sign=True,
        republish=True,
    )


async def withdraw(dht: DHT, run_id: str, *, now: float, ttl: float, buckets: int = 1) -> int:
    """Overwrite our entry in the run's peer list with one that says we left (``ttl``: at least the
    announced entry's, so that its later expiry wins everywhere), and stop re-publishing it."""
    key = peer_list(run_id, buckets).key_of(dht.peer_id)
    dht.unpublish(key, owned_subkey(dht.peer_id))
    record = PeerRecord(reachable=False, published=now, left=True)
    return await dht.store(key, pack(record.to_obj()), ttl=ttl, subkey=owned_subkey(dht.peer_id), sign=True)


async def list_members(
    dht: DHT, run_id: str, *, quorum: int = 3, buckets: int = 1, near: PeerID | None = None
) -> list[Member]:
    """The run's members as the swarm knows them (signatures verified, malformed entries skipped): those
    of every bucket of a list spread over ``buckets`` keys, or only those of ``near``'s bucket (a node's
    own part of the list: one key read). An entry under another bucket's key than its owner's is left
    out."""
    spread = peer_list(run_id, buckets)
    wanted = range(len(spread.keys)) if near is None else [bucket_of(near.digest, spread.bits)]
    read = {}
    for b in wanted:  # (one at a time: a tool's read of a large run's list, never a node's)
        read[spread.keys[b]] = await dht.get(spread.keys[b], quorum=quorum)
    members = []
    for owner, entry in spread.owned(read).values():
        try:
            record = PeerRecord.from_obj(unpack(entry.value))
        except RemoteProtocolError:
            continue
        if not record.left:
            members.append(Member(owner, record, entry.expiry))
    members.sort(key=lambda m: m.peer_id)
    return members
