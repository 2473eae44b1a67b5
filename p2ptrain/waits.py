"""Small trio waits shared by the averager and the trainer."""

from __future__ import annotations

import trio


async def either(a: trio.Event, b: trio.Event) -> None:
    """Wait until ``a`` or ``b`` is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(wait, a)
        nursery.start_soon(wait, b)
