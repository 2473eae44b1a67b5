"""Averaging synthetic tensors with the swarm: what ``p2ptrain average`` runs.

Each peer averages a shared pattern plus an offset derived from its own peer id, so any member can check
its result against the exact mean over the contributors the round names, without knowing anything else
about them. One JSON line per round goes to stdout: time, group, contributors, who was left out and why,
and the largest error against the exact mean.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

import torch
import trio

from ..errors import GroupFormationFailed, RoundAborted
from ..identity import PeerID

log = logging.getLogger(__name__)


def offset_of(peer: PeerID) -> float:
    """A per-peer constant, exact in float32 (a multiple of 1/64 below 16)."""
    return (peer.as_int % 1021) / 64.0


def pattern(numel: int) -> torch.Tensor:
    k = torch.arange(numel, dtype=torch.int64) % 4096
    return ((k * 37) % 4096 - 2048).to(torch.float32) / 1024.0


def max_error(result: torch.Tensor, base: torch.Tensor, contributors: list[PeerID]) -> float:
    expected = sum(offset_of(c) for c in contributors) / len(contributors)
    return float((result - base - expected).abs().max().item()) if result.numel() else 0.0


async def run_rounds(
    node: Any,
    *,
    numel: int,
    rounds: int,
    timeout: float,
    compression: str,
    out: TextIO = sys.stdout,
    lines: list[dict[str, Any]] | None = None,
    wait_peers: int = 1,
    wait_timeout: float = 120.0,
) -> None:
    """Average ``rounds`` times (0: until cancelled). Each round's line is printed to ``out`` and, when
    given, appended to ``lines`` (so a caller that cancels this still has every finished round). With
    ``wait_peers``, the first round waits (at most ``wait_timeout``) until that many members are known."""
    with trio.move_on_after(wait_timeout):
        while len(node.members) < wait_peers:  # noqa: ASYNC110 (the node re-reads the list every few s)
            await trio.sleep(0.2)
    base = pattern(numel)
    mine = offset_of(node.peer_id)
    r = 0
    while rounds == 0 or r < rounds:
        r += 1
        tensor = base + mine
        began = time.perf_counter()
        line: dict[str, Any] = {"round": r}
        try:
            res = await node.average(
                [tensor], timeout=timeout, group_key="synthetic", compression=compression
            )
        except (GroupFormationFailed, RoundAborted) as e:
            line |= {"error": f"{type(e).__name__}: {e}", "seconds": round(time.perf_counter() - began, 4)}
            if not torch.equal(tensor, base + mine):
                line["error"] += " (AND THE TENSOR CHANGED)"
        else:
            line |= {
                "round_id": res.round.hex()[:16],
                "seconds": round(time.perf_counter() - began, 4),
                "round_s": round(res.round_seconds, 4),
                "matchmaking_s": round(res.matchmaking_seconds, 4),
                "phases": res.phases,
                "group": res.group_size,
                "contributors": [c.short() for c in res.contributors],
                "excluded": {p.short(): why for p, why in res.excluded.items()},
                "max_err": max_error(tensor, base, res.contributors),
                "mb": round(numel * 4 / 1e6, 3),
                "share": round(res.reduced / numel, 4) if numel else 0.0,  # of the vector reduced here
                "announced_mb_s": round(node.averager.bandwidth / 1e6, 3),  # next round (0: not measured)
            }
        print(json.dumps(line), file=out, flush=True)
        if lines is not None:
            lines.append(line)
