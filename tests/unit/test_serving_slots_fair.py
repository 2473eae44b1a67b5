"""A node's bulk serving slots are shared max-min fairly by origin, with turns (``net.slots``).

The invariant: an origin that keeps asking, with k other origins asking too, gets a slot within about
ceil((k + 1) / total) turns whatever the number of ids they bring (the slots go round, first come first
served), and while an origin is refused no other holds two slots more than it does. And the caps always
hold: at most ``total`` streams at once, ``per_origin`` per origin, ``per_peer`` per id.

Randomized (per seed): a node's slots (4 to 16 of them, caps drawn); an attacker with 1 to 24 origins
(/24s) and 1 to 4 ids in each, every id opening 1 to 3 streams that are never read (each holds its slot
until taken over) and asking again 0.2 to 2 s after a refusal or a take-over; and an honest downloader
from an origin of its own, which asks for one stream every second until it holds one and then keeps it
for up to two turns (or until it is taken over), three times. On trio's virtual clock. On the code
before, two origins of the attacker took every slot for good and the honest origin was never served;
without the line of waiting origins, the attacker's origins, asking more often, won every slot whose
turn was over (139 s for one seed).
"""

from __future__ import annotations

import hashlib
import math
import random

import pytest
import trio
import trio.testing

from p2ptrain.errors import CallRefused
from p2ptrain.identity import PeerID
from p2ptrain.net.slots import BUSY, ServingSlots

TURN = 20.0
BACKOFF = 1.0  # the honest downloader's pause after busy (a download's)


def peer(name: str) -> PeerID:
    return PeerID(hashlib.blake2b(name.encode(), digest_size=32).digest())


def check_caps(slots: ServingSlots) -> None:
    live = [s for s in slots._slots if not s.taken_over]
    assert len(live) <= slots.total
    origins = {s.origin for s in live}
    assert all(sum(1 for s in live if s.origin == o) <= slots.per_origin for o in origins)
    peers = {s.peer for s in live}
    assert all(sum(1 for s in live if s.peer == p) <= slots.per_peer for p in peers)


async def hold(slots: ServingSlots, who: PeerID, host: str, seconds: float | None) -> float | None:
    """One stream: a slot held for ``seconds`` (None: until taken over); when it got the slot (None:
    refused at once)."""
    got = None
    try:
        with slots.taken(who, host):
            got = trio.current_time()
            check_caps(slots)
            if seconds is None:
                await trio.sleep_forever()
            await trio.sleep(seconds)
    except CallRefused as e:
        assert e.code == BUSY
    return got


@pytest.mark.parametrize("seed", range(8))
async def test_an_origin_that_keeps_asking_gets_a_slot_within_a_turn_whatever_the_others_bring(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    rng = random.Random(seed)
    total = rng.randint(4, 16)
    per_origin = rng.randint(2, total)
    per_peer = rng.randint(1, per_origin)
    slots = ServingSlots(total, per_peer, per_origin, turn=TURN)
    origins = rng.randint(1, 24)
    ids = [
        (peer(f"a{o}/{i}"), f"198.18.{o}.{10 + i}") for o in range(origins) for i in range(rng.randint(1, 4))
    ]
    honest, honest_host = peer("honest"), "198.19.0.1"
    waits: list[float] = []

    async def attacker(who: PeerID, host: str) -> None:
        while True:
            await hold(slots, who, host, None)
            await trio.sleep(rng.uniform(0.2, 2.0))

    async def downloader() -> None:
        for _ in range(3):
            asked = trio.current_time()
            while True:
                refused = slots.refused
                got = await hold(slots, honest, honest_host, rng.uniform(1.0, 2 * TURN))
                if got is not None:  # (served: held until done, or taken over after a turn of its own)
                    waits.append(got - asked)
                    break
                if slots.refused > refused:  # refused: no origin holds two slots more than its 0
                    live = [s for s in slots._slots if not s.taken_over]
                    held = [sum(1 for s in live if s.origin == o) for o in {s.origin for s in live}]
                    assert max(held, default=0) <= 1, held
                await trio.sleep(BACKOFF)

    async with trio.open_nursery() as nursery:
        for who, host in ids:
            for _ in range(rng.randint(1, 3)):
                nursery.start_soon(attacker, who, host)
        await trio.sleep(rng.uniform(0.0, 3 * TURN))  # (the attacker's streams settled, some aged)
        await downloader()
        nursery.cancel_scope.cancel()
    assert len(waits) == 3
    # served once the origins ahead of it had their turns: ceil((k + 1) / total) turns, one more for
    # the slots' ages when it began to ask, each turn a pause of the first in line (2 s) longer
    bound = (math.ceil((origins + 1) / total) + 1) * (TURN + 2.0) + BACKOFF
    assert max(waits) <= bound, (waits, bound, total, per_origin, origins)
