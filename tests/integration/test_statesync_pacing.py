"""Catching up on a slow link leaves room for control messages (in memory, on the virtual clock).

The invariant: background bulk (a state download, a replayed step result) never holds more than a
fraction of a second of its connection's bytes ahead of a control message on that connection, however
slow the link. The donor sends it in records of what the connection drains in ``channel.FRAME_SECONDS``,
measured from what the transport delivered (at least ``channel.MIN_PIECE``, and that until measured); a
control message waits at the send gate for at most the record being sent, then for what the transport
holds (``memory.SEND_QUEUE_SECONDS``, as a TCP sender's kernel does). A home peer on 10 Mbit/s that
downloads the state used to get every reply from its donor seconds late (1 MiB records, 0.84 s each,
several queued ahead), and so read the swarm's records and its join answers late; on links under 10
Mbit/s the records could not shrink below 64 KiB (the send gate told bulk by size), so on 128 kbit/s
every reply waited up to 4 s.
"""

from __future__ import annotations

import math

import pytest
import torch
import trio

from tests.harness.training import Peer, run_config, swarm
from tests.integration.test_control_behind_bulk import control_wait_bound
from tests.integration.test_statesync import donors_and_joiner, fetcher, records

DOWNLOAD_SECONDS = 10.0  # the state takes about this long on the home's link


def model_of(nbytes: float) -> torch.nn.Module:
    """A model whose state (float32 parameters and Adam's two moments) is about ``nbytes``."""
    torch.manual_seed(0)
    width = max(1, math.ceil(nbytes / 12 / 6))  # (6 parameters per unit of width, 12 bytes each)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))


# from 128 kbit/s to 10 Mbit/s: below 10 Mbit/s a record of 64 KiB takes more than FRAME_SECONDS
@pytest.mark.parametrize("rate", [16e3, 60e3, 250e3, 1.25e6])
@pytest.mark.timeout(120)
async def test_a_download_on_any_link_leaves_control_messages_a_fraction_of_a_second(
    autojump_clock: object, rate: float
) -> None:
    """Pings from the home peer while it downloads: to its donor (the pong queues behind the bulk on
    the same connection) and to a third peer (the pong queues behind it on the home's access link,
    which all its connections share, as a home router's is)."""
    async with swarm(run_config("sync"), model=lambda: model_of(rate * DOWNLOAD_SECONDS)) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        other = await s.start(train=False)
        s.net.set_access(f"t{joiner.index}", up=rate, down=rate)
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
        assert took > 0.8 * DOWNLOAD_SECONDS  # several seconds of bulk on the link
        # pacing costs no rate (on 128 kbit/s the swarm's own records and DHT traffic take a few percent)
        assert size / took >= 0.8 * rate, f"{size / took / rate:.0%} of the link"
        # a pong waits for one background record (FRAME_SECONDS' worth, or the smallest) and what the
        # transport holds, plus its own trip
        bound = control_wait_bound(rate)
        for to, times in rtts.items():
            assert max(times) <= bound, f"pings to {to} took up to {max(times):.2f} s: {times}"
            assert len(times) >= 10
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert await joiner.opt.shared.hashed_digest() == await donor.opt.shared.hashed_digest()
