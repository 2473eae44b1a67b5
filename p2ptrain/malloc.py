"""glibc's allocator settings a process may fix for itself (``mallopt``); no effect on other C libraries.

Each setting has an environment variable of glibc's own that, when set, wins: the user's word over the
project's default."""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def mallopt(option: int, value: int, overridden_by: str) -> None:
    """Set glibc's ``option`` to ``value`` in this process, unless the environment variable
    ``overridden_by`` is set (glibc reads it itself) or the C library is not glibc."""
    if sys.platform != "linux" or overridden_by in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(option, value)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator has no such settings, and nothing is lost
