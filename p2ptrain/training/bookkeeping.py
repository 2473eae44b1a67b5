"""What a CollaborativeOptimizer counts: its round outcomes, its samples per second, and the run's
fingerprint (what peers of one run must share)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..averaging.compression import parse_compression
from ..config import RunConfig

RATE_HALF_LIFE = 10.0  # seconds: how fast the advertised samples/s follows changes


@dataclass
class RoundStats:
    """What the optimizer did so far (shown on the console, written to the metrics)."""

    steps: int = 0  # global steps taken (averaged or alone)
    averaged: int = 0  # global steps that averaged with others
    solo: int = 0  # global steps taken alone (no other peer on the epoch)
    aborted: int = 0  # rounds that aborted (nothing applied)
    no_group: int = 0  # matchmaking attempts that formed no group
    syncs: int = 0  # state downloads applied
    last: dict[str, Any] = field(default_factory=dict)  # the last round's outcome


class RateMeter:
    """Samples per second, exponentially smoothed over time."""

    def __init__(self, half_life: float = RATE_HALF_LIFE) -> None:
        self.half_life = half_life
        self.rate = 0.0
        self._last: float | None = None
        self._pending = 0

    def add(self, samples: int, now: float) -> None:
        if self._last is None:  # the clock starts now: when these samples began is not known
            self._last, self._pending = now, 0
            return
        self._pending += samples
        dt = now - self._last
        if dt < 0.2:  # too short to measure; carry the samples into the next interval
            return
        alpha = 1 - 0.5 ** (dt / self.half_life)
        instant = self._pending / dt
        self.rate = instant if self.rate == 0 else self.rate + alpha * (instant - self.rate)
        self._last, self._pending = now, 0


def run_fingerprint(config: RunConfig, model: torch.nn.Module) -> bytes:
    """What all peers of a run must share: the run's identity and step rule, and the model's shape
    (records of peers that differ are ignored). Task options that leave the model as it is (how much
    text to read, say) do not split a run."""
    shared = {
        "run": config.run.id,
        "seed": config.run.seed,
        "task": config.task.name,
        "mode": config.training.mode,
        "target": config.training.target_batch_size,
        "model": [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()],
    }
    if config.training.mode == "diloco" and config.diloco.fragments > 1:  # which fragment each step averages
        shared["fragments"] = config.diloco.fragments
    if parse_compression(config.averaging.compression).sparse:
        # the sparse wire layout (4: Elias-Fano indices, sums of their used slots only; 2 had 16- and
        # 12-bit indices): peers of releases that encode it otherwise would fail every round together,
        # so they are not one run
        shared["sparse_layout"] = 4
    return hashlib.blake2b(json.dumps(shared, sort_keys=True).encode(), digest_size=16).digest()
