"""DHT-only at scale: N real DHT nodes (a Host and a DHT each, the node's own code and defaults) over
the message-level in-memory network, on the virtual clock.

Nodes join in waves of ``wave`` at once, each through the seed and a random node that joined before it,
and each waits until it bootstrapped. Then ``keys`` keys are stored, each by a random node; a tenth of the
nodes is killed (``--kill``: connections reset, nothing said); then each key is read by a random live
node. A store succeeds when a replica took it, a get when it returns the stored value. Lookup hops are
what the nodes' lookups counted (``Reader.recent_lookups``: the chain of answers that led to the
closest peer reached).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import trio
import trio.testing

from p2ptrain.dht import DHT, DHTConfig
from p2ptrain.dht.records import owned_subkey
from p2ptrain.dht.spread import bucket_of
from p2ptrain.errors import P2PError
from p2ptrain.identity import Identity
from p2ptrain.net import Host, PeerAddress
from p2ptrain.net.messages import MessageNetwork
from p2ptrain.training.optimizer.buckets import progress_key
from simulations.scale.heap import few_collections
from simulations.scale.model import World, pct
from simulations.scale.scheduling import seeded_scheduling

PORT = 1000


@dataclass(frozen=True)
class DhtSpec:
    nodes: int
    keys: int = 200
    kill: float = 0.1
    wave: int = 32
    seed: int = 0
    hot_key: float = 0.0  # virtual seconds of the one-key progress workload (0: none; see hot_key)
    # > 0: waves join this many virtual seconds apart, each node running the one-key workload from its
    # join on (as training peers do), for ``hot_key`` seconds after the last join (see ``growing``)
    grow: float = 0.0
    # > 0: the one-key workload as the progress board runs it, each node with this many partners
    # (see ``hot_key``); ``pulls``: each read pulls from a partner first
    partners: int = 0
    pulls: bool = False
    # > 1: the records spread over this many keys (a power of 2), each node's under its bucket's
    # (``optimizer.buckets``), and every read reads all of them
    buckets: int = 1
    # virtual seconds the workload runs before its bytes are counted: every node's first read of a key
    # is a lookup of the whole value, which the key's closest replicas answer (the start of a run, not
    # its steady state)
    hot_warmup: float = 0.0


RECORD_BYTES = 490  # a progress record's value, as the optimizer's are
PUBLISH_EVERY = 5.0  # its heartbeat (half the default record ttl of 10 s)
READ_EVERY = 2.0  # a peer's reads of the key between heartbeats (the board reads ~1 s near a target)


async def pull_quietly(d: DHT, key: bytes, via: list[PeerAddress]) -> None:
    with contextlib.suppress(P2PError):
        await d.pull(key, via)


async def read_all(d: DHT, keys: list[bytes], via: list[PeerAddress]) -> int:
    """Read every key from the replicas at once (each pulled first where ``via``); the records read."""
    counts = [0] * len(keys)

    async def read(i: int) -> None:
        with contextlib.suppress(P2PError):
            counts[i] = len(await d.get(keys[i], quorum=3, via=via, written=True))

    async with trio.open_nursery() as nursery:
        for i in range(len(keys)):
            nursery.start_soon(read, i)
    return sum(counts)


async def hot_key(nodes: list[DHT], seconds: float, rng: random.Random, spec: DhtSpec) -> dict[str, Any]:
    """The training swarm's shape on the DHT alone: every node publishes a signed ~490-byte record under
    its owned subkey of one key every PUBLISH_EVERY s and reads the whole key every READ_EVERY s (quorum
    3). With ``spec.partners``, as the progress board does: each node has that many partners drawn at
    random, offers them its new records, reads the replicas once a record's life and what it holds in
    between; with ``spec.pulls`` too, each read first pulls from one of its partners (each in turn).
    Returns bytes per node per second, by method, and the hot spots, over ``seconds`` after
    ``spec.hot_warmup``."""
    counting = spec.hot_warmup <= 0
    bits = max(spec.buckets, 1).bit_length() - 1
    if 1 << bits != max(spec.buckets, 1):
        raise ValueError(f"--buckets {spec.buckets}: a power of 2")
    keys = [progress_key("scale", bits, b) for b in range(1 << bits)]
    partners = {
        id(d): [o.advertised_address() for o in rng.sample([o for o in nodes if o is not d], spec.partners)]
        for d in nodes
    }
    sizes: list[int] = []

    async def peer(d: DHT, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(rng.uniform(0, PUBLISH_EVERY))
        next_publish = next_replicas = trio.current_time()
        mine = partners[id(d)]
        via = mine if spec.pulls else []
        own = keys[bucket_of(d.host.peer_id.digest, bits)]
        while True:
            if trio.current_time() >= next_publish:
                with contextlib.suppress(P2PError):
                    await d.store(
                        own,
                        rng.randbytes(RECORD_BYTES),
                        ttl=2 * PUBLISH_EVERY,
                        subkey=owned_subkey(d.host.peer_id),
                        sign=True,
                        offer_to=mine,
                    )
                next_publish += PUBLISH_EVERY
            if not mine or trio.current_time() >= next_replicas:
                held = await read_all(d, keys, via)
                next_replicas = trio.current_time() + 2 * PUBLISH_EVERY  # (once a record's life)
            else:
                if via:
                    async with trio.open_nursery() as pulls:
                        for key in keys:
                            pulls.start_soon(pull_quietly, d, key, via)
                held = sum(len(d.held(key)) for key in keys)
            if counting:
                sizes.append(held)
            await trio.sleep(READ_EVERY)

    async with trio.open_nursery() as nursery:
        for d in nodes:
            await nursery.start(peer, d)
        await trio.sleep(spec.hot_warmup)
        before = [Counter(d.host.sent_by_method()) for d in nodes]
        counting = True
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    sent = [Counter(d.host.sent_by_method()) - b for d, b in zip(nodes, before, strict=True)]
    totals = [sum(c.values()) / seconds for c in sent]
    by_method: Counter[str] = Counter()
    for c in sent:
        by_method.update(c)
    median = statistics.median(totals)
    busiest = sent[totals.index(max(totals))]
    return {
        "seconds": seconds,
        "records_per_read_median": pct([float(x) for x in sizes], 0.5),
        "records_per_read_p10": pct([float(x) for x in sizes], 0.1),
        "records_per_read_p01": pct([float(x) for x in sizes], 0.01),
        "sent_per_node_per_s_median": round(median),
        "sent_per_node_per_s_max": round(max(totals)),
        "max_over_median": round(max(totals) / median, 2) if median else None,
        "by_method_per_node_per_s": {m: round(v / len(nodes) / seconds) for m, v in by_method.most_common(6)},
        "busiest_by_method_per_s": {m: round(v / seconds) for m, v in busiest.most_common(6)},
    }


async def start_node(
    nursery: trio.Nursery,
    world: World,
    net: MessageNetwork,
    config: DHTConfig,
    i: int,
    boot: list[PeerAddress],
    scope: trio.CancelScope,
) -> tuple[str, DHT]:
    """Node ``i`` (a Host and a DHT, under ``scope``) started in ``nursery`` through ``boot``, once it
    bootstrapped: its place's name and its DHT."""
    place = world.place(i)
    net.set_host(place.name, place.link)
    ident = Identity.from_seed(hashlib.blake2b(place.name.encode(), digest_size=32).digest())
    host = Host(ident, "dht-scale", transport=net.transport(place.name), clock=trio.current_time)
    dht = DHT(host, config=config, clock=trio.current_time, seed=i)

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            async with trio.open_nursery() as inner:
                await inner.start(host.run, [(place.name, PORT)])
                await inner.start(dht.run, boot)
                task_status.started()

    await nursery.start(run)
    await dht.bootstrapped.wait()
    return place.name, dht


class Workload:
    """The one-key workload of :func:`hot_key`, started node by node as they join (``growing``): each
    read's time, the records it held, and the writers whose store had returned within a record's life
    and at least a second before it (the live records it should hold)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.stored: dict[bytes, float] = {}  # a writer's subkey -> when its last store returned
        self.reads: list[tuple[float, int, int]] = []  # (began, live records held, live records)

    async def peer(self, d: DHT) -> None:
        key, subkey = b"progress/scale", owned_subkey(d.host.peer_id)
        await trio.sleep(self.rng.uniform(0, PUBLISH_EVERY))
        next_publish = trio.current_time()
        while True:
            if trio.current_time() >= next_publish:
                with contextlib.suppress(P2PError):
                    data = self.rng.randbytes(RECORD_BYTES)
                    if await d.store(key, data, ttl=2 * PUBLISH_EVERY, subkey=subkey, sign=True):
                        self.stored[subkey] = trio.current_time()
                next_publish += PUBLISH_EVERY
            t = trio.current_time()
            live = {s for s, at in self.stored.items() if t - 2 * PUBLISH_EVERY + 1.0 <= at <= t - 1.0}
            with contextlib.suppress(P2PError):
                held = set(await d.get(key, quorum=3))
                self.reads.append((t, len(held & live), len(live)))
            await trio.sleep(READ_EVERY)

    def report(self, since: float) -> dict[str, Any]:
        shares = [h / n for t, h, n in self.reads if t >= since and n]

        def share(q: float) -> float | None:
            v = pct(shares, q)
            return None if v is None else round(v, 4)

        return {
            "reads": len(shares),
            "live_records_per_read_share_p01": share(0.01),
            "live_records_per_read_share_p10": share(0.1),
            "live_records_per_read_share_median": share(0.5),
            "reads_missing_live_records": round(sum(s < 1 for s in shares) / max(1, len(shares)), 4),
        }


async def growing(spec: DhtSpec) -> dict[str, Any]:
    """Nodes join in waves ``spec.grow`` virtual seconds apart, each writing and reading one key from
    its join on (the training swarm's progress records), and go on for ``spec.hot_key`` seconds after
    the last join. Reported: the share of the live records each read held, over the reads begun a
    newcomer check and two heartbeats after the last join (every read should hold them all: a key's
    replicas are the same for writers and readers once a swarm stops growing, see ``dht.replicas``)."""
    from p2ptrain.dht.replicas import NEWCOMERS_CHECK

    began, cpu = time.perf_counter(), time.process_time()
    world = World(spec.seed, 0.0)
    net = MessageNetwork(latency=world.latency, seed=spec.seed)
    rng = random.Random(spec.seed)
    work = Workload(random.Random(spec.seed + 1))
    config = DHTConfig()
    addresses: list[PeerAddress] = []
    async with trio.open_nursery() as nursery:

        async def start(i: int) -> None:
            boot = [] if not addresses else list(dict.fromkeys([addresses[0], rng.choice(addresses)]))
            _, dht = await start_node(nursery, world, net, config, i, boot, trio.CancelScope())
            addresses.append(dht.advertised_address())
            nursery.start_soon(work.peer, dht)

        await start(0)
        for first in range(1, spec.nodes, spec.wave):
            for j in range(first, min(spec.nodes, first + spec.wave)):
                nursery.start_soon(start, j)
            await trio.sleep(spec.grow)
        last_join = trio.current_time()
        await trio.sleep(spec.hot_key)
        nursery.cancel_scope.cancel()
    return {
        "nodes": spec.nodes,
        "joins_over_virtual_s": round(last_join, 1),
        "growing_hot_key": work.report(last_join + NEWCOMERS_CHECK + 2 * PUBLISH_EVERY),
        "sim": {
            "wall_s": round(time.perf_counter() - began, 1),
            "cpu_s": round(time.process_time() - cpu, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        },
    }


async def simulate_dht(spec: DhtSpec) -> dict[str, Any]:
    if spec.grow:
        return await growing(spec)
    began, cpu = time.perf_counter(), time.process_time()
    world = World(spec.seed, 0.0)
    net = MessageNetwork(latency=world.latency, seed=spec.seed)
    rng = random.Random(spec.seed)
    config = DHTConfig()
    nodes: list[tuple[str, DHT, trio.CancelScope]] = []
    addresses: list[PeerAddress] = []
    async with trio.open_nursery() as nursery:

        async def start(i: int) -> None:
            scope = trio.CancelScope()
            boot = [] if not addresses else list(dict.fromkeys([addresses[0], rng.choice(addresses)]))
            name, dht = await start_node(nursery, world, net, config, i, boot, scope)
            nodes.append((name, dht, scope))
            addresses.append(dht.advertised_address())

        await start(0)
        i = 1
        while i < spec.nodes:
            wave = range(i, min(spec.nodes, i + spec.wave))
            async with trio.open_nursery() as joining:
                for j in wave:
                    joining.start_soon(start, j)
            i = wave.stop
            if i * 10 // spec.nodes > (i - len(wave)) * 10 // spec.nodes:  # (every tenth of the nodes)
                print(
                    f"N={spec.nodes}: {i} joined at {trio.current_time():.0f} virtual s, "
                    f"{time.perf_counter() - began:.0f} s wall",
                    file=sys.stderr,
                )
        built_virtual = trio.current_time()
        built_wall, built_cpu = time.perf_counter() - began, time.process_time() - cpu
        for _, d, _ in nodes:  # (lookups from here on: the workload's, not the joins')
            d.reader.recent_lookups.clear()

        stored: dict[bytes, bytes] = {}
        store_ok = 0

        async def store(k: int) -> None:
            nonlocal store_ok
            key, value = f"key-{k}".encode(), f"value-{k}".encode()
            _, dht, _ = rng.choice(nodes)
            try:
                if await dht.store(key, value, ttl=3600.0) > 0:
                    store_ok += 1
                    stored[key] = value
            except Exception:
                pass

        async with trio.open_nursery() as ops:
            for k in range(spec.keys):
                ops.start_soon(store, k)
        killed = rng.sample(nodes[1:], int(spec.kill * len(nodes)))
        for name, _, scope in killed:
            net.kill(name)
            scope.cancel()
        dead = {name for name, _, _ in killed}
        live = [n for n in nodes if n[0] not in dead]
        await trio.sleep(1.0)
        get_ok = 0
        latencies: list[float] = []

        async def get(key: bytes, value: bytes) -> None:
            nonlocal get_ok
            _, dht, _ = rng.choice(live)
            t0 = trio.current_time()
            try:
                found = await dht.get(key)
            except Exception:
                return
            if any(e.value == value for e in found.values()):
                get_ok += 1
                latencies.append(trio.current_time() - t0)

        async with trio.open_nursery() as ops:
            for key, value in stored.items():
                ops.start_soon(get, key, value)
        hot = await hot_key([d for _, d, _ in live], spec.hot_key, rng, spec) if spec.hot_key else None
        hops = [h for _, d, _ in live for h, _ in d.reader.recent_lookups]
        queries = [q for _, d, _ in live for _, q in d.reader.recent_lookups]
        for name, _, _ in live:  # the end: every process stops at once (no goodbyes to send)
            net.kill(name)
        nursery.cancel_scope.cancel()
    return {
        "nodes": spec.nodes,
        "keys": spec.keys,
        "killed": len(killed),
        "store_success": round(store_ok / spec.keys, 4),
        "get_success": round(get_ok / max(1, len(stored)), 4),
        "get_latency_s_median": round(statistics.median(latencies), 3) if latencies else None,
        "lookup_hops_median": pct([float(h) for h in hops], 0.5),
        "lookup_hops_p99": pct([float(h) for h in hops], 0.99),
        "lookup_queries_median": pct([float(q) for q in queries], 0.5),
        "lookups": len(hops),
        "build_virtual_s": round(built_virtual, 1),
        "hot_key": hot,
        "sim": {
            "wall_s": round(time.perf_counter() - began, 1),
            "build_wall_s": round(built_wall, 1),
            "cpu_s": round(time.process_time() - cpu, 1),
            "build_cpu_s": round(built_cpu, 1),
            "cpu_ms_per_node": round(1000 * (time.process_time() - cpu) / spec.nodes, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "connections_made": net.connections_made,
            "live_connections": net.live_connections(),
        },
    }


def run_dht(spec: DhtSpec) -> dict[str, Any]:
    # (the same run again for the same spec: a growing swarm of 256 nodes, one seed, fell into slow reads
    # in one run and not in the next)
    with few_collections(), seeded_scheduling(spec.seed):
        result: dict[str, Any] = trio.run(
            simulate_dht, spec, clock=trio.testing.MockClock(autojump_threshold=0)
        )
    return result
