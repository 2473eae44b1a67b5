"""The ``[pipeline]`` section of a run file: how the model is split into stages and how micro-batches
travel between them (see docs/pipeline.md).

Parsed once, at the edge, into this frozen value; everything inside the pipeline takes it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..averaging.compression import DENSE, Compression, parse_compression
from ..errors import ConfigError
from .codec import Rounding, Wire

MAX_STAGES = 64


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"pipeline.{key} {what}")


@dataclass(frozen=True)
class PipelineSection:
    """``[pipeline]``: the stage boundaries by layer, the micro-batch, the activations' compression, the
    share of micro-batches checked on two peers, and the per-stage timeout and retries.

    An empty ``stages`` (the default) means no pipeline: the run is data-parallel."""

    stages: tuple[int, ...] = ()  # the first layer of each stage; starts with 0, strictly increasing
    micro_batch: int = 4  # samples per micro-batch
    # none, fp16, bf16, int8: activations and their gradients on the wire (a run file's text, parsed here)
    compression: Compression = Compression.INT8
    check_fraction: float = 0.0  # share of micro-batches sent to two peers of a stage and compared
    timeout: float = 10.0  # seconds one stage peer may take on one micro-batch before a retry elsewhere
    retries: int = 3  # other peers of a stage tried before a micro-batch is given up
    max_abs: float = 1e4  # an activation or gradient value beyond this magnitude is garbage
    # training.mode = "diloco": inner steps between a stage's outer averages (DiLoCo's H)
    local_steps: int = 8
    # > 0: activations and their gradients travel as rank-r factors, each coded with ``compression``
    # (``codec.Wire``); 0: whole
    rank: int = 0
    # int8: how a value rounds to its token's grid: "nearest" or "stochastic" (unbiased: the mean decoded
    # value is the value; measured worse at 40 steps: see docs/pipeline.md, "Measured")
    rounding: Rounding = Rounding.NEAREST

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        object.__setattr__(self, "stages", stages)
        if stages:
            _check(2 <= len(stages) <= MAX_STAGES, "stages", f"must list 2 to {MAX_STAGES} first layers")
            _check(stages[0] == 0, "stages", "must start with 0 (the first stage's first layer)")
            ok = all(isinstance(s, int) and not isinstance(s, bool) for s in stages)
            increasing = all(a < b for a, b in itertools.pairwise(stages))
            _check(ok and increasing, "stages", "must be increasing integers")
        _check(1 <= self.micro_batch <= 4096, "micro_batch", "must be between 1 and 4096")
        _check(0.0 <= self.check_fraction <= 1.0, "check_fraction", "must be in [0, 1]")
        _check(math.isfinite(self.timeout) and self.timeout > 0, "timeout", "must be positive")
        _check(0 <= self.retries <= 16, "retries", "must be between 0 and 16")
        _check(math.isfinite(self.max_abs) and self.max_abs > 0, "max_abs", "must be positive")
        _check(1 <= self.local_steps <= 100_000, "local_steps", "must be between 1 and 100000")
        ok = isinstance(self.rank, int) and not isinstance(self.rank, bool)
        _check(ok and 0 <= self.rank <= 4096, "rank", "must be an integer between 0 and 4096")
        try:
            mode = parse_compression(self.compression)
        except ValueError as e:
            raise ConfigError(f"pipeline.compression: {e}") from None
        _check(mode in DENSE, "compression", "must be none, fp16, bf16 or int8 (top-k drops activations)")
        object.__setattr__(self, "compression", mode)
        try:
            object.__setattr__(self, "rounding", Rounding(self.rounding))
        except ValueError:
            raise ConfigError(
                f"pipeline.rounding must be stochastic or nearest, not {self.rounding!r}"
            ) from None

    @property
    def wire(self) -> Wire:
        """How activations and their gradients travel (``codec.Wire``)."""
        return Wire(self.compression, self.rank, self.rounding)

    @property
    def enabled(self) -> bool:
        return bool(self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def bounds(self, n_layer: int) -> list[tuple[int, int]]:
        """``[(first, end), ...]``: the layers of each stage of a model of ``n_layer`` blocks."""
        if not self.stages:
            raise ConfigError("pipeline.stages is empty: this run has no pipeline")
        if self.stages[-1] >= n_layer:
            raise ConfigError(
                f"pipeline.stages {list(self.stages)} needs more than {n_layer} layers: every stage must"
                " hold at least one"
            )
        ends = [*self.stages[1:], n_layer]
        return list(zip(self.stages, ends, strict=True))
