"""Refused connections held open a while (``net.linger``), on trio's virtual clock."""

from __future__ import annotations

import trio
import trio.testing

from p2ptrain.net.linger import Lingering, default_capacity, raise_fd_limit


async def test_a_held_connection_is_let_go_after_the_hold_or_when_newer_ones_push_it_out(autojump_clock):
    lingering = Lingering(hold=30.0, capacity=2)
    let_go: dict[int, float] = {}

    async def held(k: int) -> None:
        await lingering.hold()
        let_go[k] = trio.current_time()

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(held, 0)
            await trio.sleep(10)
            nursery.start_soon(held, 1)
            await trio.sleep(10)
            assert len(lingering) == 2 and not let_go
            nursery.start_soon(held, 2)  # one too many: the oldest goes now
            await trio.testing.wait_all_tasks_blocked()
            assert list(let_go) == [0] and let_go[0] == 20.0
    assert let_go[1] == 40.0 and let_go[2] == 50.0  # the others after their 30 s
    assert len(lingering) == 0


def test_the_capacity_follows_the_file_descriptor_limit() -> None:
    limit = raise_fd_limit()
    assert limit >= 64
    assert 64 <= default_capacity() <= 2048
    assert default_capacity() == max(64, min(2048, limit // 4))
