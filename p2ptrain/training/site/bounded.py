"""Rank 0's waits on the other ranks of its site, each bounded by the deadline it was given.

Theory of operation. A rank that hangs (stopped, swapping, a deadlock) holds rank 0 in whatever rank 0
waits on it for next, so rank 0 bounds every such wait by the deadline of the command it serves
(``commands.Deadlines``): that deadline is how soon a site finds a hung rank and restarts its group.
torch sets a process group's timeout when it makes the group, and a site's group is made with the long
start timeout (a spawned rank on a busy host takes minutes to start). :func:`set_timeout` changes it
afterwards (torch's ``_set_pg_timeout``), but only for collectives: gloo's point-to-point send and
receive wait on the timeout the group's transport was made with. Measured with torch 2.13 on gloo: after
a group made with 20 s was set to 3 s, a broadcast from a stopped rank raised after 3 s and a receive
from it after 20 s. A site's rank 0 receives every round's pieces, every hash's split chunks and every
snapshot chunk point to point, so a rank that hung there held its site for the whole start timeout
(300 s), with nothing logged.

The invariant: **every wait of rank 0 on another rank, collective or point to point, ends within the
deadline set last for its group.** Collectives get it from torch (:func:`set_timeout`); point-to-point
transfers go through :func:`send` and :func:`recv` here, which post the transfer and wait on it with
that deadline (``Work.wait(timeout)``: gloo raises past it; NCCL's path is untested here, with no
multi-GPU run). Nothing else in the site calls torch's ``send`` or ``recv``. A group whose deadline
was never set (the other ranks': they wait for rank 0, which may be busy in a round for minutes) waits
as long as the group's own timeout says.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_deadlines: dict[int, tuple[Any, float]] = {}
"""id(group) -> (group, seconds): the deadline set last for each group this process set one for (the
group is held so that its id is not reused by a later one; one entry per site generation)."""


def _group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def set_timeout(seconds: float, group: Any = None) -> bool:
    """From now on every wait of this process on ``group`` (None: the default group) ends within
    ``seconds``: its collectives through torch (gloo raises; NCCL's watchdog aborts), its point-to-point
    transfers through :func:`send` and :func:`recv`. Changing a group's collective timeout after it was
    made is ``torch.distributed``'s ``_set_pg_timeout`` (gloo and NCCL), which is not public API: where
    it is missing, the group keeps the timeout it began with and this says False."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    try:
        setter(datetime.timedelta(seconds=seconds), group)
    except (AttributeError, RuntimeError, ValueError) as e:
        log.warning("cannot change the site's collective timeout (%s): it stays as the group began", e)
        return False
    g = _group(group)
    _deadlines[id(g)] = (g, seconds)
    return True


def deadline(group: Any = None) -> float | None:
    """The seconds :func:`set_timeout` set last for ``group``; None where it set none."""
    entry = _deadlines.get(id(_group(group)))
    return entry[1] if entry is not None and entry[0] is _group(group) else None


def _wait(work: Any, group: Any) -> None:
    seconds = deadline(group)
    if seconds is None:
        work.wait()  # (the group's own timeout)
    else:
        work.wait(datetime.timedelta(seconds=seconds))


def send(tensor: torch.Tensor, dst: int, group: Any = None) -> None:
    """``tensor`` to global rank ``dst``, waited for within the group's deadline (see the module)."""
    _wait(dist.isend(tensor, dst=dst, group=group), group)


def recv(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """Into ``tensor`` from global rank ``src``, waited for within the group's deadline."""
    _wait(dist.irecv(tensor, src=src, group=group), group)
