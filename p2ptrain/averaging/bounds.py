"""Bounds on a round's result that a member checks alone, before anything of it is applied.

The invariant: **a member applies a partition's result only if it is within the limit its decided
contributors' signed scales give** (:func:`result_limit`), each scale believed no further than this
member's own cap on its signer (:func:`cap`); and **an honest reducer adds a slice only if it is within
its sender's signed scale and the reducer's cap on that sender** (:func:`widened`, :func:`over_cap`). The
form checks (sizes, encodings, finite values) come first and stay as they were.

The evidence: every contributor signs, with its identity key, one table of the scales of its slices of
every partition (:class:`ScaleTable`: round, then per partition its sum of squares and largest
magnitude; :func:`seal_table`) and sends it with each slice. The reducer checks the slice against its
partition's entry as it arrives (a slice larger than its own signed scale is refused and its sender left
out: a liar's claim must match its data) and serves, with the partition's result, the tags of the decided
contributors' tables it used (:func:`table_tag`, in the decision's order), with those tables in full that
the fetching member does not hold under the same tag (it names the tags it holds in its request). The
member opens each table once (:func:`open_table`: another signer, round or number of partitions is a
malformed result, its server's fault), so a round costs it one signature check per contributor, not one
per contributor and partition; a contributor that signs two tables of a round (one to each of two
reducers) only makes members fetch the other, and each partition is bounded by the table its reducer
used. The member bounds the result by what those scales allow:

- plain weighted mean: ``||sum w_i x_i / W|| <= sum (w_i / W) ||x_i||`` and ``max|.| <= sum (w_i / W)
  absmax_i`` (the triangle inequality, weights positive, the decision's weights);
- trimmed mean (``t`` rows trimmed each way; a row is an origin's mean, no larger than its members'
  mean scale): each kept value lies within the coordinate's ``(t+1)``-th largest and smallest, so leaving
  out any ``t`` rows some other row is at least as large there: the norm is at most the root of the sum
  of the squared norms of all rows but the ``t`` largest, the magnitude at most the ``(t+1)``-th largest;
- centered clip: it starts at the lower coordinate-wise median (within the rows but the ``q = (k-1)//2``
  largest, as above), and each of its ``CLIP_ITERATIONS`` steps moves it by at most ``tau``, the lower
  median of the rows' distances to that start (at most the ``q``-th smallest row norm plus the start's);
- each scale widened by the compression's rounding (``QUANTIZATION``: ``norm (1+eps) + eps absmax
  sqrt(d)``), and the result again (it is encoded with the round's compression too).

The result's chunks land as they arrive (finite, well formed); its scales come last and decide before
the partition counts as held. In place, the member's own values of the partition are saved first and
go back if the result is refused. Honest results pass: the limit is the honest slices' own sizes
combined as the rule combines them, however far apart the members' work is (a DiLoCo host with one
inner step beside one with a hundred, a member 70x its mate, sparse rows: its own slice zero where
others' are not, a member that sends only zeros). ``tests/unit/test_result_bounds_signed.py`` draws such
rounds over many seeds, through a real reducer.

What a hostile reducer can do: a result within its contributors' signed scales. With honest
contributors that is about one honest step (a garbage reducer's noise 100x its result is refused by
every member); its own scale counts at its weight, as anyone's. Identities are free, so it may collude
with hostile contributors who sign huge scales: a member believes a contributor's scale only up to its
:func:`cap`, ``CAP`` times a size per unit of weight: ``max(1, w_i / w_me)`` times the larger of the
member's own size there (its norm in the partition, at least its typical element times ``sqrt(d)``;
its largest magnitude anywhere) and the partition's :func:`typical` signed scale (the weighted lower
median of the decided contributors' scales, each weighed by its weight in the signed decision).
Colluders holding at most half the decision's weight cannot lift that median above the largest honest
scale, however many ids they sign with; and a reducer refuses a slice whose signed scale is beyond its
own cap on it (over the scales at hand when the slice completes). So k colluders move a result by no
more than their weight lets them move an honest reducer's mean, and nothing is believed because
several ids say it (under the robust rules the largest ``t`` or ``q`` rows do not count at all). The
typical scale is what lets a member whose own values are small (restarted, or with little work for its
weight) accept its mates' usual steps; the per-weight factor lets a host with little work accept its
mates' larger ones; a contributor of less weight may still be noisier (sync gradients of small
batches), hence never less than ``CAP`` times that size. ``CAP`` is 128: honest spreads stay inside it.

What is left: a contributor may send, through an honest reducer, a slice within that reducer's cap and
beyond another member's (their sizes, or the scales at hand, differ): that member then refuses an
honest reducer's result and bans it (the attacker spends a place in the group each time; robust rules
trim such rows). Colluders with more than half the decision's weight lift the typical scale: they
also own the plain mean of any honest reducer. The decision's weights are the coordinator's, checked
against each member's caps on weights (``agreement``), not by this module. Where every signed scale and
the member's own values are zero (and it has no accepted result, :class:`ResultHistory`), there is
nothing to cap by. A member whose own values are not finite accepts nothing (:data:`NOTHING`). No
comparison here passes on NaN: each is written ``not value <= bound``.

:func:`limit`, ``BOUND`` (32) times a member's own size, is the older bound by own values alone: it still
bounds what a member takes without signed scales (a catch-up replay's results, see ``training.state``),
and its size there (:func:`base`) is what :func:`cap` multiplies.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import RemoteProtocolError
from ..identity import Identity, PeerID, SignedEnvelope
from ..wire.codec import pack, unpack
from ..wire.schema import Message, bounded
from .compression import Compression
from .norms import sum_of_squares
from .protocol import MAX_GROUP, MAX_TABLE_ENVELOPE, TAG_BYTES
from .robust import CLIP_ITERATIONS, trimmed_count

BOUND = 32.0
"""How many times its own values' size a member accepts in a result (see the module docstring)."""
SLACK = 1e-6
"""An absolute allowance per element: results where a member's own values are (near) zero."""
MAX_HISTORIES = 8  # tensor layouts whose last accepted result a member remembers
CAP = 128.0
"""How many times its own values' size, per unit of its own weight, a member believes of a contributor's
signed scale, per unit of that contributor's weight (see the module docstring: what a hostile reducer's
colluders can add to a partition's bound)."""
TABLE_DOMAIN = "p2ptrain/averaging-scales"
_ENTRY = struct.Struct("<dd")  # a partition's scale in a signed table: sum of squares, largest magnitude
QUANTIZATION = {
    Compression.NONE: 1e-4,  # (float32 sums: rounding only)
    Compression.FP16: 2e-3,
    Compression.BF16: 8e-3,
    Compression.INT8: 1e-2,  # (half a step of absmax / 127 per element)
}
"""Per mode, ``eps``: a decoded value differs from what was encoded by at most ``eps`` times the largest
magnitude encoded with it (top-k modes: 1, they drop and requantize values)."""


@dataclass(frozen=True)
class Scale:
    """The size of some values: the sum of their squares, their largest magnitude, their count."""

    sumsq: float = 0.0
    absmax: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, values: torch.Tensor | np.ndarray) -> Scale:
        """The scale of a 1-D float tensor or array (one pass for each figure; no temporary as large as
        it). The sum of squares is float64's however long the values are (``norms``): a member's
        signed scale of a whole partition and its reducer's, summed chunk by chunk, agree."""
        if isinstance(values, np.ndarray):  # (raw bytes off the wire: maybe read-only, no tensor of them)
            n = values.size
            if n == 0:
                return cls()
            absmax = max(-float(values.min()), float(values.max()))
        else:
            n = values.numel()
            if n == 0:
                return cls()
            lo, hi = torch.aminmax(values)
            absmax = max(-float(lo), float(hi))
        sumsq = sum_of_squares(values)
        if not math.isfinite(absmax):  # NaN compares false: make it count as unbounded
            absmax = math.inf
        return cls(sumsq if math.isfinite(sumsq) else math.inf, absmax, n)

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
                    " member accepts"
                )
            if not seen.norm <= b.norm:
                return f"its result's norm reached {seen.norm:.4g}, over the {b.norm:.4g} this member accepts"
        self.seen = seen
        return ""

    def within(self, bound: Limit | None) -> str:
        """Why everything passed so far breaks ``bound`` ('' if it does not; None: no bound)."""
        if bound is None:
            return ""
        if math.isnan(bound.norm) or math.isnan(bound.absmax):
            return "this member's own values there are not finite: it accepts nothing to apply"
        if not self.seen.absmax <= bound.absmax:
            return (
                f"a value of magnitude {self.seen.absmax:.4g} in its result, over the {bound.absmax:.4g} its"
                " contributors' signed scales allow"
            )
        if not self.seen.norm <= bound.norm:
            return (
                f"its result's norm is {self.seen.norm:.4g}, over the {bound.norm:.4g} its contributors'"
                " signed scales allow"
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


# ---- signed scales: evidence a reducer cannot forge -------------------------------------------------------


@dataclass(frozen=True)
class ScaleTable(Message):
    """What a contributor signs about its whole contribution to one round: the scale of its slice of
    every partition, in partition order (each a little-endian float64 pair: sum of squares, largest
    magnitude; the counts are the round's partition sizes)."""

    round: bytes = bounded(max_len=16)
    scales: bytes = bounded(max_len=_ENTRY.size * MAX_GROUP)


def seal_table(identity: Identity, round_: bytes, scales: Sequence[Scale]) -> bytes:
    """This member's signed scales of its slices (sent with each slice to its reducer, who serves its tag
    with the partition's result). Scales that are not all finite cannot be signed: b"" (a slice that holds
    NaN or infinite values, which every reducer refuses anyway)."""
    if not all(math.isfinite(s.sumsq) and math.isfinite(s.absmax) for s in scales):
        return b""
    packed = b"".join(_ENTRY.pack(s.sumsq, s.absmax) for s in scales)
    return SignedEnvelope.seal(identity, TABLE_DOMAIN, pack(ScaleTable(round_, packed).to_obj())).to_bytes()


def open_table(data: bytes, author: PeerID, round_: bytes, sizes: Sequence[int]) -> tuple[Scale, ...]:
    """The scales ``author`` signed for its slices of this round's partitions (of ``sizes`` elements);
    RemoteProtocolError if they are missing, malformed, signed by another key or for another round or
    number of partitions."""
    if not data:
        raise RemoteProtocolError(f"no signed scales from {author.short()}")
    if len(data) > MAX_TABLE_ENVELOPE:
        raise RemoteProtocolError("signed scales too large")
    env = SignedEnvelope.from_bytes(bytes(data))
    table = ScaleTable.from_obj(unpack(env.open(TABLE_DOMAIN, author)))
    if table.round != round_:
        raise RemoteProtocolError("signed scales for another round")
    if len(table.scales) != _ENTRY.size * len(sizes):
        have = len(table.scales) / _ENTRY.size
        raise RemoteProtocolError(f"signed scales of {have:g} partitions, the round has {len(sizes)}")
    out = []
    for (sumsq, absmax), count in zip(_ENTRY.iter_unpack(table.scales), sizes, strict=True):
        if not (0.0 <= sumsq < math.inf and 0.0 <= absmax < math.inf):  # (NaN fails both)
            raise RemoteProtocolError("a signed scale that is negative or not finite")
        out.append(Scale(sumsq, absmax, count))
    return tuple(out)


def table_tag(data: bytes | memoryview) -> bytes:
    """What names a signed table where its bytes would be sent again: ``TAG_BYTES`` of its hash."""
    return hashlib.blake2b(data, digest_size=TAG_BYTES).digest()


def widened(scale: Scale, mode: Compression) -> Limit:
    """The most the decoded values of something of ``scale`` may be, once encoded with ``mode``:
    ``norm (1 + eps) + eps absmax sqrt(d)`` and ``absmax (1 + eps)``, plus ``SLACK`` per element."""
    eps = QUANTIZATION.get(mode, 1.0)
    root = math.sqrt(scale.count)
    return Limit(
        scale.norm * (1 + eps) + eps * scale.absmax * root + SLACK * root,
        scale.absmax * (1 + eps) + SLACK,
    )


def typical(claims: Sequence[Scale], weights: Sequence[float]) -> Limit:
    """The weighted lower median of ``claims``' norms and of their largest magnitudes (each weighed by
    its signer's weight in the decision): colluders holding no more than half the weight cannot move it
    above the largest honest claim, however many ids they sign with."""
    return Limit(
        _lower_median([c.norm for c in claims], weights), _lower_median([c.absmax for c in claims], weights)
    )


def _lower_median(values: Sequence[float], weights: Sequence[float]) -> float:
    if not values:
        return 0.0
    pairs = sorted(zip(values, weights, strict=True))
    half, run = math.fsum(weights) / 2, 0.0
    for v, w in pairs:
        run += w
        if run >= half:
            return v
    return pairs[-1][0]


def cap(base: Limit | None, weight: float, own_weight: float, usual: Limit | None = None) -> Limit | None:
    """The most this member believes of a contributor of ``weight``: ``CAP`` times a size (this member's
    own there, ``base``: :func:`limit` divided by ``BOUND``; or ``usual``, the :func:`typical` signed
    scale of the partition, where that is larger) per unit of this member's weight ``own_weight``, never
    less than ``CAP`` times that size (a contributor of less weight than this member may be noisier:
    sync gradients of small batches). None: nothing to cap by."""
    if base is NOTHING:
        return NOTHING
    if base is None:
        base = usual
    elif usual is not None:
        base = Limit(max(base.norm, usual.norm), max(base.absmax, usual.absmax))
    if base is None or not base.absmax > 0:  # (all zero: nothing to cap by)
        return None
    factor = CAP * (max(1.0, weight / own_weight) if own_weight > 0 else 1.0)
    return Limit(base.norm * factor, base.absmax * factor)


def over_cap(claim: Scale, bound: Limit | None) -> str:
    """Why a contributor's signed scale is beyond what a reducer believes of it (``bound``, its
    :func:`cap`; '' if it is not)."""
    if bound is None:
        return ""
    if bound is NOTHING:
        return "this member's own values there are not finite: it accepts nothing"
    if not claim.absmax <= bound.absmax + SLACK:
        return f"its signed largest value {claim.absmax:.4g} is over the {bound.absmax:.4g} it accepts"
    if not claim.norm <= bound.norm + SLACK * math.sqrt(claim.count):
        return f"its signed norm {claim.norm:.4g} is over the {bound.norm:.4g} this member accepts"
    return ""


def base(own: Scale, whole: Scale, history: Scale | None = None) -> Limit | None:
    """This member's own size in a partition (see :func:`limit`, which is ``BOUND`` times it): the norm
    of its values there (at least its typical element times ``sqrt(d)``) and their largest magnitude
    (at least its largest anywhere). :data:`NOTHING` where its values are not finite; None: all zero
    and no history."""
    b = limit(own, whole, history)
    if b is None or b is NOTHING:
        return b
    root = math.sqrt(own.count)
    return Limit((b.norm - SLACK * root) / BOUND, (b.absmax - SLACK) / BOUND)


def slice_limit(claim: Scale, mode: Compression, bound: Limit | None) -> Limit:
    """What a reducer accepts of a contributor's slice: within its signed ``claim`` (decoded with
    ``mode``), and within ``bound`` (its :func:`cap` for that contributor: None, none)."""
    w = widened(claim, mode)
    if bound is None:
        return w
    root = math.sqrt(claim.count)
    return Limit(min(w.norm, bound.norm + SLACK * root), min(w.absmax, bound.absmax + SLACK))


def result_limit(
    claims: Sequence[Scale],
    weights: Sequence[float],
    caps: Sequence[Limit | None],
    aggregation: str,
    mode: Compression,
    origins: Sequence[int] = (),
) -> Limit:
    """The most a partition's result may be, given its decided contributors' signed ``claims`` (in the
    decision's order), their ``weights`` (the decision's), what this member believes of each (``caps``,
    see :func:`cap`), the round's rule and compression; ``origins``: robust rules, each contributor's
    origin (contributors of one origin are one row). See the module docstring for why each holds."""
    if not claims:
        return Limit(0.0, 0.0)
    d = claims[0].count
    each = [slice_limit(c, mode, b) for c, b in zip(claims, caps, strict=True)]
    if aggregation == "mean":
        total = math.fsum(weights)
        norm = math.fsum(w / total * e.norm for w, e in zip(weights, each, strict=True))
        absmax = math.fsum(w / total * e.absmax for w, e in zip(weights, each, strict=True))
    else:
        rows: dict[int, list[Limit]] = {}
        for k, e in enumerate(each):
            rows.setdefault(origins[k] if origins else k, []).append(e)
        norms = [sum(e.norm for e in g) / len(g) for g in rows.values()]  # (a row: its origin's mean)
        norm, absmax = _robust(aggregation, norms, [sum(e.absmax for e in g) / len(g) for g in rows.values()])
    out = widened(Scale(norm * norm, absmax, d), mode)  # (the result is encoded with the round's mode too)
    return Limit(out.norm * (1 + 1e-6), out.absmax * (1 + 1e-6))


def _robust(aggregation: str, norms: list[float], absmaxes: list[float]) -> tuple[float, float]:
    k = len(norms)
    plain = trimmed_count(k) == 0 if aggregation == "trimmed_mean" else k <= 2
    if plain:
        return sum(norms) / k, sum(absmaxes) / k  # (a plain mean of the rows)
    if aggregation == "trimmed_mean":
        # Each kept value lies within the (t+1)-th largest and smallest of its coordinate: any t rows
        # left out, some other row is at least as large there. Leave out the t largest claims.
        t = trimmed_count(k)
        return _without_largest(norms, t), sorted(absmaxes, reverse=True)[t]
    if aggregation == "centered_clip":
        # Started at the (lower) coordinate-wise median, within the rows but the q largest; each of the
        # iterations moves it by at most tau, the lower median of the rows' distances to that start.
        q = (k - 1) // 2
        n0, a0 = _without_largest(norms, q), sorted(absmaxes, reverse=True)[q]
        tau = sorted(norms)[q] + n0
        return n0 + CLIP_ITERATIONS * tau, a0 + CLIP_ITERATIONS * tau
    raise ValueError(f"no bound for aggregation {aggregation!r}")


def _without_largest(norms: list[float], t: int) -> float:
    kept = sorted(norms)[: len(norms) - t]
    return math.sqrt(math.fsum(n * n for n in kept))
