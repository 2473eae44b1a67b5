"""Catching up on a slow link leaves room for control messages (in memory, on the virtual clock).

The invariant: background bulk (a state download, a replayed step result) never holds more than a
fraction of a second of its connection's bytes ahead of a control message on that connection. The donor
sends it in records of what the connection drains in ``channel.FRAME_SECONDS``, measured from its own
sends; a control message waits at the send gate for at most the record being sent, then for what the
transport holds (``memory.SEND_QUEUE_SECONDS``, as a TCP sender's kernel does). A home peer on 10 Mbit/s
that downloads the state used to get every reply from its donor seconds late (1 MiB records, 0.84 s
each, several queued ahead), and so read the swarm's records and its join answers late.
"""

from __future__ import annotations

import trio

from p2ptrain.net.channel import FRAME_SECONDS
from p2ptrain.net.memory import SEND_QUEUE_SECONDS
from p2ptrain.training.state.replay import RECORD
from tests.harness.training import Peer, run_config, swarm
from tests.integration.test_statesync import big_model, donors_and_joiner, fetcher, records

RATE = 1.25e6  # 10 Mbit/s, bytes per second


async def test_a_download_on_10_mbit_leaves_control_messages_a_fraction_of_a_second(
    autojump_clock: object,
) -> None:
    """Pings from the home peer while it downloads: to its donor (the pong queues behind the bulk on
    the same connection) and to a third peer (the pong queues behind it on the home's access link,
    which all its connections share, as a home router's is)."""
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        other = await s.start(train=False)
        s.net.set_access(f"t{joiner.index}", up=RATE, down=RATE)
        f = fetcher(joiner, chunk_timeout=30.0)
        rtts: dict[str, list[float]] = {"its donor": [], "another peer": []}
        done = trio.Event()

        async def ping_while_downloading(peer: Peer, into: list[float]) -> None:
            conn = await joiner.node.host.connect(peer.node.addresses[0])
            while not done.is_set():
                into.append(await conn.ping(timeout=30.0))
                await trio.sleep(0.25)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping_while_downloading, donor, rtts["its donor"])
            nursery.start_soon(ping_while_downloading, other, rtts["another peer"])
            began = trio.current_time()
            got = await f.fetch(records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest)
            took = trio.current_time() - began
            done.set()
        size = sum(t.numel() * t.element_size() for t in got.tensors.values())
        assert size > 5 * RECORD and took > 4.0  # several seconds of bulk on the link
        assert size / took >= 0.85 * RATE, f"{size / took / RATE:.0%} of the link"  # pacing costs no rate
        # a pong waits for one background record and what the transport holds, plus its own trip
        bound = 2 * FRAME_SECONDS + 2 * SEND_QUEUE_SECONDS
        for to, times in rtts.items():
            assert max(times) <= bound, f"pings to {to} took up to {max(times):.2f} s: {times}"
            assert len(times) >= 10
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.opt.digest == donor.opt.digest
