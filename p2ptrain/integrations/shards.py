"""Disjoint data for the peers of a swarm: shards of a dataset claimed in the DHT.

Theory of operation. A dataset of ``size`` examples (any map-style dataset: a Hugging Face
``datasets.Dataset``, a list, a torch ``Dataset``) is cut into shards of ``shard_size`` consecutive
indices. The swarm reads the data in *passes*; in each pass every shard is read by one peer. A peer
takes a shard by publishing a claim (its owned subkey under the run's key for that pass, signed: only it
can write it) that names the shard and the shards it finished in this pass. To take the next shard it
reads the pass's claims and takes a free one: neither claimed nor finished by another peer, nor by
itself. Simultaneous claims of one shard are settled by reading again after publishing: the claim that
is older (then the smaller peer id) keeps it, the other peer takes another. A pass whose shards are all
claimed or finished is over for this peer, which goes on with the next pass (the order of the shards,
and of the examples in a shard, is shuffled per pass from the run's seed).

Restarts and joins. A peer keeps its pass, shard, position and finished shards in ``state_file``; with
the same identity (a node's data directory) its claim is its own, so it resumes where it stopped and
nobody else took its shard meanwhile (claims live ``CLAIM_TTL`` seconds and are renewed while read). A
peer that joins takes only free shards. A peer that leaves for good leaves its shard claimed until the
claim expires; then another takes it from the start (its examples may be read twice in that pass).

Identities are free: ``trusted`` (a callable giving the peers whose claims count, None for all) keeps
fresh keys that claim every shard from starving this peer (it then reads shards they claimed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import trio

from ..dht.records import Entry, owned_subkey, subkey_owner
from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..node import Node
from ..wire.codec import pack, unpack

log = logging.getLogger(__name__)

T = TypeVar("T")


class NodeHandle(Protocol):
    """A running node and a way to run its async functions from the thread that reads the data: a
    :class:`~p2ptrain.BackgroundNode`, or (inside ``p2ptrain node``) see :mod:`p2ptrain.integrations.data`."""

    @property
    def node(self) -> Node: ...

    def call(self, fn: Callable[[], Awaitable[T]]) -> T: ...


CLAIM_TTL = 600.0  # seconds a claim lives without renewal
RENEW = CLAIM_TTL / 4  # a claim older than this is published again
SAVE_EVERY = 64  # examples between two writes of the state file
BOOTSTRAP_WAIT = 60.0  # seconds a joiner waits to have joined the DHT before it reads claims
MAX_SHARDS = 100_000  # a claim carries its finished shards as a bitmap of at most 12.5 KB


@dataclass(frozen=True)
class Claim:
    peer: PeerID
    shard: int  # -1: none
    since: float
    done: frozenset[int]


def _bitmap(shards: Collection[int], n: int) -> bytes:
    bits = bytearray((n + 7) // 8)
    for s in shards:
        bits[s // 8] |= 1 << (s % 8)
    return bytes(bits)


def _unbitmap(bits: bytes, n: int) -> frozenset[int]:
    return frozenset(s for s in range(min(n, len(bits) * 8)) if bits[s // 8] >> (s % 8) & 1)


class SwarmShards:
    """The dataset indices this peer reads, pass after pass, disjoint from the other peers'.

    The dataset is cut into shards that the peers claim in the DHT, so that in each pass every shard is
    read by one peer. Iterate it (forever) or hand
    [`sampler()`][p2ptrain.integrations.SwarmShards.sampler] to a ``DataLoader``.

    Args:
        node: A running node and a way to run its async functions from the thread that reads the data
            (a ``BackgroundNode``).
        size: The number of examples in the dataset.
        shard_size: Examples per shard.
        seed: Orders the shards and the examples in each (the same on every peer).
        state_file: Where this peer keeps its place, so that a restarted peer resumes in the shard it
            held (its claim stays its own for 10 minutes without renewal).
        trusted: The peers whose claims count (None: every peer's).
        clock: The time source (tests).

    Raises:
        ValueError: The dataset or a shard holds no example, or there are more than 100,000 shards.
    """

    def __init__(
        self,
        node: NodeHandle,
        size: int,
        *,
        shard_size: int = 1024,
        seed: int = 0,
        state_file: str | Path | None = None,
        trusted: Callable[[], Collection[PeerID] | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if size <= 0 or shard_size <= 0:
            raise ValueError("the dataset and its shards must hold at least one example")
        self.node, self.size, self.shard_size, self.seed = node, size, shard_size, seed
        self.shards = (size + shard_size - 1) // shard_size
        if self.shards > MAX_SHARDS:
            raise ValueError(f"{self.shards} shards: at most {MAX_SHARDS} (use larger shards)")
        self.me = node.node.peer_id
        self.trusted = trusted
        self.clock = clock
        self.state_file = Path(state_file) if state_file is not None else None
        self.pass_no, self.shard, self.offset, self.done = 0, -1, 0, set[int]()
        self._since = 0.0
        self._published = -RENEW
        self._load()

    # ---- what a loop uses ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        unsaved = 0
        while True:
            if self.shard < 0:
                self._take()
            order = self._order(self.shard)
            while self.offset < len(order):
                index = order[self.offset]
                self.offset += 1
                unsaved += 1
                if unsaved >= SAVE_EVERY:
                    unsaved = 0
                    self._save()
                if self.clock() - self._published >= RENEW:
                    self._publish()
                yield index
            self.done.add(self.shard)
            self.shard, self.offset = -1, 0

    def sampler(self) -> torch.utils.data.Sampler[int]:
        """A sampler over these indices, for a ``DataLoader``.

        Returns:
            A ``torch.utils.data.Sampler``, endless: give the loop a step limit.
        """
        return _Sampler(self)

    # ---- claims ---------------------------------------------------------------------------------------

    def _key(self) -> bytes:
        return f"p2ptrain/{self.node.node.config.run_id}/shards/{self.pass_no}".encode()

    def _take(self) -> None:
        """Claim a free shard of the current pass (or of the next ones)."""
        while True:
            claims = self._claims()
            taken = {c.shard for c in claims} | {s for c in claims for s in c.done}
            free = [s for s in self._shard_order() if s not in taken and s not in self.done]
            if not free:
                log.info("pass %d of the data is read: next pass", self.pass_no)
                self.pass_no, self.done = self.pass_no + 1, set()
                continue
            # among the first few free shards by this peer's own draw: peers that join together rarely
            # reach for the same one
            pick = free[random.Random(self.me.digest + bytes([len(free) % 256])).randrange(min(len(free), 8))]
            self.shard, self.offset, self._since = pick, 0, self.clock()
            self._publish()
            rivals = [
                c
                for c in self._claims()
                if c.shard == pick and (c.since, c.peer.digest) < (self._since, self.me.digest)
            ]
            if not rivals:
                self._save()
                return
            self.shard = -1  # an older claim holds it: take another

    def _claims(self) -> list[Claim]:
        """The other peers' live claims of this pass that count (see ``trusted``)."""
        dht = self.node.node.dht

        async def read() -> dict[bytes, Entry]:
            with trio.move_on_after(BOOTSTRAP_WAIT):  # a joiner reads the swarm's claims, not an empty DHT
                await dht.bootstrapped.wait()
            return await dht.get(self._key(), quorum=3)

        try:
            entries = self.node.call(read)
        except P2PError as e:
            log.info("could not read the data claims: %s", e)
            return []
        trusted = self.trusted() if self.trusted is not None else None
        out = []
        for subkey, entry in entries.items():
            peer = subkey_owner(subkey)
            if peer is None or peer == self.me or (trusted is not None and peer not in trusted):
                continue
            try:
                obj = unpack(entry.value)
                shard, since, done = int(obj["shard"]), float(obj["since"]), bytes(obj["done"])
            except (RemoteProtocolError, KeyError, TypeError, ValueError):
                continue
            if -1 <= shard < self.shards:
                out.append(Claim(peer, shard, since, _unbitmap(done, self.shards)))
        return out

    def _publish(self) -> None:
        self._published = self.clock()
        value = pack({"shard": self.shard, "since": self._since, "done": _bitmap(self.done, self.shards)})
        key = self._key()
        try:
            self.node.call(
                lambda: self.node.node.dht.store(
                    key, value, ttl=CLAIM_TTL, subkey=owned_subkey(self.me), sign=True
                )
            )
        except P2PError as e:
            log.info("could not publish the data claim: %s", e)

    # ---- orders and the state file -------------------------------------------------------------------

    def _rng(self, *parts: int) -> random.Random:
        tag = json.dumps([self.seed, self.size, self.shard_size, *parts]).encode()
        return random.Random(hashlib.blake2b(tag, digest_size=8).digest())

    def _shard_order(self) -> list[int]:
        order = list(range(self.shards))
        self._rng(self.pass_no).shuffle(order)
        return order

    def _order(self, shard: int) -> list[int]:
        order = list(range(shard * self.shard_size, min((shard + 1) * self.shard_size, self.size)))
        self._rng(self.pass_no, shard).shuffle(order)
        return order

    def _save(self) -> None:
        if self.state_file is None:
            return
        data = {
            "size": self.size,
            "shard_size": self.shard_size,
            "pass": self.pass_no,
            "shard": self.shard,
            "offset": self.offset,
            "since": self._since,
            "done": sorted(self.done),
        }
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.state_file)

    def _load(self) -> None:
        if self.state_file is None or not self.state_file.exists():
            return
        try:
            data = json.loads(self.state_file.read_text())
            if (data["size"], data["shard_size"]) != (self.size, self.shard_size):
                log.warning("%s is for another dataset or shard size: starting afresh", self.state_file)
                return
            self.pass_no, self.shard, self.offset = int(data["pass"]), int(data["shard"]), int(data["offset"])
            self._since, self.done = float(data["since"]), {int(s) for s in data["done"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("cannot read %s (%s): starting afresh", self.state_file, e)


class _Sampler(torch.utils.data.Sampler[int]):
    def __init__(self, shards: SwarmShards) -> None:
        self.shards = shards

    def __iter__(self) -> Iterator[int]:
        return iter(self.shards)
