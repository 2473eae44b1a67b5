"""A spill file is closed at once, and a large one frees its pages in a thread that is not the caller's.

Closing a model-sized spill file makes the kernel free its pages, which held a member's event loop for
0.1 s per 800 MB as a round retired (``simulations.bench_loop_hold``). A large file's descriptor is now
closed by one long-lived closer thread; either way the file is closed for its owner at once, and the
descriptor goes. A file dropped without a close is closed by its finalizer the same way, which starts
no thread: one started in a finalizer hung a process at its exit (in ``Thread.start``).
"""

from __future__ import annotations

import gc
import os
import threading

import pytest

from p2ptrain.averaging import spill


def gone(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


@pytest.mark.parametrize("size", [1 << 20, spill.CLOSE_IN_THREAD])
def test_a_closed_spill_file_is_closed_at_once_and_its_descriptor_goes(size: int) -> None:
    file = spill.SpillFile()
    held = file.put(b"\x01" * size)
    fd = file.fd
    file.close()
    assert file.closed and file.fd < 0
    with pytest.raises(ValueError):
        file.put(b"more")
    if size < spill.CLOSE_IN_THREAD:
        assert gone(fd), "a small file's descriptor is closed in place"
    assert spill.settle(30) and gone(fd), "the descriptor was never closed"
    del held


def test_a_large_spill_file_dropped_unclosed_is_closed_without_starting_a_thread() -> None:
    file = spill.SpillFile()
    file.put(b"\x01" * spill.CLOSE_IN_THREAD)
    fd = file.fd
    threads = {t.ident for t in threading.enumerate()}
    del file
    gc.collect()
    assert {t.ident for t in threading.enumerate()} <= threads  # (the finalizer started none)
    assert spill.settle(30) and gone(fd)
