"""A finished stream lets go of the buffers its chunks were to land in.

Why it matters: a member averaging in place lands the averages it fetches straight in the caller's
model-sized tensor (``RpcStream.land_in``). A finished call sits in a reference cycle with its stream
until Python's cyclic collector runs, so a landing target left in the stream kept 1.2 GB (350M
parameters) alive through the next global step: 6.2x the fp32 parameter bytes at peak instead of 5.2x.
"""

from __future__ import annotations

import gc
import weakref

from p2ptrain.errors import ConnectionClosed
from p2ptrain.net.streams import RpcStream


async def _send(*_: object, **__: object) -> None:
    pass


class Buffer(bytearray):
    """A buffer a weak reference can watch (a model-sized tensor's bytes, in the real thing)."""


def test_a_failed_stream_drops_its_landing_targets_at_once() -> None:
    stream = RpcStream(1, _send)
    buffer = Buffer(1 << 16)
    alive = weakref.ref(buffer)
    stream.land_in([memoryview(buffer)[: 1 << 10]])
    del buffer
    assert alive() is not None  # the target keeps the caller's buffer alive while the call runs
    gc.disable()
    try:
        stream.fail(ConnectionClosed("call finished"))  # what finishing a call does
        assert alive() is None  # freed by reference counting, not by a collection
    finally:
        gc.enable()
