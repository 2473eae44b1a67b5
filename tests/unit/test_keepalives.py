"""The host's keepalive timer: each connection's check at the instant it asked for, on one task."""

from __future__ import annotations

import trio
import trio.testing

from p2ptrain.net.connection import Keepalives


class Checked:
    """Stands for a connection: notes when its check ran, and asks for the next one ``every`` later."""

    def __init__(self, timer: Keepalives, every: float, times: int) -> None:
        self.timer, self.every, self.left = timer, every, times
        self.at: list[float] = []

    def _keepalive_check(self) -> None:
        self.at.append(trio.current_time())
        self.left -= 1
        if self.left:
            self.timer.schedule(self, trio.current_time() + self.every)  # type: ignore[arg-type]


async def test_each_check_runs_at_its_instants_on_one_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timer = Keepalives()
    slow, fast = Checked(timer, 5.0, 3), Checked(timer, 5.0, 3)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            await trio.testing.wait_all_tasks_blocked()
            timer.schedule(slow, 5.0)  # type: ignore[arg-type]  (the runner waits with nothing due)
            await trio.sleep(1.5)
            timer.schedule(fast, 1.5 + 5.0)  # type: ignore[arg-type]
            # One sooner than the runner waits for: it wakes for it.
            early = Checked(timer, 1.0, 1)
            timer.schedule(early, 2.0)  # type: ignore[arg-type]
            await trio.sleep_until(20.0)  # (virtual time: past the last check asked for)
            assert len(timer) == 0
            nursery.cancel_scope.cancel()
    assert slow.at == [5.0, 10.0, 15.0]
    assert fast.at == [6.5, 11.5, 16.5]
    assert early.at == [2.0]
