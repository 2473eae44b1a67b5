"""Which swarm the data a task reads is shared with: set by the trainer, read by
:func:`p2ptrain.integrations.data.shard_indices` (in the threads that draw batches)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ...identity import PeerID
from ...node import Node

Trusted = Callable[[], Collection[PeerID] | None]


@dataclass(frozen=True)
class InLoop:
    """The node of the event loop that trains, called from the threads that read the data (the
    ``call`` of :class:`~p2ptrain.BackgroundNode`, for a node that runs in the caller's event loop)."""

    node: Node
    token: trio.lowlevel.TrioToken

    def call(self, fn: Callable[[], Any]) -> Any:
        return trio.from_thread.run(fn, trio_token=self.token)


@dataclass(frozen=True)
class DataSwarm:
    handle: InLoop
    data_dir: Path | None  # where a peer keeps its place in the data
    trusted: Trusted | None  # whose claims count (callable from any thread)


CURRENT: ContextVar[DataSwarm | None] = ContextVar("p2ptrain_data_swarm", default=None)


@contextlib.contextmanager
def reading_for(node: Node, data_dir: Path | None, trusted: Trusted | None = None) -> Iterator[None]:
    """While inside, data read in this task (or in threads it starts with ``trio.to_thread``) is shared
    out among ``node``'s swarm. Enter it in the event loop's thread."""
    token = trio.lowlevel.current_trio_token()
    in_loop: Trusted | None = None
    if trusted is not None:
        check = trusted

        def in_loop() -> Collection[PeerID] | None:
            return trio.from_thread.run_sync(check, trio_token=token)

    reset = CURRENT.set(DataSwarm(InLoop(node, token), data_dir, in_loop))
    try:
        yield
    finally:
        CURRENT.reset(reset)
