"""The simulated world of a scale run: where peers are (a continent RTT matrix), their access links,
which of them sit behind NATs, and when they join, leave and crash (pure: seeded, no trio)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from p2ptrain.net.messages import HostLink

REGIONS = ("na-east", "na-west", "europe", "asia", "south-america", "oceania")
WEIGHTS = (0.25, 0.15, 0.30, 0.18, 0.07, 0.05)  # share of peers per region
# Round-trip times between regions in milliseconds (typical public-internet medians between their
# large cloud regions; the diagonal is a path inside one region).
RTT_MS = (
    (12, 70, 85, 200, 120, 200),
    (70, 12, 145, 125, 170, 150),
    (85, 145, 12, 230, 200, 280),
    (200, 125, 230, 12, 300, 120),
    (120, 170, 200, 300, 12, 320),
    (200, 150, 280, 120, 320, 12),
)
# Uplink rates (Mbit/s) and their shares: home fibre and cable up to datacenter ports.
UPLINKS_MBIT = ((10.0, 0.2), (50.0, 0.3), (100.0, 0.3), (1000.0, 0.2))
DOWN_OVER_UP = 4.0  # downlinks are this many times the uplink, up to 1 Gbit/s


@dataclass(frozen=True)
class PeerPlace:
    name: str
    region: int
    link: HostLink
    natted: bool
    speed: float  # this peer's batches per virtual second relative to the others' (0.5 to 2)


@dataclass(frozen=True)
class Churn:
    """Rates per peer per hour of virtual time: new peers joining (as a share of the starting swarm),
    peers leaving cleanly, peers crashing."""

    join: float = 0.0
    leave: float = 0.0
    kill: float = 0.0


class World:
    """Places for ``n`` peers (and more that join later), seeded."""

    def __init__(self, seed: int, nat_share: float) -> None:
        self.rng = random.Random(seed)
        self.nat_share = nat_share
        self.places: dict[str, PeerPlace] = {}

    def place(self, index: int) -> PeerPlace:
        name = f"p{index:05d}"
        region = self.rng.choices(range(len(REGIONS)), WEIGHTS)[0]
        up_mbit = self.rng.choices([u for u, _ in UPLINKS_MBIT], [w for _, w in UPLINKS_MBIT])[0]
        up = up_mbit * 1e6 / 8
        down = min(up * DOWN_OVER_UP, 1e9 / 8)
        natted = index > 0 and self.rng.random() < self.nat_share  # the first peer is the public seed
        speed = 2 ** self.rng.uniform(-1, 1)
        p = PeerPlace(name, region, HostLink(up=up, down=down), natted, speed)
        self.places[name] = p
        return p

    def latency(self, src: str, dst: str) -> float:
        """One-way latency in seconds between two placed hosts (half the regions' RTT)."""
        a, b = self.places.get(src), self.places.get(dst)
        if a is None or b is None:
            return 0.005
        return RTT_MS[a.region][b.region] / 2000.0


def churn_events(
    churn: Churn, peers: int, start: float, duration: float, rng: random.Random
) -> list[tuple[float, str]]:
    """(virtual time, "join" | "leave" | "kill") events, Poisson at the churn's rates, sorted."""
    events: list[tuple[float, str]] = []
    for kind, rate in (("join", churn.join), ("leave", churn.leave), ("kill", churn.kill)):
        per_second = rate * peers / 3600.0
        if per_second <= 0:
            continue
        t = start
        while True:
            t += rng.expovariate(per_second)
            if t >= start + duration:
                break
            events.append((t, kind))
    return sorted(events)


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank; NaN for none)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
