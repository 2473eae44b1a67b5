"""Rank 0's wire buffer: released pages keep their values, and while a round runs the buffer stays out
of the resident set (``keep_released``)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from p2ptrain.training.site.wire import WireBuffer

N = 8 << 20  # elements: 32 MiB


def rss_file() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


def test_released_pages_keep_their_values_and_leave_the_resident_set() -> None:
    wire = WireBuffer(N)
    try:
        values = torch.arange(N, dtype=torch.float32)
        wire.flat.copy_(values)
        touched = rss_file()
        wire.release()
        assert rss_file() < touched - N * 4 // 2  # (most of the 32 MiB left)
        assert torch.equal(wire.flat, values)  # (read back from the page cache)
        wire.release(10, 20)
        assert torch.equal(wire.piece(0, 100), values[:100])
    finally:
        wire.close()


def test_keep_released_while_a_round_reads_and_writes_everything() -> None:
    wire = WireBuffer(N)
    try:
        wire.flat.copy_(torch.arange(N, dtype=torch.float32))
        wire.release()
        base = rss_file()  # (the libraries' mapped files)
        with wire.keep_released(every=0.001):
            for _ in range(5):  # what an in-place round does: read every value, write the mean
                assert torch.isfinite(wire.flat).all()
                wire.flat.mul_(2.0)
        assert rss_file() < base + N * 4 // 2  # (released at the end too)
        assert torch.equal(wire.flat, torch.arange(N, dtype=torch.float32) * 32)
        assert not any(t.name == "wire-release" for t in threading.enumerate())
    finally:
        wire.close()
