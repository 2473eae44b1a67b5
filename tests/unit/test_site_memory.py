"""A site's ranks return freed large buffers to the system (``launch.return_freed_memory``).

glibc raises its mmap threshold every time a mapped block is freed, so that later blocks up to that size
come from (and stay in) its heaps: FSDP2's gathered units at mid sizes then stay in a rank's resident
set. Checked in a fresh process (the setting is the process's): after a 24 MiB block is freed (the
threshold rises to it), 16 MiB blocks allocated, written and freed leave the resident set with the
setting, and stay in it without.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, ctypes
from pathlib import Path
from p2ptrain.training.site.launch import return_freed_memory
if sys.argv[1] == "on":
    return_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

big = libc.malloc(24 << 20)
libc.free(big)  # (glibc's dynamic threshold rises to 24 MiB)
before = rss()
blocks = [libc.malloc(16 << 20) for _ in range(8)]
for b in blocks:
    ctypes.memset(b, 1, 16 << 20)
for b in blocks[:-1]:  # (the last kept: the heap's top stays in use, so nothing below is trimmed)
    libc.free(b)
print((rss() - before) >> 20)
"""


def held_mib(setting: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, setting], capture_output=True, text=True, timeout=60, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_large_buffers_leave_the_resident_set() -> None:
    assert held_mib("on") <= 24  # (the one block kept, 16 MiB, and slack)
    assert held_mib("off") >= 100  # (glibc's default: the seven freed blocks stay, 112 MiB)
