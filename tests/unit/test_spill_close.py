"""A spill file is closed at once, and a large one frees its pages in a thread of its own.

Closing a model-sized spill file makes the kernel free its pages, which held a member's event loop for
0.1 s per 800 MB as a round retired (``simulations.bench_loop_hold``). A large file's descriptor is now
closed in a thread; either way the file is closed for its owner at once, and the descriptor goes.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from p2ptrain.averaging import spill


@pytest.mark.parametrize("size", [1 << 20, spill.CLOSE_IN_THREAD])
def test_a_closed_spill_file_is_closed_at_once_and_its_descriptor_goes(size: int) -> None:
    file = spill.SpillFile()
    held = file.put(b"\x01" * size)
    fd = file.fd
    file.close()
    assert file.closed and file.fd < 0
    with pytest.raises(ValueError):
        file.put(b"more")
    deadline = time.monotonic() + 30
    while True:  # (a large one closes in a thread: wait for that thread, not for luck)
        closers = [t for t in threading.enumerate() if t.name == "spill-close"]
        for t in closers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        try:
            os.fstat(fd)
        except OSError:
            break  # the descriptor is gone
        assert closers or size < spill.CLOSE_IN_THREAD, "a small file's descriptor is closed in place"
        assert time.monotonic() < deadline, "the descriptor was never closed"
    del held
