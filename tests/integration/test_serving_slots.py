"""What a node serves in bulk is shared by origin, not by identity, and never held whole per stream.

The invariant: whatever the number of ids an attacker runs from one origin (a /24), the streams of
model-sized data a node serves to that origin at once are at most ``per_origin`` of its slots, the
others' fetches complete with the right bytes meanwhile, and a stream holds a window of the data in
memory, not the range it asked for. Randomized: per seed, 4 to 16 attacker ids on one subnet, each
opening 2 to 6 streams of a kept result's whole range that it never reads (each holds its slot as long
as the stream's window lets it), against three honest peers on other subnets fetching random ranges.

On the code before, the kept results' data streams had no slots at all (every attacker stream was
served: 8 to 64 at once) and each read its whole range into memory first (a 24 MiB result per
stream); the state server's slots counted ids only.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest
import torch
import trio
import trio.testing

from p2ptrain.errors import RemoteCallError
from p2ptrain.net import MemoryNetwork
from p2ptrain.net.admission import subnet_of
from p2ptrain.training.state.protocol import RESULT_DATA, ResultReq
from p2ptrain.training.state.replay import SEND_WINDOW, ResultStore
from p2ptrain.training.state.result_pieces import fetch_range
from tests.harness.hosts import Cluster, Peer

pytestmark = pytest.mark.timeout(240)

ELEMENTS = 6 << 20  # a 24 MiB float32 result: spilled to a file, as a large model's is
BEFORE, AFTER = b"b" * 32, b"a" * 32


async def _hold(attacker: Peer, donor: Peer, refused: list[str], held: list[int]) -> None:
    """One attacker stream: the whole result asked for and never read (its slot held until cancelled)."""
    conn = await attacker.host.connect(donor.address)
    try:
        async with conn.open_stream(RESULT_DATA, ResultReq(0, AFTER, 0, 0), timeout=600) as stream:
            got = await stream.receive_some()  # (the first record: served, so a slot is held)
            held.append(len(got))
            await trio.sleep_forever()
    except RemoteCallError as e:
        refused.append(e.code)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_free_ids_of_one_origin_take_at_most_its_share_and_no_stream_holds_its_range(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    rng = random.Random(seed)
    values = torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(seed))
    tracemalloc.start()
    try:
        async with trio.open_nursery() as nursery:
            cluster = Cluster(nursery, "memory", MemoryNetwork(seed=seed))
            donor = await cluster.start("198.18.0.1")
            store = ResultStore(donor.host.registry, 2, lambda e: b"")
            await trio.to_thread.run_sync(store.keep, 0, range(0, 1), [values], [], (BEFORE, AFTER))
            expected = bytes(store.get(0).read())  # type: ignore[union-attr]
            entry = store.entries(0)[0]
            ids, per_id = rng.randint(4, 16), rng.randint(2, 6)
            attackers = [await cluster.start(f"198.18.9.{10 + i}") for i in range(ids)]
            honest = [await cluster.start(f"198.18.{20 + i}.1") for i in range(3)]
            origin = subnet_of(attackers[0].name)

            refused: list[str] = []
            held: list[int] = []
            most = 0
            async with trio.open_nursery() as attack:
                for a in attackers:
                    for _ in range(per_id):
                        attack.start_soon(_hold, a, donor, refused, held)
                while len(held) + len(refused) < ids * per_id:
                    most = max(most, store.slots.held_by(origin))
                    await trio.sleep(0.05)
                most = max(most, store.slots.held_by(origin))
                await trio.sleep(1.0)  # (the held streams' handlers now wait for their readers)
                holding = _held_by_the_store(tracemalloc.take_snapshot())

                for peer in honest:  # the others' fetches, while the attackers hold what they got
                    conn = await peer.host.connect(donor.address)
                    for _ in range(3):
                        start = rng.randrange(0, len(expected) - 1)
                        length = rng.randint(1, min(len(expected) - start, 3 * SEND_WINDOW))
                        with trio.fail_after(120):
                            got = await fetch_range(conn, entry, AFTER, start, length, 30.0)
                        assert bytes(got) == expected[start : start + length]
                        most = max(most, store.slots.held_by(origin))
                attack.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    finally:
        tracemalloc.stop()

    per_origin = store.slots.per_origin
    assert most <= per_origin, (most, per_origin)
    assert len(held) == min(per_origin, ids * per_id), (len(held), ids, per_id)  # (its share, served)
    assert refused.count("busy") == ids * per_id - len(held), refused
    # memory: what the data streams read from the result's file and hold while the attackers hold their
    # streams is a window per stream at most, not the range each asked for (the whole result)
    assert holding <= len(held) * SEND_WINDOW + (1 << 20), (holding / 2**20, len(held))


def _held_by_the_store(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes read from spill files (a kept result's) and still held: what the data streams read."""
    mine = snapshot.filter_traces([tracemalloc.Filter(True, "*averaging/spill.py")])
    return sum(stat.size for stat in mine.statistics("filename"))
