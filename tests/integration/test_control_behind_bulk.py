"""A control message behind background bulk on one connection, over random links (in memory, virtual time).

The invariant (``channel.FRAME_SECONDS``, ``channel.DrainRate``): on a link of any rate, a control
message sent while background bulk streams on the same connection, in the same direction, waits for at
most about two background records (each FRAME_SECONDS of the link, or 4 KiB, whichever is longer)
and what the transport holds (``memory.SEND_QUEUE_SECONDS``), plus its own trip; and the bulk still
gets most of the link. Each seed draws the link's rate (8 kB/s to 20 MB/s, log-uniform) and
latency, streams about five seconds of the link from one host to the other with ``background=True``,
and has the receiving host ping the sender every 0.2 s: the pong queues behind the bulk.

On the code before, a background record could not be smaller than 64 KiB (the send gate told bulk by
size), and a send the transport took at once made the next record 1 MiB: on links under 10 Mbit/s a pong
waited up to 64 KiB of the link (4 s at 16 kB/s), and on faster ones up to 1 MiB of it: 18 of these
40 seeds fail there (every link under 280 kB/s, and one of 4 MB/s).
"""

from __future__ import annotations

import math
import random

import pytest
import trio

from p2ptrain.net import MemoryNetwork
from p2ptrain.net.channel import FRAME_SECONDS
from p2ptrain.net.memory import SEND_QUEUE_SECONDS, LinkProfile
from tests.harness.hosts import SINK, Cluster, Text, payload

SEEDS = range(40)
SMALLEST_RECORD = 4 * 1024  # the invariant's, not read from the code (``channel.MIN_PIECE`` is this)


def control_wait_bound(rate: float) -> float:
    """The invariant: the longest a control message waits behind background bulk on a link of ``rate``
    bytes a second, beyond its own trip (two records and what the transport holds)."""
    return 2 * max(FRAME_SECONDS, SMALLEST_RECORD / rate) + 2 * SEND_QUEUE_SECONDS


BULK_SECONDS = 5.0
PING_EVERY = 0.2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_control_message_waits_for_about_two_background_records_on_any_link(
    mem_cluster: Cluster, memnet: MemoryNetwork, autojump_clock: object, seed: int
) -> None:
    rng = random.Random(seed)
    rate = 10 ** rng.uniform(math.log10(8e3), math.log10(2e7))
    latency = rng.uniform(0.0, 0.05)
    memnet.default = LinkProfile(latency=latency, bandwidth=rate)
    size = int(rate * BULK_SECONDS)
    rtts: list[float] = []
    with trio.fail_after(BULK_SECONDS * 3 + 60):
        sender, receiver = await mem_cluster.start(), await mem_cluster.start()
        conn = await sender.host.connect(receiver.address)
        back = await receiver.wait_conn_to(sender)  # (the same connection, seen from the receiver)
        done = trio.Event()

        async def ping() -> None:
            while not done.is_set():
                rtts.append(await back.ping(timeout=60.0))  # the pong goes behind the bulk
                await trio.sleep(PING_EVERY)

        async with trio.open_nursery() as nursery:
            began = trio.current_time()
            nursery.start_soon(ping)
            async with conn.open_stream(SINK, Text("")) as stream:
                await stream.send(payload(size), background=True)
                await stream.send_eof()
                await stream.response()
            took = trio.current_time() - began
            done.set()
    what = f"seed {seed}: {rate / 1e3:.1f} kB/s, latency {latency * 1e3:.0f} ms"
    bound = 2 * latency + control_wait_bound(rate) + 0.01
    assert len(rtts) >= 5, (what, rtts)
    assert max(rtts) <= bound, f"{what}: pongs took up to {max(rtts):.3f} s (bound {bound:.3f}): {rtts}"
    # the bulk still had most of the link (records of 4 KiB or more carry ~100 bytes of framing each)
    assert size / rate / took >= 0.8, f"{what}: {size / rate / took:.0%} of the link"
