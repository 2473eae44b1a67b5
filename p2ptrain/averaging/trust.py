"""Trust earned by verified useful work: which contributors of a round did any, and whom that makes a partner.

Theory of operation. Identities are free, so being counted in a round proves nothing: a client-only key
that sends zeros (or noise) with weight 1 is a contributor like any other. A member that *reduces* a
partition holds every contributor's slice of it, and only there can anything about a contributor be
checked. So trust is granted for what the reducer verified, never for a place in the decision:

- :func:`useful` judges the slices of one partition from their Gram matrix (pairwise dot products, one
  pass over the kept slices, see ``reducer``). A slice is useful when it is finite, its weight is
  positive, its norm is not negligible next to the others' (``NEGLIGIBLE`` x their lower median: zeros and
  near-zeros fail), and it points the way the others do: its cosine with the leave-one-out aggregate of
  the others (the sum of their unit vectors, so no single slice's scale steers it; in rounds that
  count origins, only other origins' slices, each origin as one: keys of one host that send the same
  values do not vouch for each other) is at least
  :func:`threshold` of the partition's size. Pure noise of ``d`` elements has a cosine of about
  ``N(0, 1/d)`` with any fixed direction, so ``ALIGN_SIGMAS / sqrt(d)`` is a bar it reaches with odds of
  ``3e-5`` per round; honest gradients of one model on one objective share a direction far above it. A
  sign-flipped copy of another's slice points against the others and fails too. A slice a robust
  rule bounded as an outlier (see ``robust``) is no useful work either.
- :class:`TrustLedger` (owned by the ``Averager``) turns verified rounds into partners: each verified
  contributor earns one credit per round (a round counted twice earns nothing more), credits decay with
  a half-life (``HALF_LIFE``), a peer is named a partner once its credit reaches ``TRUST_AT`` and stays one
  while it is at least ``KEEP_AT``, at most ``PER_SUBNET`` partners come from one subnet (the address
  this member saw the peer at; through a relay's circuit, the relay's; at no address, one bucket
  ``UNSEEN`` all such keys share), and the partners named within any ``ADMIT_WINDOW`` seconds number
  at most those held from before it, or ``ADMIT_PER_WINDOW`` when that is more: newcomers never
  outnumber the partners a member already had, so its trust at most doubles per window. Partners a
  checkpoint remembers come back with ``TRUST_AT`` credits.

  (A flat ``ADMIT_PER_WINDOW`` a minute held a swarm's startup back by its size: at 32 and 64 simulated
  peers each trusted 17 of them for the first minutes, fewer than the untrusted it saw, so the
  majority its quorum needed (``progress``) was every one of its trusted peers, and each group that
  missed one of them failed. A member of a swarm of n peers that verified them all now trusts them
  within log2(n / 16) windows: 20 s at 32 peers, two minutes at 1,024.)

What it costs. An attacker with ``k`` keys on ``m`` subnets earns at most ``PER_SUBNET * m`` partners per
honest peer, each only after ``TRUST_AT`` rounds in which it sent a slice aligned with the honest peers'
gradients: that is, it computed gradients of the run's model on the run's objective. Sending back the
last result it fetched (an echo of the swarm's direction, which the plain check passes) earns nothing
in partitions of ``BEYOND_PRIOR_FROM`` elements or more: a slice must also point the honest way with
the judging member's last accepted result projected out (``useful(prior=True)``; the member keeps
that result in bfloat16, 2 bytes per element: ``bounds.ResultHistory``). Any slice in the span of
that one result fails; a cheaper predictor of the next gradient than the gradient itself (an
extrapolation from several past results) is what is left, see the design page. An honest swarm's
members verify each other in their first rounds: a member reduces a partition of every round it is
in, and every contributor sends a slice of it. A client-only member reduces nothing and verifies
nobody: it trusts its join peers.

Small partitions cannot tell noise from signal (``d = 16`` makes noise reach a cosine of 1/2 one time in
thirty): the bar is capped at ``MAX_ALIGN``, so that a tiny model's rounds still verify honest peers, and
``TRUST_AT`` rounds are needed besides. Models worth training have partitions of millions of elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..identity import PeerID

NEGLIGIBLE = 1e-3  # a slice whose norm is below this share of the others' (lower) median norm did no work
ALIGN_SIGMAS = 4.0  # the bar for alignment, in standard deviations of pure noise's cosine (1/sqrt(d))
MIN_ALIGN = (
    0.01  # ... and never below this cosine (huge partitions: minibatch gradients of LLMs agree weakly)
)
MAX_ALIGN = 0.5  # ... nor above this one (tiny partitions, where no bar tells noise apart: see above)
GRAM_BLOCK = 4096  # elements per float32 product in ``gram`` (summed in float64)
BEYOND_PRIOR_FROM = 1024  # elements from which a slice must also carry work beyond the last result

TRUST_AT = 1.0  # credits (verified rounds, decayed) that make a peer a partner
KEEP_AT = 0.5  # ... and below which a partner is one no more
MAX_CREDIT = 16.0  # credits saturate: a long history lasts four half-lives after the useful work stops
HALF_LIFE = 1800.0  # seconds in which a credit halves
UNSEEN = "?"  # the subnet of a verified key seen at no address: one bucket all such keys share
PER_SUBNET = 4  # partners one subnet may hold (the highest credits win)
ADMIT_PER_WINDOW = 16  # new partners named per window at least may number this many ...
ADMIT_WINDOW = 20.0  # ... per this many seconds (else: as many as the partners held from before it)
MAX_TRACKED = 4096  # peers with credits remembered (the lowest credits go first)


def threshold(d: int) -> float:
    """The cosine a slice of ``d`` elements must reach with the others' aggregate (see the docstring)."""
    return min(MAX_ALIGN, max(MIN_ALIGN, ALIGN_SIGMAS / math.sqrt(max(d, 1))))


def gram(rows: Iterable[torch.Tensor]) -> torch.Tensor:
    """The Gram matrix (float64) of equally long rows given as one (k, n) block (a chunk of each slice).

    Products in float32 over ``GRAM_BLOCK`` elements at a time, summed in float64: three times faster
    than float64 throughout (a skinny product is memory-bound), within ~1e-7 of it (the check beyond
    the last result subtracts nearly equal numbers: plain float32 over a 1 MiB chunk was off by 1e-5).
    Values whose squares overflow float32 (beyond 1e19) make the matrix infinite: not useful work."""
    block = torch.stack([r.to(torch.float32) for r in rows])
    k, n = block.shape
    whole = n - n % GRAM_BLOCK
    g = torch.zeros(k, k, dtype=torch.float64)
    if whole:
        b = block[:, :whole].reshape(k, -1, GRAM_BLOCK).transpose(0, 1)  # (blocks, k, GRAM_BLOCK)
        g += torch.bmm(b, b.transpose(1, 2)).to(torch.float64).sum(0)
    if whole < n:
        rest = block[:, whole:].to(torch.float64)
        g += rest @ rest.T
    return g


@dataclass(frozen=True)
class Verdict:
    useful: bool
    reason: str


def useful(
    g: torch.Tensor, weights: Sequence[float], d: int, origins: Sequence[int] = (), *, prior: bool = False
) -> list[Verdict]:
    """Which of ``k`` slices of a partition of ``d`` elements are useful work (see the module docstring),
    from their Gram matrix ``g`` (k x k) and the weights they were sent with. ``origins``: a label per
    slice (the manifest's origin of its member, see ``robust.by_origin``; () : each its own): a slice
    is checked against the slices of *other* origins only, each origin counting as one (its unit
    vectors averaged), so that keys of one host that send the same values do not vouch for each other.

    ``prior``: ``g`` is (k + 1) x (k + 1), its last row the judging member's last accepted result of
    the partition. A slice must then also pass the same checks with that result projected out of
    every slice (the residual Gram matrix ``g_ij - g_ip g_jp / g_pp``): the part of the slice that
    the last result does not already say must be there and point the way the others' new parts do.
    An echo of the last result (or any multiple of it, plus noise of any scale) has a residual that
    is zero or noise, which fails; honest gradients of the next step keep a residual well aligned
    (their cosine was 0.2-0.99 against a bar of 0.009 in a 0.84M-parameter GPT's training). Only in
    partitions of ``BEYOND_PRIOR_FROM`` elements or more: in tiny ones the bar is capped
    (``MAX_ALIGN``), noise passes it now and then anyway, and the change from one step's gradient to
    the next of a model of a few dozen parameters points nowhere in common."""
    if prior and d >= BEYOND_PRIOR_FROM:
        if not weights:
            return []
        g = g.to(torch.float64)
        plain = _useful(g[:-1, :-1], weights, d, origins)
        gp, pp = g[:-1, -1], float(g[-1, -1])
        if not (math.isfinite(pp) and pp > 0) or not bool(torch.isfinite(g).all()):
            return plain
        residual = g[:-1, :-1] - torch.outer(gp, gp) / pp
        beyond = _useful(residual, weights, max(d - 1, 1), origins)
        return [
            v if not v.useful or r.useful else Verdict(False, f"an echo of the last result: {r.reason}")
            for v, r in zip(plain, beyond, strict=True)
        ]
    return _useful(g[:-1, :-1] if prior else g, weights, d, origins)


def _useful(g: torch.Tensor, weights: Sequence[float], d: int, origins: Sequence[int] = ()) -> list[Verdict]:
    k = len(weights)
    labels = list(origins) if origins else list(range(k))
    per_origin = {o: labels.count(o) for o in labels}
    g = g.to(torch.float64)
    diag = g.diagonal()
    finite = bool(torch.isfinite(g).all())
    norms = [math.sqrt(max(float(x), 0.0)) if math.isfinite(float(x)) else math.nan for x in diag]
    bar = threshold(d)
    # Each origin's typical norm (the lower median of its slices'): the scale its slices are judged by
    typical: dict[int, float] = {}
    for o in per_origin:
        mine = sorted(x for j, x in enumerate(norms) if labels[j] == o and math.isfinite(x))
        if mine:
            typical[o] = mine[(len(mine) - 1) // 2]
    cell = g.tolist()  # (read as floats once: the loops below read O(k^3) cells)
    out: list[Verdict] = []
    for i in range(k):
        w, n = float(weights[i]), norms[i]
        others = sorted(x for o, x in typical.items() if o != labels[i])
        if not (math.isfinite(w) and w > 0):
            out.append(Verdict(False, f"its weight {w!r} is not positive"))
            continue
        if not math.isfinite(n) or not finite:
            out.append(Verdict(False, "not finite"))
            continue
        if not others:
            out.append(Verdict(False, "no other slice to check it against"))
            continue
        median = others[(len(others) - 1) // 2]  # (lower: huge slices cannot make the honest negligible)
        if n <= 0 or n < NEGLIGIBLE * median:
            out.append(Verdict(False, f"its norm {n:.3g} is negligible (others' median {median:.3g})"))
            continue
        # Others as unit vectors u_j = x_j / |x_j|, of other origins, 1 / (its size) each (zero rows
        # add nothing)
        live = [j for j in range(k) if labels[j] != labels[i] and norms[j] > 0]
        if not live:
            out.append(Verdict(False, "no other origin sent anything"))
            continue
        share = {j: 1.0 / (norms[j] * per_origin[labels[j]]) for j in live}
        dot = sum(cell[i][j] * share[j] for j in live) / n
        sq = sum(cell[a][b] * share[a] * share[b] for a in live for b in live)
        if sq <= 0:
            out.append(Verdict(False, "the others cancel out"))
            continue
        cos = dot / math.sqrt(sq)
        if cos < bar:
            out.append(Verdict(False, f"cosine {cos:.3f} with the others' aggregate is below {bar:.3f}"))
        else:
            out.append(Verdict(True, f"cosine {cos:.3f} with the others' aggregate"))
    return out


@dataclass
class _Credit:
    value: float = 0.0
    at: float = 0.0  # when ``value`` was last brought up to date
    subnet: str = ""
    rounds: list[bytes] = field(default_factory=list)  # the last few rounds counted (once each)


MAX_ROUNDS_KEPT = 8


class TrustLedger:
    """Credits for verified useful work, and the partners they make (see the module docstring).

    ``me`` never earns credit with itself. ``partners(now)`` is the read-only set callers use."""

    def __init__(self, me: PeerID) -> None:
        self.me = me
        self._credits: dict[PeerID, _Credit] = {}
        self._partners: set[PeerID] = set()
        self._admitted: list[float] = []  # when recent partners were named (for ADMIT_PER_WINDOW)
        self._now = 0.0
        # The instant of the last update, while nothing changed since: an update at the same instant
        # names and drops nobody (every peer's credit stands as it did), so it is not worked out again
        # (a board asks for the partners several times a read, a simulated swarm thousands of times an
        # instant); and the partners as a frozenset, made once per change
        self._settled: float | None = None
        self._frozen: frozenset[PeerID] = frozenset()

    def _decayed(self, c: _Credit, now: float) -> float:
        return float(c.value * 0.5 ** (max(now - c.at, 0.0) / HALF_LIFE))

    def credit(self, round: bytes, verified: Iterable[tuple[PeerID, str]], now: float) -> list[PeerID]:
        """``verified``: (peer, subnet it was seen at) of the contributors this member verified in the
        round ``round``; each earns one credit, at most once per round. Returns the peers named partners
        by it."""
        for peer, subnet in verified:
            if peer == self.me:
                continue
            c = self._credits.get(peer)
            if c is None:
                c = self._credits[peer] = _Credit(at=now)
            if round in c.rounds:
                continue
            c.rounds.append(round)
            del c.rounds[:-MAX_ROUNDS_KEPT]
            c.value, c.at = min(MAX_CREDIT, self._decayed(c, now) + 1.0), now
            if subnet and (subnet != UNSEEN or not c.subnet):  # where it was seen before outlasts "nowhere"
                c.subnet = subnet
        self._bound()
        self._settled = None
        return self.update(now)

    def seed(self, peers: Iterable[PeerID], now: float, subnet: str = "") -> None:
        """Peers a checkpoint remembers as partners: they are again, with ``TRUST_AT`` credits (they
        decay as any), outside the limits on new partners per window (they were admitted before)."""
        for peer in peers:
            if peer == self.me:
                continue
            c = self._credits.setdefault(peer, _Credit(at=now, subnet=subnet or f"?{peer}"))
            c.value, c.at = max(self._decayed(c, now), TRUST_AT), now
            self._partners.add(peer)
        self._bound()
        self._settled, self._frozen = None, frozenset(self._partners)

    def update(self, now: float) -> list[PeerID]:
        """Name and drop partners as credits stand at ``now``; returns the peers newly named."""
        if now == self._settled:
            return []
        self._now = max(self._now, now)
        values = {p: self._decayed(c, now) for p, c in self._credits.items()}
        self._partners = {p for p in self._partners if values.get(p, 0.0) >= KEEP_AT}
        by_subnet: dict[str, int] = {}
        for p in self._partners:
            by_subnet[self._credits[p].subnet] = by_subnet.get(self._credits[p].subnet, 0) + 1
        self._admitted = [t for t in self._admitted if now - t < ADMIT_WINDOW]
        # (the partners named within the window that are still partners are among ``_partners``)
        allowed = max(ADMIT_PER_WINDOW, len(self._partners) - len(self._admitted))
        named = []
        # Highest credit first (ties: the smaller id, so the order is the same on every run)
        for p in sorted(values, key=lambda p: (-values[p], p.digest)):
            # Earned: its credit reached the bar when it was last credited, and has not decayed below
            # the bar a partner is kept at. (Held back by the window, a peer verified in one round fell
            # below TRUST_AT at once by decay, and was never named without another round: after a
            # 64-peer swarm's first round each peer trusted 19 for good, and no second round formed.)
            if p in self._partners or self._credits[p].value < TRUST_AT or values[p] < KEEP_AT:
                continue
            subnet = self._credits[p].subnet
            if by_subnet.get(subnet, 0) >= PER_SUBNET or len(self._admitted) >= allowed:
                continue
            by_subnet[subnet] = by_subnet.get(subnet, 0) + 1
            self._admitted.append(now)
            self._partners.add(p)
            named.append(p)
        self._settled, self._frozen = now, frozenset(self._partners)
        return named

    def value(self, peer: PeerID, now: float) -> float:
        c = self._credits.get(peer)
        return 0.0 if c is None else self._decayed(c, now)

    def __len__(self) -> int:
        """How many peers hold credits (at most ``MAX_TRACKED``)."""
        return len(self._credits)

    @property
    def partners(self) -> frozenset[PeerID]:
        """The partners as of the last update (credit, seed or update)."""
        return self._frozen

    def _bound(self) -> None:
        if len(self._credits) <= MAX_TRACKED:
            return
        now = self._now
        order = sorted(
            self._credits, key=lambda p: (p in self._partners, self._decayed(self._credits[p], now))
        )
        for p in order[: len(self._credits) - MAX_TRACKED]:
            del self._credits[p]
