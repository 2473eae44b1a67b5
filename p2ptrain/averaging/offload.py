"""Passes over a round's whole vector (copies, finiteness checks, norms), kept off the event loop.

A pass over a 1B-parameter vector takes about a second on a CPU. Run on the event loop it holds every
other task of the node for that long: heartbeats, DHT answers, the round's own streams (at 1B, the
passes of one round held the loop for about 1.5 s, and a site's DHT answers timed out meanwhile).
:func:`run_pass` runs such a pass in a worker thread once it covers ``LOOP_ELEMENTS`` values or more;
a smaller one stays on the loop, where a thread's round trip would cost more than the pass itself.

The invariant: *no step of a task on the event loop passes over ``LOOP_ELEMENTS`` values or more* (a
step: what a task runs between two awaits). A pass goes to a thread only over memory no other task
writes meanwhile: the caller's tensors during its own ``average`` call, a round's buffers before it is
served or after its partitions are final, a reducer's partition while it is finalized (no slice is
added to it then, and its memory is not given back). What stays on the loop is chunk-sized: a slice's
chunks added as they arrive, a result's chunks sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

LOOP_ELEMENTS = 1 << 22  # 4M values (16 MB of float32): a pass over fewer stays on the event loop

T = TypeVar("T")


async def run_pass(elements: int, fn: Callable[..., T], *args: object, passes: int = 1) -> T:
    """``fn(*args)``, ``passes`` passes over ``elements`` values: in a worker thread from
    ``LOOP_ELEMENTS`` values passed over on."""
    if elements * passes < LOOP_ELEMENTS:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)
