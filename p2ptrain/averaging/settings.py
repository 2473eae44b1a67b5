"""The averager's settings: group sizes, matchmaking time, bandwidth, and the round's rules.

Theory of operation: a node's averager is configured once, from a run file (``config``, through
``node.averaging_settings``) or the command line; text is parsed here, at that edge, into the typed
:class:`~.compression.Compression` and :class:`~.robust.Aggregation`, and the rule that ties the
compression to the aggregation and the audit is checked by building :class:`~.protocol.RoundSettings`.
Everything inside the averager takes these values as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..identity import PeerID
from .compression import Compression, parse_compression
from .protocol import MAX_GROUP, RoundSettings
from .robust import Aggregation, parse_aggregation


@dataclass(frozen=True)
class AveragerConfig:
    target_size: int = 4
    min_size: int = 2
    matchmaking_time: float = 5.0  # how long a leader gathers before forming a smaller group
    bandwidth: float = 0.0  # bytes per second this peer can move (its share of a reduction); 0: measure it
    # Text (the command line's) is parsed once, here: the fields then hold the typed values.
    compression: Compression = Compression.NONE
    aggregation: Aggregation = Aggregation.MEAN  # or a robust rule (see ``robust``): a group shares one
    audit: bool = False  # commit to slices, attest results, audit after each round (see ``audit``)

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.target_size <= MAX_GROUP:
            raise ValueError(f"need 1 <= min_size <= target_size <= {MAX_GROUP}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth >= 0):
            raise ValueError("bandwidth must be positive, or 0 to measure it")
        if not (math.isfinite(self.matchmaking_time) and self.matchmaking_time > 0):
            raise ValueError("matchmaking_time must be positive")
        # Typed values (a run file's, parsed at load) are taken as they are; text is parsed here.
        mode, rule = self.compression, self.aggregation
        if not isinstance(mode, Compression):
            mode = parse_compression(mode)
        if not isinstance(rule, Aggregation):
            rule = parse_aggregation(rule)
            if rule != self.aggregation:
                raise ValueError(f"aggregation: write {rule.value!r}")
        RoundSettings(mode, rule, self.audit)  # (checks that the compression goes with the rule and audit)
        object.__setattr__(self, "compression", mode)
        object.__setattr__(self, "aggregation", rule)


@dataclass(frozen=True)
class RoundPolicy:
    """What the training run a node takes part in decides about its averager's rounds, beyond settings.

    The averager and its auditor are built with one (the default: none of it), or are handed the run's
    once, by :meth:`Averager.follow`, when the run's optimizer is built (it reads the run's progress
    records and publishes its bans, so it exists only after the node). ``p2ptrain average`` and
    ``Node.average`` average without one.

    Attributes:
        weight_cap: The most weight a member may carry in a round (None: no cap for it): the
            coordinator caps weights with it, and every reducer refuses far-off ones (``agreement``).
        weight_caps: The same for several members at once (a round's), where that costs less than
            asking ``weight_cap`` for each; used in its place when given.
        on_ban: Called when this peer's auditor convicts a reducer with a proof it keeps (the run
            publishes the accusation; others re-check the proof).
        max_proof_bytes: The most bytes a proof may take to fetch (None: only the per-slice bound): an
            accuser signs the manifest its proof names, so without it one could make us download any
            size.
        key_bits: The matchmaking keys of a group key are spread over ``2^key_bits`` keys, one per
            bucket of peers (``dht.spread``): each peer announces under its bucket's and reads them
            all, so that no key's replicas serve every looker every announcement. A training run's
            ``progress.buckets``; 0 (one key) without a run.
        look_buckets: The buckets whose matchmaking keys a look for a group key reads (None, or no
            function: every bucket's): a swarm split into regions reads its region's, where every
            peer that may join the group announces.
    """

    weight_cap: Callable[[PeerID], float | None] | None = None
    weight_caps: Callable[[list[PeerID]], Mapping[PeerID, float | None]] | None = None
    on_ban: Callable[[PeerID, str], None] | None = None
    max_proof_bytes: int | None = None
    key_bits: int = 0
    look_buckets: Callable[[str], Sequence[int] | None] | None = None
