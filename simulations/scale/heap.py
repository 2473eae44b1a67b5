"""The simulator's heap: Python's cyclic collector tuned for a process holding a whole swarm.

A simulated swarm keeps hundreds of thousands of live objects (connections, routing tables, trio
tasks and cancel scopes) and allocates many short-lived ones per message. With the collector's default
thresholds (a young collection every 700 allocations, a full one every 100 of those), full collections
walk the whole swarm ever more often as it grows: at 192 DHT nodes most of the process's samples fell
in the allocation of trio's cancel scopes, which is where the collections ran. Raising the young
threshold makes collections rarer without keeping garbage much longer (cycles are rare here; reference
counting frees the rest): measured on the DHT alone (``python -m simulations.scale --dht 96 --keys 50``)
34.3 s of CPU with the defaults, 24.6 s with these thresholds, and 4x the nodes then cost 4.5x the CPU
(384 nodes: 112 s) instead of growing quadratically. The training swarm runs with them too: a
32-peer run (``python -m simulations.scale --peers 32 --duration 40 --warmup 20``) spent 4.6 s of its
44.1 s of CPU in 2,033 collections with the defaults, 0.8 s of 38.7 s in 20 with these. The price is
memory: at 64 training peers the peak was 1,138 MB against 683 MB (with the stop's other cuts beside).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

THRESHOLDS = (50_000, 20, 1_000)
"""Young allocations before a collection; young collections per middle one; middle per full one."""


@contextlib.contextmanager
def few_collections() -> Iterator[None]:
    """Run the block with :data:`THRESHOLDS`, then restore the collector's previous ones."""
    before = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
