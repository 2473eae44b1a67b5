"""Bounds on a round's result that a member checks alone, before anything of it is applied (pure).

The invariant: an honest member never refuses an honest result, and an honest reducer never refuses an
honest slice, whatever the spread of the honest contributors' work per round (their weights), as long
as their values *per unit of weight* are within ``SPREAD`` of each other; a result or slice beyond what
such a round could produce with the weights the round counted is refused before anything of it lands.

Theory of operation: a partition's result is the weighted mean of its contributors' slices (or a robust
rule: trimmed mean, centered clip), so ``||mean_p|| <= sum_j w_j ||x_j|| / W`` (the triangle inequality;
``||x_j|| >= ||x_j,p||``: whole vectors, so a contributor whose values crowd into one partition, sparse
embedding rows, is covered), and a robust rule's ``||r_p|| <= sqrt(sum_j ||x_j||^2)`` (each coordinate
within the range of the rows it kept). Honest values legitimately differ by far more than any fixed
factor, but most of that is work per round, which the weights count: DiLoCo pseudo-gradients grow with
a host's inner steps (linearly while its steps stay aligned, as the square root after), a restarted
member's are as small as the few steps it took, a summed gradient grows with its samples. So a member
``m`` with weight ``w_m`` takes its own values as a measure of the size *per unit of weight*, and an
honest contributor ``j`` as at most ``SPREAD * ||x_m|| * max(1, w_j / w_m)`` (no more per unit of weight
above ``m``'s weight, no more in all below it: a mean gradient over few samples is noisier, not
larger per sample). Summed over the round's weights that gives the limit, per partition:

- ``||result_p|| <= SPREAD * F * max(||own_p||, ||own||) + SLACK * sqrt(d_p)``, ``own`` the whole vector
  this member sends, ``F`` = :func:`reach` of the counted weights: ``sum_j w_j max(1, w_j/w_m) / W`` for a
  mean (1 when no weight exceeds ``w_m``; about ``w_max / w_m`` when one dominates), and
  ``sqrt(sum_j max(1, w_j/w_m)^2)`` for a robust rule; no coordinate is larger than that norm either.

Before the decision (the early results of a pipelined round) a member knows only the weights sent to it
as a reducer: a chunk beyond the limit those give is not a fault yet: the early fetch stops, and once
the decision is in, what it refused is judged again by the decision's signed weights (each capped at
``WEIGHT_SLACK`` times what this member finds plausible for its sender, ``agreement``): its reducer's
fault if it breaks that limit too, else the result is fetched again (``gathering``).

A reducer ``r`` holds each contributor's slice of its partition to the same measure, with the slice's
own (capped) weight: ``||x_j,p|| <= SPREAD * max(1, w_j/w_r) * max(||own_r||, ||last accepted result||)``
(``reducer``: a slice beyond it is refused and its sender left out). Its last accepted result counts
too, so that a reducer whose own values are small this round (a few inner steps) does not refuse the
others' honest slices.

Where every value it sends is zero, its recent accepted result stands in for its own values
(:class:`ResultHistory`, recorded only from rounds bounded by its own values, so a liar cannot ratchet
it up round after round). A member with neither (it sent only zeros and never accepted a result) has
nothing to bound by: :func:`limit` returns None, and only the form checks apply (its tensors are the
caller's business: the training loop never averages an all-zero contribution). A member whose own
values are not finite (the averager refuses such tensors; only a member that spoils its own buffer
mid-round has them) has no size either, and an infinite bound would pass anything: its limit is
:data:`NOTHING`, which no result and no slice passes. No comparison here passes on NaN: each is written
``not value <= bound``.

``SPREAD`` is 128: sample noise (a mean gradient over 8 samples against one over 1,000), gradient spikes
of 100x on one peer's batch, a host 100x slower than its mates (its weight says so), sparse rows, top-k
residuals and quantized sums all stay inside it. ``tests/unit/test_result_bounds.py`` draws such rounds
over many seeds: none trips it (the fixed 32x bound this replaced, on its own values alone, refused
restarted DiLoCo members, slow hosts beside fast ones and a pipeline stage's honest mean). What an
honest swarm still risks: two honest peers of the same weight whose values differ by more than 128x per
unit of weight.

What a reducer can still do within the limit, without being caught by it: serve, in the partition it
reduces, any values of norm up to ``SPREAD * F`` times the member's own whole vector's: a sign flip,
noise, or a step up to that many honest steps' size, there, per round (``F`` is 1 in a round of equal
weights; the weights are the decision's, each capped at twice what the member finds plausible, so a
hostile leader cannot widen it by deciding huge weights). That bounds magnitudes (no overflow, no
1e30); it does not make a hostile step harmless: an audited round's audit convicts it (after the
round), a top-k round is not audited (top-k is for private swarms, see ``config``). A result beyond
the limit is never applied, and the reducer that served it is banned at once by the member that caught
it. What a hostile *contributor* can still do: send slices just under a reducer's limit in a plain-mean
round; where the honest reducer's values per unit of weight are larger than a member's, that can push
its mean past the member's limit, and that member then refuses the round and bans an honest reducer.
It costs the attacker a place in the group each time; the robust rules (trimmed mean, centered clip)
remove such slices before they count. A free identity with a weight and no work (zeros, or values far
below an honest peer's per unit of weight) refuses honest slices as a reducer, as any hostile reducer
may: those contributors are left out of that round.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

SPREAD = 128.0
"""How far apart, per unit of weight, honest values may be for no honest result or slice to be refused
(see the module docstring)."""
BOUND = 32.0
"""How many times the size of the last result a peer applied itself a replayed result may be
(``training.state.replay``: one result against another of the same swarm, not against own values)."""
MAX_REACH = 1e30  # (the weights' ratio is clamped: finite, so the limit stays a number)
SLACK = 1e-6
"""An absolute allowance per element: results where a member's own values are (near) zero."""
MAX_HISTORIES = 8  # tensor layouts whose last accepted result a member remembers


@dataclass(frozen=True)
class Scale:
    """The size of some values: the sum of their squares, their largest magnitude, their count."""

    sumsq: float = 0.0
    absmax: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, values: torch.Tensor | np.ndarray) -> Scale:
        """The scale of a 1-D float tensor or array (one pass for each figure; no temporary as large as
        it)."""
        if isinstance(values, np.ndarray):  # (raw bytes off the wire: maybe read-only, no tensor of them)
            n = values.size
            if n == 0:
                return cls()
            absmax = max(-float(values.min()), float(values.max()))
            norm = math.sqrt(float(np.dot(values, values)))
        else:
            n = values.numel()
            if n == 0:
                return cls()
            lo, hi = torch.aminmax(values)
            absmax = max(-float(lo), float(hi))
            norm = float(torch.linalg.vector_norm(values))
        if not math.isfinite(absmax):  # NaN compares false: make it count as unbounded
            absmax = math.inf
        return cls(norm * norm if math.isfinite(norm) else math.inf, absmax, n)

    @property
    def norm(self) -> float:
        return math.sqrt(self.sumsq)

    @property
    def rms(self) -> float:
        return math.sqrt(self.sumsq / self.count) if self.count else 0.0

    @property
    def zero(self) -> bool:
        return self.absmax == 0.0

    def __add__(self, other: Scale) -> Scale:
        """The scale of both sets of values together."""
        return Scale(self.sumsq + other.sumsq, max(self.absmax, other.absmax), self.count + other.count)

    @staticmethod
    def total(scales: Iterable[Scale]) -> Scale:
        out = Scale()
        for s in scales:
            out = out + s
        return out


@dataclass(frozen=True)
class Limit:
    """The most a partition's result may be, for this member: its norm and its largest magnitude."""

    norm: float
    absmax: float

    def scaled(self, factor: float) -> Limit:
        """This limit ``factor`` (>= 1) times as large (NaN stays NaN: :data:`NOTHING` passes nothing)."""
        f = min(max(1.0, factor), MAX_REACH) if math.isfinite(factor) else MAX_REACH
        return Limit(self.norm * f, self.absmax * f)


NOTHING = Limit(math.nan, math.nan)
"""The limit of a member whose own values are not finite: no comparison with NaN passes, so nothing
does (it has no size to bound a result by, and a bound of infinity would accept any)."""


def reach(mine: float, weights: Sequence[float], *, robust: bool = False) -> float:
    """``F``: how many times its own size per unit of weight a member of weight ``mine`` accepts in a
    result of contributors of ``weights`` (see the module docstring); at least 1, at most ``MAX_REACH``."""
    ws = [w for w in weights if math.isfinite(w) and w > 0]
    if not ws or not (math.isfinite(mine) and mine > 0):  # (the averager refuses such weights)
        return 1.0
    ratios = [max(1.0, w / mine) for w in ws]
    if robust:
        f = math.sqrt(math.fsum(r * r for r in ratios))
    else:
        f = math.fsum(w * r for w, r in zip(ws, ratios, strict=True)) / math.fsum(ws)
    return min(max(1.0, f), MAX_REACH) if math.isfinite(f) else MAX_REACH


def limit(own: Scale, whole: Scale, history: Scale | None = None, *, factor: float = 1.0) -> Limit | None:
    """The limit of a partition's result for a member whose own values there have scale ``own``, and
    over all it sends ``whole``; ``history``: its last accepted result's scale over the whole vector
    (used only where ``whole`` is zero); ``factor``: :func:`reach` of the round's weights. None:
    nothing to bound by."""
    if not all(math.isfinite(x) for x in (own.sumsq, own.absmax, whole.sumsq, whole.absmax)):
        return NOTHING  # (an infinite bound would pass anything: none passes instead)
    base = whole if not whole.zero else history
    if base is None or base.zero:
        if own.zero:
            return None
        base = own
    d = own.count
    norm = SPREAD * max(1.0, factor) * max(own.norm, base.norm) + SLACK * math.sqrt(d)
    return Limit(norm, norm)  # (no coordinate is larger than the norm)


class ResultCheck:
    """One fetch of one partition's result, checked chunk by chunk as it arrives against its limit
    (None: unchecked); keeps the scale of what it passed (``seen``), and of what it refused
    (``refused``: everything up to and with the chunk that broke the limit)."""

    def __init__(self, bound: Limit | None) -> None:
        self.bound = bound
        self.seen = Scale()
        self.refused: Scale | None = None

    def add(self, values: torch.Tensor | np.ndarray) -> str:
        """Take the next chunk of the result; why it breaks the limit ('' if it does not). A chunk that
        breaks it is not counted: nothing of it may be applied."""
        seen = self.seen + Scale.of(values)
        why = breaks(seen, self.bound)
        if why:
            self.refused = seen
            return why
        self.seen = seen
        return ""


def breaks(seen: Scale, b: Limit | None) -> str:
    """Why values of scale ``seen`` break the limit ``b`` ('' if they do not; None: unchecked)."""
    if b is None:
        return ""
    if math.isnan(b.norm) or math.isnan(b.absmax):
        return "this member's own values there are not finite: it accepts nothing to apply"
    if not seen.absmax <= b.absmax:  # (NaN fails too)
        return (
            f"a value of magnitude {seen.absmax:.4g} in its result, over the {b.absmax:.4g} this"
            f" member accepts ({SPREAD:g}x its own size per unit of weight, for the round's weights)"
        )
    if not seen.norm <= b.norm:
        return (
            f"its result's norm reached {seen.norm:.4g}, over the {b.norm:.4g} this member"
            f" accepts ({SPREAD:g}x its own size per unit of weight, for the round's weights)"
        )
    return ""


class ResultHistory:
    """A member's last accepted result per tensor layout: its whole vector's scale, for rounds in which
    it sends only zeros, and its values (bfloat16: 2 bytes per element), against which the slices it
    reduces next must carry new work (``trust.useful``: an echo of the last result earns no trust).
    Owned by the averager across rounds; bounded (``MAX_HISTORIES`` layouts)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[Hashable, Scale] = OrderedDict()
        self._values: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    def get(self, key: Hashable) -> Scale | None:
        return self._kept.get(key)

    def prior(self, key: Hashable, numel: int) -> torch.Tensor | None:
        """The values of the last result accepted for ``key`` (None: none, or of another length)."""
        values = self._values.get(key)
        return values if values is not None and values.numel() == numel else None

    def remember(self, key: Hashable, values: torch.Tensor) -> None:
        """The values of a result accepted for ``key`` (copied, as bfloat16)."""
        kept = self._values.pop(key, None)
        if kept is not None and kept.numel() == values.numel():
            kept.copy_(values.reshape(-1))  # (no new allocation round after round)
        else:
            kept = values.detach().reshape(-1).to(torch.bfloat16, copy=True)
        self._values[key] = kept
        while len(self._values) > MAX_HISTORIES:
            self._values.popitem(last=False)

    def record(self, key: Hashable, result: Scale, own: Scale) -> None:
        """A round was accepted with ``result`` where this member sent ``own``: kept only when its own
        values bounded it (so what was bounded by history never becomes history)."""
        if own.zero or result.count != own.count:
            return
        self._kept[key] = result
        self._kept.move_to_end(key)
        while len(self._kept) > MAX_HISTORIES:
            self._kept.popitem(last=False)
