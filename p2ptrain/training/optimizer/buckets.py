"""The swarm's view at scale, its pure parts: progress records spread over bucket keys, and what a
reader that reads a few buckets may conclude (see the scale page of the docs for the design).

Theory of operation: every peer reading every peer's progress record from one key costs O(N) bytes per
read and O(N^2) at the key's replicas. Here the records go under ``2^bits`` keys, one per bucket of
peers (the top ``bits`` bits of a hash of the peer id), with ``bits`` chosen so that a bucket holds
about ``BUCKET_TARGET`` records (:func:`bucket_bits`); a swarm of fewer than ``2 * BUCKET_TARGET``
peers has one bucket, whose key is the progress key of today (:func:`progress_key`: a small swarm reads
and writes exactly as before). A reader reads its own bucket and ``SAMPLED`` others drawn from a pool, a
window over its own order of them that moves on by one bucket a period (:class:`SampledBuckets`), and
scales what the sampled buckets say to the buckets it did not read (:func:`scaled_total`): bytes per read
O(``(SAMPLED + 1) * BUCKET_TARGET``) whatever N, and each bucket's replicas serve O(``SAMPLED + 1``)
readers per bucket of readers.

``bits`` comes from the reader's own estimate of the swarm's size (:func:`size_estimate`: the XOR
distances to the closest contacts of its routing table, whose ids it verified by handshake), not from
anything a record claims.

What k ids can do (the threat model's rules hold: nothing is believed because many ids say it):

* Claim samples: the trust rules of ``progress.swarm_view`` cap untrusted records at what this peer
  and its trusted peers say; :func:`scaled_total` scales the capped sums, so k ids at most double the
  estimate, whatever k, as today.
* Grind ids into one bucket (its key is a hash prefix: 2^bits tries an id): they fill that bucket's
  key, which is one of ``SAMPLED + 1`` a reader reads, capped as above; the key's replicas keep a quota
  per subnet.
* Skew a reader's size estimate by crowding its routing table: ``bits`` moves by a level or two (twice
  or four times the bytes, or half the records per bucket): cost, not correctness.

Regions (the groups' side of the design; :class:`Regions`, used by the optimizer where the run sets
``progress.regions``): a group of ``n`` members
costs each member O(n^2) bytes a round (it fetches every partition's result with every contributor's
signed scale of it, ``averaging.bounds``), so a step of a large swarm needs many bounded groups, each
formed among the peers of one *region*: ``2^span`` buckets that differ only in the ``span`` dimensions
of the bucket index that the step pairs (:func:`paired_dims`, turning with the epoch). A region's peers
are exactly the records under its buckets' keys, which its members read anyway; two regions of a step
share no peer; and any ``ceil(bits / span)`` steps in a row pair every dimension, so rounds that
average their region's buckets' states exactly leave every bucket with the mean of all the buckets'
states after that many steps (hypercube averaging: each step's averaging is a projection along its
dimensions, and those commute). What k ids can do to it: grind ids into one region's buckets, as into
one bucket above; they change that region's matchmaking, never which region a peer is in (a pure
function of its id, the step and ``bits``).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...dht.spread import SpreadKey, bucket_of
from ...identity import PeerID

BUCKET_TARGET = 64  # records a bucket key holds, about
SAMPLED = 4  # buckets a reader reads besides its own
POOL = 3 * SAMPLED  # the buckets it draws those from, a window that turns (see ``SampledBuckets``)
MAX_BITS = 12  # 4,096 buckets: 262,144 peers at the target


def size_estimate(me: bytes, contacts: Iterable[bytes]) -> float:
    """The swarm's size as ``me``'s routing table shows it: with ids uniform over 2^L, the i-th closest
    of n lies at about ``i * 2^L / n`` from ``me``; the least-squares fit of that line through the 20
    closest contacts (one contact placed near ``me`` moves it by a twentieth). Counts ``me``; 1 with no
    contacts."""
    space = 1 << (8 * len(me))
    mine = int.from_bytes(me, "big")
    distances = sorted(int.from_bytes(c, "big") ^ mine for c in contacts if c != me)
    distances = [d for d in distances if d > 0][:20]
    if not distances:
        return 1.0
    squares = sum(i * i for i in range(1, len(distances) + 1))
    spread = math.fsum(i * d / space for i, d in enumerate(distances, start=1))
    return 1.0 + squares / spread


def bucket_bits(size: float, target: int = BUCKET_TARGET, max_bits: int = MAX_BITS) -> int:
    """How many bits of the hashed id name a bucket, for a swarm of ``size``: buckets of ``target`` to
    ``2 * target`` records; 0 (one bucket) below ``2 * target`` peers."""
    if not math.isfinite(size) or size < 2 * target:
        return 0
    return min(max_bits, int(math.log2(size / target)))


def progress_key(run_id: str, bits: int, bucket: int) -> bytes:
    """The DHT key of a bucket's progress records; with one bucket, the run's progress key as it is."""
    keys = progress_keys(run_id, bits).keys
    if not 0 <= bucket < len(keys):
        raise ValueError(f"bucket {bucket} out of range for {bits} bits")
    return keys[bucket]


def progress_keys(run_id: str, bits: int) -> SpreadKey:
    """The run's progress key spread over ``2^bits`` buckets (``dht.spread``)."""
    return SpreadKey.of(f"p2ptrain/{run_id}/progress", max(bits, 0))


class SampledBuckets:
    """The other buckets a split swarm's reader samples: ``sampled`` drawn at random at each read from a
    pool of ``pool``, a window over an order of all the others (drawn once from ``rng``) that moves on by
    one bucket every ``period`` seconds of ``now`` (a record's life, ``progress.ttl``).

    Drawn from all the buckets at every read (as before), a reader met new bucket keys at most of its
    reads until it had read all ``2^bits``: O(N) keys a peer, each a DHT node lookup of its replicas and
    every one of its records, for as long as the swarm took to be read whole (6.1 first lookups a peer
    a step of 8.4 at 512 simulated peers, growing with N), and past ``MAX_TARGET_KEYS`` keys never at
    all. The pool meets at most one new bucket a period whatever N (the invariant: over ``t`` seconds at
    most ``pool + ceil(t / period)`` distinct buckets). Draws from the pool, not the window itself:
    a reader's estimate of the swarm's rate is smoothed over its reads (``board.note_read``), and the
    peers of one region take their share of the target from theirs, so it should average over many
    buckets, not the same ``sampled`` for a period (a first 256-peer run with the bare window had 84.5
    and 75.0% of its live peers in committed rounds, against 96.1 and 94.1%). Over a turn of the window
    every bucket is in the pool equally long, so the scaled totals stay unbiased. Which buckets a reader
    samples is its own draw, no claim of anyone's, and what k ids can do to a sampled bucket is capped
    as before (see :func:`capped_estimate`)."""

    def __init__(
        self, rng: random.Random, *, period: float, sampled: int = SAMPLED, pool: int = POOL
    ) -> None:
        if not period > 0:
            raise ValueError(f"period must be positive, not {period}")
        if not 0 < sampled <= pool:
            raise ValueError(f"need 0 < sampled <= pool, not {sampled} and {pool}")
        self.rng, self.period, self.sampled, self.pool = rng, period, sampled, pool
        self._of: tuple[int, int] | None = None  # (mine, bits) that ``_order`` is of
        self._order: list[int] = []

    def pooled(self, mine: int, bits: int, now: float) -> list[int]:
        """The pool at ``now``: the window's buckets (all the others when there are fewer)."""
        if self._of != (mine, bits):
            self._order = [b for b in range(1 << max(bits, 0)) if b != mine]
            self.rng.shuffle(self._order)
            self._of = (mine, bits)
        order = self._order
        at = math.floor(now / self.period) if math.isfinite(now) else 0
        return [order[(at + i) % len(order)] for i in range(min(self.pool, len(order)))]

    def read(self, mine: int, bits: int, now: float) -> list[int]:
        """``mine`` first, then ``sampled`` distinct others of the pool at ``now``, drawn anew."""
        pool = self.pooled(mine, bits, now)
        return [mine, *self.rng.sample(pool, min(self.sampled, len(pool)))]


def scaled_total(own: float, sampled: Sequence[float], bits: int) -> float:
    """The swarm's total of a quantity (samples, rate) from this peer's bucket's total ``own``, read
    whole, and the totals of the other buckets it read (``sampled``): those stand for all the buckets it
    did not read. Every total is what the trust rules let count (capped before it comes here)."""
    others = (1 << max(bits, 0)) - 1
    if others == 0 or not sampled:
        return own
    return own + math.fsum(sampled) / len(sampled) * others


def capped_estimate(
    trusted: tuple[float, Sequence[float]], untrusted: tuple[float, Sequence[float]], bits: int
) -> float:
    """The swarm's samples as a reader of a few buckets counts them: the totals of this peer's own and
    its trusted peers' records (its bucket's, then each sampled bucket's) scaled, plus the untrusted
    records' scaled totals for at most as much (the rule of ``progress.swarm_view``, kept at scale):
    ids that only write records at most double the estimate, however many there are and wherever they
    crowd."""
    sure = scaled_total(trusted[0], trusted[1], bits)
    return sure + min(scaled_total(untrusted[0], untrusted[1], bits), sure)


def paired_dims(epoch: int, bits: int, span: int = 1) -> list[int]:
    """The dimensions of the bucket index paired at ``epoch`` (a region spans them): ``span`` of the
    ``bits``, turning by ``span`` a step, so that any ``ceil(bits / span)`` steps in a row pair each at
    least once; all of them when ``span >= bits`` (one region: the swarm)."""
    if bits <= 0:
        return []
    if span >= bits:
        return list(range(bits))
    if span < 1:
        raise ValueError(f"a region spans at least one dimension, not {span}")
    return sorted({(epoch * span + j) % bits for j in range(span)})


@functools.lru_cache(maxsize=1 << 16)  # (asked for every record of every view)
def region_of(bucket: int, bits: int, epoch: int, span: int = 1) -> int:
    """The region of ``bucket`` at ``epoch``: its index with the paired dimensions cleared (the lowest
    bucket of the region names it)."""
    for d in paired_dims(epoch, bits, span):
        bucket &= ~(1 << d)
    return bucket


def region_buckets(bucket: int, bits: int, epoch: int, span: int = 1) -> list[int]:
    """The buckets of ``bucket``'s region at ``epoch`` (its own among them), in order: ``2^span`` of
    them, each in exactly one region of the step."""
    out = [region_of(bucket, bits, epoch, span)]
    for d in paired_dims(epoch, bits, span):
        out += [b | (1 << d) for b in out]
    return sorted(out)


@dataclass(frozen=True)
class Regions:
    """A run's regions: ``2^bits`` buckets, a region of ``2^span`` of them a step (:func:`region_buckets`);
    ``span == bits``: one region, the whole swarm (a run without ``progress.regions``)."""

    bits: int
    span: int

    @classmethod
    def of(cls, buckets: int, regions: int) -> Regions:
        """The regions of a run with ``buckets`` bucket keys split into ``regions`` regions a step (both
        powers of 2, ``regions`` at most ``buckets``: the run file's check)."""
        bits = buckets.bit_length() - 1
        return cls(bits, bits - (regions.bit_length() - 1))

    @property
    def split(self) -> bool:
        """Whether a step's swarm is split (else: one region, and everything here is the identity)."""
        return self.span < self.bits

    @property
    def share(self) -> float:
        """The share of the swarm's buckets one region holds."""
        return 1.0 / (1 << (self.bits - self.span))

    def of_peer(self, peer: PeerID, epoch: int) -> int:
        """``peer``'s region at ``epoch``: a pure function of its id (a hash), the step and the bits;
        nothing a peer says moves it."""
        if not self.split:
            return 0
        return region_of(bucket_of(peer.digest, self.bits), self.bits, epoch, self.span)

    def together(self, a: PeerID, b: PeerID, epoch: int) -> bool:
        """Whether ``a`` and ``b`` are in one region at ``epoch``."""
        return not self.split or self.of_peer(a, epoch) == self.of_peer(b, epoch)

    def tag(self, peer: PeerID, epoch: int) -> str:
        """What a group key of ``epoch`` gets for ``peer``'s region: "" with one region (the key as it
        was), else the region's index."""
        return f"/region-{self.of_peer(peer, epoch)}" if self.split else ""
