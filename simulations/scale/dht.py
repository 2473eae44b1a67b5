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

import hashlib
import random
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

import trio
import trio.testing

from p2ptrain.dht import DHT, DHTConfig
from p2ptrain.identity import Identity
from p2ptrain.net import Host, PeerAddress
from p2ptrain.net.messages import MessageNetwork
from simulations.scale.model import World
from simulations.scale.swarm import pct

PORT = 1000


@dataclass(frozen=True)
class DhtSpec:
    nodes: int
    keys: int = 200
    kill: float = 0.1
    wave: int = 32
    seed: int = 0


async def simulate_dht(spec: DhtSpec) -> dict[str, Any]:
    began = time.perf_counter()
    world = World(spec.seed, 0.0)
    net = MessageNetwork(latency=world.latency, seed=spec.seed)
    rng = random.Random(spec.seed)
    config = DHTConfig()
    nodes: list[tuple[str, DHT, trio.CancelScope]] = []
    addresses: list[PeerAddress] = []
    async with trio.open_nursery() as nursery:

        async def start(i: int) -> None:
            place = world.place(i)
            net.set_host(place.name, place.link)
            ident = Identity.from_seed(hashlib.blake2b(place.name.encode(), digest_size=32).digest())
            host = Host(ident, "dht-scale", transport=net.transport(place.name), clock=trio.current_time)
            dht = DHT(host, config=config, clock=trio.current_time, seed=i)
            scope = trio.CancelScope()
            boot = [] if not addresses else list(dict.fromkeys([addresses[0], rng.choice(addresses)]))

            async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    async with trio.open_nursery() as inner:
                        await inner.start(host.run, [(place.name, PORT)])
                        await inner.start(dht.run, boot)
                        task_status.started()

            await nursery.start(run)
            await dht.bootstrapped.wait()
            nodes.append((place.name, dht, scope))
            addresses.append(dht.advertised_address())

        await start(0)
        i = 1
        while i < spec.nodes:
            wave = range(i, min(spec.nodes, i + spec.wave))
            async with trio.open_nursery() as joining:
                for j in wave:
                    joining.start_soon(start, j)
            i = wave.stop
        built_virtual = trio.current_time()
        built_wall = time.perf_counter() - began
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
        hops = [h for _, d, _ in live for h, _ in d.reader.recent_lookups]
        queries = [q for _, d, _ in live for _, q in d.reader.recent_lookups]
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
        "sim": {
            "wall_s": round(time.perf_counter() - began, 1),
            "build_wall_s": round(built_wall, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "connections_made": net.connections_made,
            "live_connections": net.live_connections(),
        },
    }


def run_dht(spec: DhtSpec) -> dict[str, Any]:
    result: dict[str, Any] = trio.run(simulate_dht, spec, clock=trio.testing.MockClock(autojump_threshold=0))
    return result
