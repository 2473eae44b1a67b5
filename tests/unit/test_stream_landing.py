"""Chunks land where their own targets are, whenever ``land_in`` is called (``RpcStream.land_in``).

The invariant: *a chunk lands in the target given for its own index in the stream, or in a buffer of
its own; never in another chunk's target.* A member averaging in place had the early averages of a 25
MB partition land in its tensor after backing its own values up in a worker thread, and the first
chunks arrived meanwhile, before ``land_in``: each later chunk landed one target early, overwrote the
chunk before it, and the round committed misplaced chunks (4 of 12 rounds of 12.6M values on two
members). Randomized: how many chunks arrive before the targets are given, in one call or two, and
chunks of another size than their target.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.net.frames import Data
from p2ptrain.net.streams import RpcStream

SEEDS = range(40)


async def _send(*_: object, **__: object) -> None:
    pass


def arrive(stream: RpcStream, payload: bytes) -> memoryview:
    """What the connection does with one data record: decrypt it where the stream says, deliver it."""
    sink = stream.sink_for(len(payload))
    body = sink if sink is not None else memoryview(bytearray(len(payload)))
    body[:] = payload
    stream.deliver(Data(id=1), body)
    return body


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_chunk_lands_in_its_own_target_or_a_buffer_of_its_own(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    size = 64
    chunks = [bytes([i + 1]) * (size if rng.random() < 0.8 else size // 2) for i in range(n)]
    memory = bytearray(n * size)  # the caller's tensor: chunk i's place is memory[i*size:(i+1)*size]
    places = [memoryview(memory)[i * size : (i + 1) * size] for i in range(n)]
    stream = RpcStream(1, _send)
    stream._received_window = 1 << 20  # (the credit a real stream would have granted by then)
    before = rng.randint(0, n)  # chunks that arrive before the targets are given
    split = rng.randint(0, n)  # the targets given in two calls, at ``split``
    for i in range(before):
        arrive(stream, chunks[i])
    stream.land_in(places[:split])
    stream.land_in(places[split:])
    for i in range(before, n):
        arrive(stream, chunks[i])
    with trio.fail_after(5):
        for i in range(n):
            got = await stream.receive_some()
            assert bytes(got) == chunks[i]
            for j in range(n):  # no place holds a chunk other than its own (or nothing yet)
                held = bytes(places[j])
                assert set(held) <= {0, j + 1}, (i, j, held[:4])
