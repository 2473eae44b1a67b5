"""Bounds on a round's result that a member checks alone, before anything of it is applied (pure).

Theory of operation: a partition's result is the weighted mean (or a robust rule: trimmed mean,
centered clip) of its contributors' slices, so it is no larger than the largest honest slice:
``||mean|| <= max_i ||x_i||`` (the triangle inequality, weights positive), and every robust rule here
keeps each coordinate within the range of the slices it kept. A member holds one of those slices, its
own, and knows how large it is. So before a fetched partition lands, the member checks it against its
own values (:class:`ResultCheck`, chunk by chunk as they arrive), with the partition's :class:`Limit`:

- norm: ``||result_p|| <= BOUND * max(||own_p||, rms * sqrt(d_p)) + SLACK * sqrt(d_p)``, where ``rms``
  is this member's typical element over the whole vector it sends (a partition where its own values are
  all zero, or small by chance, is bounded by its values elsewhere);
- magnitude: ``max|result_p| <= BOUND * absmax + SLACK``, ``absmax`` the largest value it sends.

A reducer holds every contributor's slice of its partition to the same limit, against its own values
(``reducer``: a slice beyond it is refused and its sender left out), so an honest reducer's mean stays
within ``BOUND`` times its own values: one hostile contributor sending huge values cannot make the
members refuse an honest reducer's result (and ban it).

Where every value it sends is zero, its recent accepted result stands in for its own values
(:class:`ResultHistory`, recorded only from rounds bounded by its own values, so a liar cannot ratchet
it up round after round). A member with neither (it sent only zeros and never accepted a result) has
nothing to bound by: :func:`limit` returns None, and only the form checks apply (its tensors are the
caller's business: the training loop never averages an all-zero contribution). A member whose own
values are not finite (the averager refuses such tensors; only a member that spoils its own buffer
mid-round has them) has no size either, and an infinite bound would pass anything: its limit is
:data:`NOTHING`, which no result and no slice passes. No comparison here passes on NaN: each is written
``not value <= bound``.

``BOUND`` is 32. Honest results stay inside it: the ratio ``||result|| / ||own||`` is at most the
spread of the honest slices' norms, and that spread comes from the members' differences in work per
round. Sync gradients of batches of 1 and of 1,000 samples differ ~32x in noise norm, but a
sample-weighted mean is smaller than the noisier slice, and robust rules weigh rows alike (~10x at
most in draws of such groups). DiLoCo pseudo-gradients grow with a host's inner steps (under Adam about
linearly while its steps stay aligned, as the square root once they do not): a host 16x slower than the
fastest member of its group sees up to ~16x its own norm (the aligned worst case), half the bound.
Quantized sums (int8, fp16, bf16, the top-k sum's 8-bit codes) are within a percent of the exact mean;
top-k contributions with error feedback differ by their residuals, a few times at most.
``tests/unit/test_result_bounds.py`` draws such rounds over many seeds: none trips it. The cost to an
honest swarm: a host that does under 1/32 of the fastest member's work per round, in aligned DiLoCo
steps, may refuse a true result (and ban its reducer); keep a run's hardware within ~16x (the weight
caps and bandwidth shares assume as much).

What a reducer can still do within the bound, without being caught by it: serve any values of at most
``BOUND`` times the member's own norm in its partition, and no coordinate above ``BOUND`` times the
member's largest value: a sign flip, noise, or a result up to 32x too large, in the partitions it
reduces (one partition of the group's vector per reducer). That is one step of at most 32 honest
steps' size there per round; an audited round's audit then convicts it (after the round), a top-k
round is not audited (top-k is for private swarms, see ``config``). A result beyond the bound is never
applied, and the reducer that served it is banned at once by the member that caught it. What a hostile
*contributor* can still do: send slices just under a reducer's limit (32x the reducer's own values) in
a plain-mean round; where the honest members' values differ by more than about ``BOUND / n`` in a
group of ``n``, that can push an honest reducer's mean past a smaller member's limit, and that member
then refuses the round and bans an honest reducer. It costs the attacker a place in the group each
time; the robust rules (trimmed mean, centered clip) remove such slices before they count.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

BOUND = 32.0
"""How many times its own values' size a member accepts in a result (see the module docstring)."""
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


NOTHING = Limit(math.nan, math.nan)
"""The limit of a member whose own values are not finite: no comparison with NaN passes, so nothing
does (it has no size to bound a result by, and a bound of infinity would accept any)."""


def limit(own: Scale, whole: Scale, history: Scale | None = None) -> Limit | None:
    """The limit of a partition's result for a member whose own values there have scale ``own``, and
    over all it sends ``whole``; ``history``: its last accepted result's scale over the whole vector
    (used only where ``whole`` is zero). None: nothing to bound by."""
    if not all(math.isfinite(x) for x in (own.sumsq, own.absmax, whole.sumsq, whole.absmax)):
        return NOTHING  # (an infinite bound would pass anything: none passes instead)
    base = whole if not whole.zero else history
    if base is None or base.zero:
        if own.zero:
            return None
        base = own
    d = own.count
    norm = BOUND * max(own.norm, base.rms * math.sqrt(d)) + SLACK * math.sqrt(d)
    absmax = BOUND * max(own.absmax, base.absmax) + SLACK
    return Limit(norm, absmax)


class ResultCheck:
    """One fetch of one partition's result, checked chunk by chunk as it arrives against its limit
    (None: unchecked); keeps the scale of what it passed."""

    def __init__(self, bound: Limit | None) -> None:
        self.bound = bound
        self.seen = Scale()

    def add(self, values: torch.Tensor | np.ndarray) -> str:
        """Take the next chunk of the result; why it breaks the limit ('' if it does not). A chunk that
        breaks it is not counted: nothing of it may be applied."""
        scale = Scale.of(values)
        seen = self.seen + scale
        b = self.bound
        if b is not None:
            if math.isnan(b.norm) or math.isnan(b.absmax):
                return "this member's own values there are not finite: it accepts nothing to apply"
            if not seen.absmax <= b.absmax:  # (NaN fails too)
                return (
                    f"a value of magnitude {seen.absmax:.4g} in its result, over the {b.absmax:.4g} this"
                    f" member accepts ({BOUND:g}x its own largest)"
                )
            if not seen.norm <= b.norm:
                return (
                    f"its result's norm reached {seen.norm:.4g}, over the {b.norm:.4g} this member"
                    f" accepts ({BOUND:g}x its own there)"
                )
        self.seen = seen
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
