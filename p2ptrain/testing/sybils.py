"""Attacks by many free identities from one host, for the hostile-peers benchmark (``adversary.install``).

The attacking node trains (or pretends to) as usual and, besides its own id, mints ``SYBILS`` fresh keys
in memory: they never open a connection of their own. It writes DHT records signed by them (the DHT checks
that the owner of a subkey signed it, not who carried it), so to every honest peer they are as many more
peers, all on the attacker's address. With ``install(kind, opt)`` (for a node:
``adversary.install(kind, averager, trainer=)``):

- ``sybil-majority``: the node stops training and holds a state whose every parameter's sign is flipped,
  claimed as the state of the honest peers' current step (it follows them); it and its fresh keys publish
  records of that step with that state's digest (a majority of the records on the honest step), and it
  serves that state. None of them joins a group: they also raise the group size every peer waits for;
- ``fake-progress``: the node trains honestly; its fresh keys publish records of the honest step that
  claim 2**53 samples at 1e9 samples/s (the most a record may say);
- ``dht-flood``: the node trains honestly; ``FLOOD_IDS`` fresh keys store day-long 16 KiB records under
  the run's progress key and the matchmaking keys of the next steps, again every few seconds (more than
  a key holds);
- ``conn-flood``: the node trains honestly and keeps ``CONN_FLOOD`` silent TCP connections open to every
  honest peer it sees in the records, from its own address, reopening those that are closed;
- ``group-capture``: the node trains honestly and runs ``SYBILS`` more (client-only) nodes under fresh
  keys, from its own address; at each of the honest peers' steps they ask for places in the groups
  first, each contributing ``CAPTURE_SCALE`` in every coordinate (a step far off the honest ones);
- ``trust-farm``: the node trains honestly and runs ``SYBILS`` more (client-only) nodes under fresh
  keys, from its own address; each publishes records of the node's step (so that leaders gather places
  for them) and puts zeros with a weight of one into ``FARM_ROUNDS`` of the honest peers' rounds (no
  work, nothing to refuse), hoping to be trusted for it. Then the node flips the sign
  of its every parameter, claims that state as step ``FAR`` and serves it, and every fresh key
  publishes records of step ``FAR`` with that state's digest and the node's address.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import trio

from ..dht.records import key_id, make_entry, owned_subkey
from ..errors import P2PError
from ..identity import Identity
from ..net.address import PeerAddress
from ..node import Node
from ..training.optimizer.progress import ProgressRecord
from ..wire.codec import pack

if TYPE_CHECKING:
    from ..training.optimizer import CollaborativeOptimizer

log = logging.getLogger(__name__)

KINDS = ("sybil-majority", "fake-progress", "dht-flood", "conn-flood", "group-capture", "trust-farm")
SYBILS = 8  # fresh identities per attacking host
FLOOD_IDS = 64  # 64 x 16 KiB: more than the 768 KiB a DHT key holds
FLOOD_TTL = 24 * 3600.0
FLOOD_STEPS = 4  # matchmaking keys of this many steps ahead are filled too
CONN_FLOOD = 600  # silent connections per honest peer (more than a node's 512 inbound)
CAPTURE_SCALE = 100.0
FARM_ROUNDS = 4  # rounds each fresh key of a trust-farm puts zeros into before the lie
FAR = 1_000_000  # the step a trust-farm claims
REPORT_EVERY = 30.0
EVERY = 1.0  # seconds between two rounds of forged records (about the honest peers' progress interval)


@dataclass
class Attack:
    """What the attack has cost so far (logged by the attacking node every ``REPORT_EVERY`` seconds)."""

    kind: str
    keys: int = 0  # identities minted
    stores: int = 0  # records the DHT's replicas accepted (one per replica)
    bytes: int = 0  # bytes of records sent (values and signatures, once per store call)
    connections: int = 0  # TCP connections opened
    places: int = 0  # rounds a fresh key contributed to (group-capture)
    ids: list[Identity] = field(default_factory=list, repr=False)
    _reported: float = field(default=0.0, repr=False)

    def mint(self, n: int) -> list[Identity]:
        minted = [Identity.generate() for _ in range(n)]
        self.keys += n
        self.ids += minted
        return minted

    def report(self, now: float) -> None:
        if now - self._reported >= REPORT_EVERY:
            self._reported = now
            log.warning(
                "attack %s so far: %d keys, %d records stored (%d bytes sent), %d connections",
                self.kind,
                self.keys,
                self.stores,
                self.bytes,
                self.connections,
            )


def install(kind: str, opt: CollaborativeOptimizer) -> Attack:
    """Make the node of ``opt`` attack with many identities (see the module docstring); the attack
    starts with its first call to ``opt.step``. Returns its running costs."""
    if kind not in KINDS:
        raise ValueError(f"unknown attack {kind!r}; known: {', '.join(KINDS)}")
    costs = Attack(kind)
    if kind == "sybil-majority":
        _hold_forged_state(opt, costs)
    attack = {
        "sybil-majority": _majority,
        "fake-progress": _fake_progress,
        "dht-flood": _flood_dht,
        "conn-flood": _flood_connections,
        "group-capture": _capture_groups,
        "trust-farm": _farm_trust,
    }[kind]
    step = opt.step
    started = False

    async def first_step(samples: int) -> bool:  # the background attack starts with training
        nonlocal started
        if not started:
            started = True
            assert opt.nursery is not None
            opt.nursery.start_soon(attack, opt, costs)
        return await step(samples)

    opt.step = first_step  # type: ignore[method-assign]
    return costs


def honest_epoch(opt: CollaborativeOptimizer, costs: Attack) -> int:
    """The step most honest peers' records are on (this node's own when it sees none)."""
    ours = {opt.node.peer_id, *(who.peer_id for who in costs.ids)}
    epochs = sorted(p.record.epoch for p in opt.records if p.peer not in ours)
    return epochs[len(epochs) // 2] if epochs else opt.epoch


async def publish_as(
    opt: CollaborativeOptimizer, costs: Attack, who: Identity, key: bytes, value: bytes, ttl: float
) -> None:
    """Store ``value`` under ``key`` in ``who``'s owned subkey, signed by ``who``, from this node (a
    refused store is counted as nothing: the attack goes on)."""
    entry = make_entry(key, value, opt.clock() + ttl, subkey=owned_subkey(who.peer_id), signer=who)
    costs.bytes += len(entry.value) + len(entry.signature or b"")
    try:
        costs.stores += await opt.node.dht.writer.store_entries(key_id(key), [entry])
    except P2PError as e:
        log.debug("a store was refused: %s", e)
    costs.report(opt.clock())


async def _publish_records(
    opt: CollaborativeOptimizer, costs: Attack, ids: list[Identity], record: ProgressRecord
) -> None:
    value = pack(record.to_obj())
    async with trio.open_nursery() as nursery:
        for who in ids:
            key = opt.board.key_of(who.peer_id)  # (its own bucket's: a record under another is not read)
            nursery.start_soon(publish_as, opt, costs, who, key, value, opt.config.progress.ttl)


def flip(opt: CollaborativeOptimizer) -> None:
    """Flip the sign of every parameter this node holds (its outer copy too): a forged state."""
    with torch.no_grad():
        for p in opt.params:
            p.neg_()
        for g in opt.global_params if opt.diloco else ():
            g.neg_()
    opt.release_outer()


def _hold_forged_state(opt: CollaborativeOptimizer, costs: Attack) -> None:
    """The node trains no more and holds a sign-flipped state, claimed for the honest peers' step."""
    flipped = False

    async def step(samples: int) -> bool:
        nonlocal flipped
        if not flipped:
            flip(opt)
        target = honest_epoch(opt, costs)
        if target != opt.epoch or not flipped:
            flipped = True
            opt.tally.set_epoch(target)
            opt.state_changed()  # hashed, served and published as the state of the honest step
        await trio.sleep(0.2)
        return False

    opt.step = step  # type: ignore[method-assign]


async def _majority(opt: CollaborativeOptimizer, costs: Attack) -> None:
    ids = costs.mint(SYBILS)
    while True:
        await _publish_records(opt, costs, ids, opt.record())  # the forged state's digest, served here
        await trio.sleep(EVERY)


async def _fake_progress(opt: CollaborativeOptimizer, costs: Attack) -> None:
    ids = costs.mint(SYBILS)
    while True:
        record = ProgressRecord(
            epoch=honest_epoch(opt, costs),
            samples=2**53,
            rate=1e9,
            time=opt.clock(),
            digest=opt.digest,
            addr="",
            run=opt.fingerprint,
            since=opt.clock(),
        )
        await _publish_records(opt, costs, ids, record)
        await trio.sleep(EVERY)


async def _flood_dht(opt: CollaborativeOptimizer, costs: Attack) -> None:
    ids = costs.mint(FLOOD_IDS)
    limit = opt.node.dht.config.limits.max_value
    junk = os.urandom(limit - 64)  # a value as large as a record may be, once packed and signed
    mode = opt.config.training.mode
    while True:
        epoch = honest_epoch(opt, costs)
        groups = opt.node.averager.groups
        # (the next steps' matchmaking keys: one set for all of them where the run spreads its keys)
        looks = dict.fromkeys(
            k for e in range(epoch, epoch + FLOOD_STEPS) for k in groups.keys(f"{mode}-{e}").keys
        )
        keys = [*opt.board.keys, *looks]
        for key in keys:  # one store after the other: the flood's rate is what the replicas take
            for who in ids:
                await publish_as(opt, costs, who, key, junk, FLOOD_TTL)
        await trio.sleep(5 * EVERY)


async def _flood_connections(opt: CollaborativeOptimizer, costs: Attack) -> None:
    source = opt.node.config.source_address
    flooded: set[tuple[str, int]] = set()
    async with trio.open_nursery() as nursery:
        while True:
            for p in opt.records:
                if p.peer == opt.node.peer_id or not p.record.addr:
                    continue
                try:
                    addr = PeerAddress.parse(p.record.addr)
                except ValueError:
                    continue
                if (addr.host, addr.port) not in flooded:
                    flooded.add((addr.host, addr.port))
                    for _ in range(CONN_FLOOD):
                        nursery.start_soon(_hold_silent, costs, addr.host, addr.port, source)
            costs.report(opt.clock())
            await trio.sleep(5 * EVERY)


async def _hold_silent(costs: Attack, host: str, port: int, source: str | None) -> None:
    """One connection that never says a word, opened again whenever the peer closes it."""
    while True:
        try:
            stream = await trio.open_tcp_stream(host, port, local_address=source)
        except OSError:
            await trio.sleep(5 * EVERY)  # refused (or out of ports): try again later
            continue
        costs.connections += 1
        async with stream:
            try:
                while await stream.receive_some(4096):
                    pass  # whatever it says (its handshake), we say nothing
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.sleep(EVERY)


def _fresh_nodes(opt: CollaborativeOptimizer, costs: Attack) -> list[Node]:
    """``SYBILS`` client-only nodes under fresh keys, their connections leaving from this node's address."""
    config = opt.node.config
    config = dataclasses.replace(
        config,
        listen=(),
        join=tuple(opt.node.addresses[:1]) or config.join,
        announce_host=None,
        announce_port=None,
        status_file=None,
        peer_cache=None,
        metrics=None,
        host=dataclasses.replace(config.host, work=None),
        averaging=opt.node.averager.config,  # (the run's rules, as the node follows them)
    )
    transport = opt.node.host.transport  # (their connections leave from the node's address)
    return [Node(who, config, transport=transport, clock=opt.clock) for who in costs.mint(SYBILS)]


async def _capture_groups(opt: CollaborativeOptimizer, costs: Attack) -> None:
    async with trio.open_nursery() as nursery:
        for node in _fresh_nodes(opt, costs):
            await nursery.start(node.run)
            costs.connections += 1
            nursery.start_soon(_ask_for_places, node, opt, costs)
        while True:
            costs.report(opt.clock())
            await trio.sleep(REPORT_EVERY)


async def _farm_trust(opt: CollaborativeOptimizer, costs: Attack) -> None:
    nodes = _fresh_nodes(opt, costs)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            await nursery.start(node.run)
            costs.connections += 1
        addr = str(opt.node.averager.address())  # (with this node's id: the fresh keys name it)
        async with trio.open_nursery() as counted:
            # The keys publish records of the node's step meanwhile: a leader gathers a place for each
            # (a stranger holds no place of a peer the leader counts, see ``matchmaking``).
            counted.start_soon(_publish_as_node, opt, costs, addr)
            async with trio.open_nursery() as farming:  # zeros into FARM_ROUNDS rounds per key, at once
                for node in nodes:
                    farming.start_soon(_ask_for_places, node, opt, costs, 0.0, FARM_ROUNDS)
            counted.cancel_scope.cancel()
        claim_far(opt)
        await _publish_as_node(opt, costs, addr)  # (now of step FAR, with the forged state's digest)


async def _publish_as_node(opt: CollaborativeOptimizer, costs: Attack, addr: str) -> None:
    """The fresh keys' records, every ``EVERY``: the node's own as it is each time, under every key."""
    while True:
        record = dataclasses.replace(opt.record(), addr=addr, time=opt.clock())
        await _publish_records(opt, costs, costs.ids, record)
        await trio.sleep(EVERY)


def claim_far(opt: CollaborativeOptimizer) -> None:
    """From now on the node trains no more and holds a sign-flipped state, claimed as step ``FAR``."""
    flip(opt)
    opt.tally.set_epoch(FAR)
    opt.state_changed()  # hashed, served and published as the state of step FAR

    async def step(samples: int) -> bool:
        await trio.sleep(0.2)
        return False

    opt.step = step  # type: ignore[method-assign]


async def _ask_for_places(
    node: Node,
    opt: CollaborativeOptimizer,
    costs: Attack,
    scale: float = CAPTURE_SCALE,
    rounds: int | None = None,
) -> None:
    """One fresh key: a place in the group of every step the swarm reaches (``rounds`` of them at most),
    asked for as soon as it is reached (before the honest peers, which first compute their share of the
    batch), contributing ``scale`` in every coordinate."""
    mode, asked, placed = opt.config.training.mode, -1, 0
    while rounds is None or placed < rounds:
        epoch = max(opt.epoch, honest_epoch(opt, costs))
        if epoch == asked:
            await trio.sleep(EVERY / 10)
            continue
        asked = epoch
        poison = [torch.full(t.shape, scale, dtype=t.dtype) for t in opt.averaged.tensors]
        weight = max(1.0, float(opt.samples))  # (no more than the node's own: a bigger claim is left out)
        try:
            timeout = opt.config.averaging.timeout
            await node.averager.average(poison, weight=weight, timeout=timeout, group_key=f"{mode}-{epoch}")
            costs.places += 1
            placed += 1
        except P2PError as e:
            log.debug("a fresh key got no place in step %d's group: %s", epoch, e)
