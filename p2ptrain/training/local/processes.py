"""The local group's processes and sockets, from rank 0's side.

The TCPStore and gloo listen on loopback only (left to themselves, both listen on an address the LAN
may reach, and anyone who reaches the store could write commands for the workers); workers are watched
without being reaped (``peek``), so that their process group stays rank 0's to kill with everything they
started (``kill``), and their ends and torch's errors are told in one line (``describe``, ``first_line``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator

from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore, where mypy sees its types

log = logging.getLogger("p2ptrain.training.local.group")  # (the group's lines, as before)

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"  # gloo listens on this interface: loopback, for a group inside a host


def loopback_store(world_size: int, timeout: float) -> TCPStore:
    """Rank 0's TCPStore on a fresh port of 127.0.0.1 only: left to itself, the store listens on every
    interface, and anyone who reaches the port could write commands for the workers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    wait = datetime.timedelta(seconds=timeout)
    try:  # the store owns the socket from here on (and closes it)
        return TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=True,
            timeout=wait,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except RuntimeError as e:  # listening sockets can be handed over on Linux only
        os.close(fd)
        log.warning("the local group's store listens on every interface (%s)", first_line(e))
        return TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=wait, wait_for_workers=False)


def loopback_interface() -> str | None:
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


@contextlib.contextmanager
def gloo_on_loopback(backend: str) -> Iterator[None]:
    """Without this, gloo listens on the address the host name resolves to, often one the LAN reaches.
    Only the process group's creation reads the variable, so it is set for that moment alone."""
    lo = loopback_interface() if backend == "gloo" else None
    if lo is None:
        yield
        return
    before = os.environ.get(GLOO_INTERFACE)
    os.environ[GLOO_INTERFACE] = lo
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_INTERFACE, None)
        else:
            os.environ[GLOO_INTERFACE] = before


def peek(proc: subprocess.Popen[bytes]) -> int | None:
    """The process's exit status if it ended, without reaping it, so that its process group id stays
    ours to kill (the worker's own children die with it)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.returncode is None:  # not reaped yet: the pid, and the group it leads, are still ours
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("local worker pid %d survived SIGKILL for 10 s", proc.pid)


def describe(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with code {status}"


def first_line(e: BaseException) -> str:
    """The gist of a torch error: its first line, without the C++ source location gloo puts first."""
    lines = str(e).strip().splitlines()
    gist = re.sub(r"^\[[^]]*\] ", "", lines[0]) if lines else ""
    return f"{type(e).__name__}: {gist}"
