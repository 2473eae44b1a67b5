"""Robust aggregation rules: what a reducer computes from its partition's slices when some may be hostile.

Theory of operation: with the plain weighted mean, one peer sending huge or garbage values moves the
result anywhere it likes. A robust rule bounds each peer's influence. Each reducer applies the round's
rule to its own partition (as BTARD's ButterflyClip applies CenteredClip per butterfly partition), so the
work stays spread over the group and no member ever needs the whole of anyone's tensors.

- ``trimmed_mean``: coordinate-wise, drop the ``TRIM`` fraction of largest and of smallest values (at
  least one each way once there are three slices or more), and average the rest.
- ``centered_clip``: start from the coordinate-wise median; repeat a few times: move toward the mean of
  every slice's difference, each difference clipped to norm ``tau``, where ``tau`` is the median distance
  of the slices to the median (a scale estimate that a minority of outliers cannot inflate).

Both ignore the senders' weights (which a liar could inflate too); weights still decide who takes part.
Both count origins, not ids: identities are free, so the slices of members that share an origin (a
subnet, as the group's leader saw them: see ``matchmaking``) are first averaged into one row, and the rule
weighs rows. A host with a hundred fresh keys in a group is one row, trimmed like any other outlier.
Both are deterministic for a given set of slices in member order, so every reducer computes the same bits
as any other would.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from .norms import row_norms


class Aggregation(enum.StrEnum):
    """A round's aggregation rule, parsed once from a run file (a ``str`` too: it travels as its name)."""

    MEAN = "mean"
    TRIMMED_MEAN = "trimmed_mean"
    CENTERED_CLIP = "centered_clip"


AGGREGATIONS = tuple(a.value for a in Aggregation)
TRIM = 0.25
CLIP_ITERATIONS = 5
OUTLIER_FACTOR = 5.0  # a slice this many times farther from the result than the median slice is named


def parse_aggregation(name: str) -> Aggregation:
    """The rule named by ``name`` (case-insensitive, ``-`` for ``_``); ValueError naming the known ones."""
    rule = str(name).strip().lower().replace("-", "_")
    if rule not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {name!r}; known: {', '.join(AGGREGATIONS)}")
    return Aggregation(rule)


def trimmed_count(k: int) -> int:
    """How many values are dropped at each end, out of ``k``."""
    return 0 if k < 3 else max(1, int(k * TRIM))


def trimmed_mean(rows: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise trimmed mean of a (k, n) float32 matrix."""
    k = rows.shape[0]
    t = trimmed_count(k)
    if t == 0:
        return rows.mean(dim=0)
    ordered = rows.sort(dim=0).values
    return ordered[t : k - t].mean(dim=0)


def centered_clip(rows: torch.Tensor, iterations: int = CLIP_ITERATIONS) -> torch.Tensor:
    """CenteredClip of a (k, n) float32 matrix, started at the coordinate-wise median."""
    if rows.shape[0] <= 2:
        return rows.mean(dim=0)
    v = rows.median(dim=0).values
    tau = row_norms(rows - v).median()
    if not torch.isfinite(tau) or tau == 0:
        return v
    for _ in range(iterations):
        diffs = rows - v
        scale = torch.clamp(tau / row_norms(diffs).clamp_min(1e-30), max=1.0)
        v = v + (diffs * scale.unsqueeze(1)).mean(dim=0)
    return v


def outliers(
    rows: torch.Tensor, result: torch.Tensor, factor: float = OUTLIER_FACTOR
) -> list[tuple[int, float]]:
    """The rows far from a robust ``result``: (row, its distance over the median row's distance) for
    every row more than ``factor`` times as far as the median one (none with fewer than three rows: no
    majority to measure against). The rule already bounded their influence; this names them."""
    if rows.shape[0] < 3:
        return []
    distances = row_norms(rows - result)
    median = distances.median()
    if not torch.isfinite(median) or median <= 0:
        return []
    ratios = (distances / median).tolist()
    return [(k, r) for k, r in enumerate(ratios) if not r <= factor]  # (a NaN distance counts as far)


def by_origin(rows: torch.Tensor, origins: Sequence[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """Rows of one origin averaged into one: (the rows the rule weighs, each one's rows in ``rows``).
    ``origins[k]``: the origin of row ``k`` (any labels; rows with equal labels are averaged, in order)."""
    groups: dict[int, list[int]] = {}
    for k, o in enumerate(origins):
        groups.setdefault(o, []).append(k)
    members = list(groups.values())
    if len(members) == rows.shape[0]:
        return rows, members
    return torch.stack([rows[g].mean(dim=0) if len(g) > 1 else rows[g[0]] for g in members]), members


def aggregate(rule: str, rows: torch.Tensor) -> torch.Tensor:
    """Apply a robust ``rule`` (not ``mean``: the reducer streams that one) to a (k, n) matrix."""
    if rule == "trimmed_mean":
        return trimmed_mean(rows)
    if rule == "centered_clip":
        return centered_clip(rows)
    raise ValueError(f"{rule!r} is not a robust aggregation rule")
