"""Sums of squares of partition-sized vectors, accumulated in float64 block by block.

A float32 reduction over tens of millions of values comes out low: torch's ``vector_norm`` of 16M
standard normal values is 0.07% under the exact norm, of 64M 0.5%, of 500M 9% (numpy's ``dot`` is no
better). Each value's square lands in an accumulator that holds the sum of millions of others, and the
low bits of every addition are lost, always downwards. A member signs its slice's scale from its whole
partition in one call while a reducer checks the same values chunk by chunk as they arrive, so at those
sizes an honest slice's signed norm was under what its reducer measured, beyond the compression's
margin, and honest slices of ~1B-parameter rounds were refused in every round.

The invariant: **every norm over a round's vectors is within a few float64 roundings of the exact
one, whatever the vector's length or how it is cut**: here each block of ``BLOCK`` values is reduced in
float64, and the blocks' sums are added in float64 (``math.fsum``). The cost is one float64 pass, about
as fast as the float32 one at these block sizes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BLOCK = 1 << 20
"""Values reduced at once: a float64 temporary of 8 MiB at most."""


def sum_of_squares(values: torch.Tensor | np.ndarray) -> float:
    """The sum of the squares of a 1-D float tensor or array, accurate to float64 (NaN or infinity
    where a value is not finite)."""
    n = values.size if isinstance(values, np.ndarray) else values.numel()
    sums = []
    for lo in range(0, n, BLOCK):
        block = values[lo : lo + BLOCK]
        if isinstance(block, np.ndarray):
            wide = block.astype(np.float64)
            sums.append(float(np.dot(wide, wide)))
        else:
            sums.append(float(torch.linalg.vector_norm(block, dtype=torch.float64)) ** 2)
    if not all(math.isfinite(s) for s in sums):
        return math.inf if not any(math.isnan(s) for s in sums) else math.nan
    return math.fsum(sums)


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """The float32 norm of each row of a (k, n) matrix, each accumulated in float64 over column blocks."""
    total = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    for lo in range(0, rows.shape[1], BLOCK):
        total += torch.linalg.vector_norm(rows[:, lo : lo + BLOCK], dim=1, dtype=torch.float64).square()
    return total.sqrt().to(torch.float32)
