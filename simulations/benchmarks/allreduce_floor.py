"""The plain-socket floor of the all-reduce benchmark: one peer of a butterfly all-reduce over raw TCP.

No encryption, no framing beyond an 8-byte length before each message, no event loop: blocking sockets,
one sender and one receiver thread per other peer, numpy for the sums. This is what the machine itself
allows; every real system is measured against it.

The all-reduce (equal partitions, as in hivemind's butterfly): the vector is cut into N parts, peer j
owns part j. Reduce-scatter: every peer sends part j of its vector to peer j and averages the N-1 copies
of its own part it receives. All-gather: every peer sends its averaged part to all others and receives
theirs straight into the result. Each peer sends and receives 2 (N-1)/N of the vector per round. Parts
travel in 1 MiB messages, and each message of a peer's own part is averaged and sent on as soon as all
its copies are in, so the two phases overlap.

Addresses: the floor needs every peer's address (it dials peers with a lower index and accepts those with
a higher one), so it waits for the harness's ``peers`` command; ``--join`` is accepted and unused. Run by
``simulations.benchmarks.allreduce`` (see its contract); alone::

    python -m simulations.benchmarks.allreduce_floor --index 0 --peers 2 --mb 8 --rounds 3 \
        --listen 127.0.0.1:0
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from simulations.benchmarks.allreduce import (
    Commands,
    emit,
    exact_mean,
    numel_for,
    pattern,
    peer_parser,
    split_addr,
)

HEADER = struct.Struct("!Q")
HELLO = struct.Struct("!I")
CHUNK = 1 << 18  # elements per message: 1 MiB of fp32


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k


def recv_message(sock: socket.socket, view: memoryview) -> None:
    header = bytearray(HEADER.size)
    recv_exact(sock, memoryview(header))
    (length,) = HEADER.unpack(header)
    if length != len(view):
        raise ConnectionError(f"expected {len(view)} bytes, the peer announced {length}")
    recv_exact(sock, view)


def send_message(sock: socket.socket, view: memoryview) -> int:
    sock.sendall(HEADER.pack(len(view)))
    sock.sendall(view)
    return HEADER.size + len(view)


def connect_mesh(
    index: int, addrs: list[str], server: socket.socket, timeout: float
) -> dict[int, socket.socket]:
    """One TCP connection to every other peer: dial the lower indices, accept the higher ones."""
    socks: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    for j in range(index):
        host, port = split_addr(addrs[j])
        sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        sock.sendall(HELLO.pack(index))
        socks[j] = sock
    server.settimeout(timeout)
    while len(socks) < len(addrs) - 1:
        sock, _ = server.accept()
        sock.settimeout(timeout)
        hello = bytearray(HELLO.size)
        recv_exact(sock, memoryview(hello))
        (j,) = HELLO.unpack(hello)
        if not index < j < len(addrs) or j in socks:
            raise ConnectionError(f"unexpected hello from peer {j}")
        socks[j] = sock
    for sock in socks.values():
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


class Butterfly:
    """The all-reduce, pipelined by chunks: a chunk of this peer's part is averaged as soon as every peer's
    copy of it has arrived, and sent on at once, so the all-gather overlaps the reduce-scatter (a slow
    flow does not leave the other links idle at the boundary between the two phases)."""

    def __init__(self, index: int, socks: dict[int, socket.socket], data: np.ndarray, timeout: float) -> None:
        self.index, self.socks, self.data, self.timeout = index, socks, data, timeout
        self.n = len(socks) + 1
        self.bounds = [k * data.size // self.n for k in range(self.n + 1)]
        self.out = np.empty_like(data)
        self.inbox = {j: np.empty_like(self.part(index)) for j in socks}
        self.pool = ThreadPoolExecutor(2 * len(socks), thread_name_prefix="floor")

    def part(self, j: int, array: np.ndarray | None = None) -> np.ndarray:
        a = self.data if array is None else array
        return a[self.bounds[j] : self.bounds[j + 1]]

    @staticmethod
    def chunks(size: int) -> list[slice]:
        return [slice(k, min(size, k + CHUNK)) for k in range(0, size, CHUNK)]

    def _send(self, j: int, reduced: list[threading.Event]) -> int:
        sock, sent = self.socks[j], 0
        theirs = self.part(j)
        for c in self.chunks(theirs.size):
            sent += send_message(sock, memoryview(theirs[c]).cast("B"))
        mine = self.part(self.index, self.out)
        for c, ready in zip(self.chunks(mine.size), reduced, strict=True):
            if not ready.wait(self.timeout):
                raise TimeoutError("own part not reduced in time")
            sent += send_message(sock, memoryview(mine[c]).cast("B"))
        return sent

    def _recv(self, j: int, counts: list[int], lock: threading.Lock, reduced: list[threading.Event]) -> None:
        sock, inbox = self.socks[j], self.inbox[j]
        for k, c in enumerate(self.chunks(inbox.size)):
            recv_message(sock, memoryview(inbox[c]).cast("B"))
            with lock:
                counts[k] += 1
                last = counts[k] == self.n - 1
            if last:  # every copy of chunk k is here: average it (numpy releases the GIL)
                acc = self.part(self.index, self.out)[c]
                np.copyto(acc, self.part(self.index)[c])
                for box in self.inbox.values():
                    np.add(acc, box[c], out=acc)
                np.divide(acc, self.n, out=acc)
                reduced[k].set()
        theirs = self.part(j, self.out)
        for c in self.chunks(theirs.size):
            recv_message(sock, memoryview(theirs[c]).cast("B"))

    def round(self) -> int:
        """One all-reduce into ``self.out``; returns the bytes this peer sent."""
        nchunks = len(self.chunks(self.part(self.index).size))
        reduced = [threading.Event() for _ in range(nchunks)]
        counts, lock = [0] * nchunks, threading.Lock()
        jobs: list[Future[Any]] = []
        for j in self.socks:
            jobs.append(self.pool.submit(self._recv, j, counts, lock, reduced))
            jobs.append(self.pool.submit(self._send, j, reduced))
        deadline = time.monotonic() + self.timeout
        sent = 0
        for job in jobs:  # a failed job fails the round; its peers then fail on their sockets' timeouts
            sent += job.result(timeout=max(0.0, deadline - time.monotonic())) or 0
        return sent


def main(argv: list[str] | None = None) -> int:
    args = peer_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.compression != "none":
        emit("error", error=f"the floor averages fp32 only (asked: {args.compression})")
        return 2
    commands = Commands()
    try:
        numel = numel_for(args.mb)
        data = pattern(args.index, numel)
        expected = exact_mean(args.peers, numel)
        host, port = split_addr(args.listen)
        server = socket.create_server((host, port), backlog=args.peers)
        emit("listening", addr=f"{host}:{server.getsockname()[1]}")
        addrs = commands.wait("peers", args.timeout)["addrs"]
        socks = connect_mesh(args.index, addrs, server, args.timeout)
        butterfly = Butterfly(args.index, socks, data, args.timeout)
        for r in range(args.rounds):
            emit("ready", round=r)
            commands.wait("go", args.timeout, round=r)
            began = time.perf_counter()
            sent = butterfly.round()
            seconds = time.perf_counter() - began
            emit("round", round=r, seconds=round(seconds, 6), wire_bytes=sent)
            commands.wait("check", args.timeout, round=r)  # the others are done: checking costs no one
            emit("checked", round=r, max_err=float(np.max(np.abs(butterfly.out - expected))))
        emit("done")
    except Exception as e:
        emit("error", error=f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
