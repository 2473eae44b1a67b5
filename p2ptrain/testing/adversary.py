"""Hostile peers on purpose: what a broken or malicious member does, for tests and adversarial scenarios.

``install(kind, averager)`` turns an honest node's averager into one that attacks every round it takes
part in, through the round's fault hook (it changes what this member sends or serves, never how the
others behave):

- ``nan``: its slices are NaN (the reducers refuse them: it is left out of every round);
- ``scale``: its slices are multiplied by 100;
- ``random``: its slices are noise a hundred times larger than its values;
- ``inflate``: it claims a hundred times the samples it did (far above what its progress records make
  plausible: every reducer refuses its slices, so it is left out of the rounds);
- ``garbage-reducer``: it adds noise to every partition it reduces, and serves that (an audit catches it).

Start a node with ``p2ptrain node ... --adversary KIND`` (a hidden flag, for simulations only).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..averaging.allreduce import AllReduceRound
from ..averaging.averager import Averager
from ..averaging.compression import Compression, encode
from ..averaging.partition import chunks

ADVERSARIES = ("nan", "scale", "random", "inflate", "garbage-reducer")
FACTOR = 100.0


def install(kind: str, averager: Averager, *, seed: int = 0) -> None:
    """Make ``averager`` attack every round it takes part in (see the module docstring)."""
    if kind not in ADVERSARIES:
        raise ValueError(f"unknown adversary {kind!r}; known: {', '.join(ADVERSARIES)}")
    generator = torch.Generator().manual_seed(seed)
    if kind == "inflate":
        honest = averager.run_round

        async def run_round(signed: Any, tensors: Any, *, weight: float = 1.0, in_place: bool = False) -> Any:
            return await honest(signed, tensors, weight=weight * FACTOR, in_place=in_place)

        averager.run_round = run_round  # type: ignore[method-assign]
        return

    async def fault(rnd: AllReduceRound, point: str) -> None:
        if point == "before_send" and kind in ("nan", "scale", "random"):
            _spoil(rnd, kind, generator)
        elif point == "after_reduce" and kind == "garbage-reducer":
            _garble(rnd, generator)

    averager.fault = fault


def _spoil(rnd: AllReduceRound, kind: str, generator: torch.Generator) -> None:
    """Change what this member sends to the others (the partition it reduces itself keeps its honest
    values: the attack is on the contribution, not a refusal to serve)."""
    for red in rnd.reducers.values():
        kept = red._kept.get(rnd.me)
        if kept:
            red._kept[rnd.me] = [t.clone() if isinstance(t, torch.Tensor) else t for t in kept]
    values = rnd.source
    with torch.no_grad():
        if kind == "nan":
            values.fill_(math.nan)
        elif kind == "scale":
            values.mul_(FACTOR)
        else:
            scale = FACTOR * float(values.abs().mean().clamp_min(1e-3))
            values.copy_(torch.randn(values.shape, generator=generator) * scale)


def _garble(rnd: AllReduceRound, generator: torch.Generator) -> None:
    """Add noise to every partition this member reduced, and serve that instead (encoded as the round
    says, so the other members accept the bytes)."""
    for red in rnd.reducers.values():
        if red.result is None:
            continue
        scale = FACTOR * float(red.result.abs().mean().clamp_min(1e-3))
        red.result.add_(torch.randn(red.result.shape, generator=generator) * scale)
        if red.mode is not Compression.NONE:
            red.encoded = [
                bytes(encode(red.result[a:b].contiguous(), red.mode)) for a, b in chunks(red.size, red.mode)
            ]
