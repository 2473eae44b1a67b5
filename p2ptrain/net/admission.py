"""Which inbound connection gets a slot when slots run short: pure, no I/O.

Theory of operation. A node accepts a bounded number of inbound connections, and an address costs an
attacker little: a host has many, and a whole IPv4 /24 or IPv6 /64 is one operator more often than not.
So limits count addresses *and* subnets, and a full table does not simply turn newcomers away (which
lets whoever fills it first keep everyone else out for good): a newcomer takes the slot of a connection
that is worth less, in this order:

1. a connection still in its handshake (unauthenticated: it has proved nothing yet), the oldest first:
   an honest handshake takes a round trip or two, so what lingers there is what a flood left behind;
2. an authenticated connection with no call in flight for at least ``idle_after`` seconds, idle the
   longest, that is not a peer this node has trained with (*protected*: peers the swarm cannot afford
   to lose to a flood). A connection in use now and then is never evicted: a flood of fresh connections
   cannot push out the peers a node talks to.

Victims come from the subnet that holds the most slots, so a flood from one subnet pays for itself.
A subnet or an address at its own limit can only lose its own connections to a newcomer of its own.
When nothing may be evicted, a few *reserved* slots beyond the limit still admit a connection from an
address a protected peer was seen at, or an expected one (below), on probation: it keeps its slot only
if its handshake shows a protected peer, or a member of a round this node takes part in. Otherwise the
answer is "busy", with the reason.

A connection from an *expected* address (a member of a round this node takes part in, until the round's
end: ``Inbound.expect``) may, when the table is full, also take the slot of an authenticated connection
that is idle now, however briefly, that is not protected. The invariant: the DHT's traffic never keeps
the members of a round from reaching each other. A node of a large swarm holds a connection from every
peer whose lookups asked it within ``idle_after``: at 1,024 simulated peers, more than the 512 slots,
and rounds of 15 to 34 members ran to their scatter deadline and committed with as few as a quarter of
them (the members that dialled a reducer they had no connection with heard "busy"; at 128 simulated
peers with 48 slots, a round of 18 committed with 5). An idle connection costs its peer one reconnect at its
next call; a round member refused costs the round its contribution. Where no slot may be taken (every
one protected, or in use now), a round member may use the reserve: the peers this node trains with now
are worth what the peers it trained with are. (A member the node does not expect yet, because it does
not hold the round's manifest yet, still hears "busy", and dials again: ``allreduce``. At 128
simulated peers with 48 slots, that was every "busy" a member heard from its reducer.)

A full table never turns newcomers away for good. Where nothing above may be evicted and the reserve
is not theirs, a newcomer may still take the slot of the unprotected connection with no call in flight
that was used least recently, once it has been idle ``turnover_idle`` seconds, at most ``rate`` such
slots a second (``Turnover``, a token bucket of the node's). The invariant: a dialer refused by a table
full of connections that are merely *recently* used is admitted within about a second, while the peers
a node trains with, the members of its rounds and the connections with a call in flight never give way,
and a flood from any number of addresses costs the node's other peers at most ``rate`` reconnects a
second. Without it, a large swarm's DHT traffic kept every connection younger than ``idle_after``, and
newcomers heard "busy" from every join peer until they gave up (128 simulated peers with 48 slots a
node: 11 of the last 30 joiners never joined in the minute they were given).

Before any of that, :class:`Arrivals` bounds how fast an address and a subnet may open new connections
(a token bucket each). Admission's bookkeeping looks at every slot; a flood that reconnects as fast as
it is evicted would make each honest node pay that for every attempt (one process holding 600 sockets,
each re-opened a second after it lost its slot, took a sixth of a core from the node it flooded). Past
the rate, a connection is answered "busy" before anything else is done for it, and held open a while
before it is closed (``linger``).

:func:`subnet_of` groups addresses: /24 for IPv4, /64 for IPv6; a loopback address and anything else
(the in-memory network's names) stands for itself.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@functools.lru_cache(maxsize=1 << 16)  # (a pure function of the text, asked at every admission)
def subnet_of(host: str) -> str:
    """The subnet limits count ``host`` in: its /24 (IPv4) or /64 (IPv6); a loopback address on its own
    (processes of one machine, told apart by address, as the DHT's storage shares do); a non-IP name as
    it is."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return str(ip)
    prefix = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(frozen=True)
class Limits:
    total: int = 512
    per_ip: int = 32
    per_subnet: int = 64
    reserve: int = 32  # slots beyond ``total`` for connections on probation (see the module docstring)
    idle_after: float = 30.0  # seconds without a call before an authenticated connection may be evicted
    turnover_idle: float = 1.0  # the same, for a slot turned over to a newcomer (``Turnover``)


@dataclass(frozen=True)
class Slot:
    """An inbound connection as admission sees it."""

    key: int
    ip: str
    subnet: str
    since: float  # unauthenticated: when it arrived; authenticated: when it was last busy
    authenticated: bool = False
    protected: bool = False  # a peer this node has trained with (or a round member's, see ``Inbound``)
    busy: bool = False  # calls in flight

    def evictable(self, now: float, idle_after: float) -> bool:
        if self.protected:  # (a handshake is protected only as an expected round member's: ``Inbound``)
            return False
        if not self.authenticated:
            return True
        return not self.busy and now - self.since >= idle_after


@dataclass(frozen=True)
class Admission:
    """``verdict``: "accept", "evict" (accept, after closing ``victim``), "probation" or "refuse";
    ``lent``: the slot is the expected member's alone, a stranger from the address would not have had it
    (``Inbound`` closes it after a handshake that shows another peer)."""

    verdict: str
    victim: Slot | None = None
    reason: str = ""
    lent: bool = False
    turnover: bool = False  # the victim was only ``turnover_idle`` idle: a token of ``Turnover`` is spent


def _victim(candidates: Sequence[Slot], by_subnet: Counter[str], now: float, limits: Limits) -> Slot | None:
    pool = [s for s in candidates if s.evictable(now, limits.idle_after)]
    if not pool:
        return None
    # handshaking before authenticated; then the most crowded subnet; then the oldest (or longest idle)
    return min(pool, key=lambda s: (s.authenticated, -by_subnet[s.subnet], s.since, s.key))


def admit(
    slots: Sequence[Slot],
    ip: str,
    now: float,
    limits: Limits,
    *,
    reserve: bool = False,
    expected: bool = False,
    turnover: bool = False,
) -> Admission:
    """What to do with a new inbound connection from ``ip`` at ``now``, given the ``slots`` in use;
    ``reserve``: a protected peer was seen at ``ip`` (it may use the reserved slots); ``expected``: a
    member of a round this node takes part in is at ``ip`` (over the total, it may take the slot of any
    idle connection that is not protected, see the module docstring); ``turnover``: the node's
    ``Turnover`` holds a token (over the total, where nothing else may give way, the least recently used
    connection idle ``turnover_idle`` that is not protected does)."""
    subnet = subnet_of(ip)
    by_subnet = Counter(s.subnet for s in slots)
    same_ip = [s for s in slots if s.ip == ip]
    if len(same_ip) >= limits.per_ip:
        victim = _victim(same_ip, by_subnet, now, limits)
        if victim is None:
            return Admission("refuse", reason=f"{len(same_ip)} connections from this address already")
        return Admission("evict", victim, f"over {limits.per_ip} connections from {ip}")
    if by_subnet[subnet] >= limits.per_subnet:
        victim = _victim([s for s in slots if s.subnet == subnet], by_subnet, now, limits)
        if victim is None:
            return Admission("refuse", reason=f"{by_subnet[subnet]} connections from {subnet} already")
        return Admission("evict", victim, f"over {limits.per_subnet} connections from {subnet}")
    if len(slots) >= limits.total:
        victim = _victim(
            slots, by_subnet, now, dataclasses.replace(limits, idle_after=0.0) if expected else limits
        )
        if victim is not None:
            lent = expected and _victim(slots, by_subnet, now, limits) is None
            return Admission("evict", victim, f"over {limits.total} inbound connections", lent)
        if (reserve or expected) and len(slots) < limits.total + limits.reserve:
            return Admission("probation", reason="only peers it trains or trained with may use the reserve")
        if turnover:
            briefly = dataclasses.replace(limits, idle_after=limits.turnover_idle)
            victim = _victim(slots, by_subnet, now, briefly)
            if victim is not None:
                why = f"over {limits.total} inbound connections, the least recently used turned over"
                return Admission("evict", victim, why, turnover=True)
        return Admission("refuse", reason="too many connections; try later")
    return Admission("accept")


@dataclass
class Turnover:
    """How fast a node's full table may turn slots over to newcomers (see the module docstring): a token
    bucket of ``rate`` a second, bursts of ``burst``; a rate of 0 turns none over."""

    rate: float = 1.0
    burst: float = 4.0
    _tokens: float = field(init=False)
    _when: float | None = field(default=None, init=False)  # (None: never looked at; full then)

    def __post_init__(self) -> None:
        self._tokens = self.burst

    def ready(self, now: float) -> bool:
        """Whether a slot may be turned over at ``now`` (seconds)."""
        if self.rate <= 0.0:
            return False
        if self._when is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._when) * self.rate)
        self._when = now
        return self._tokens >= 1.0

    def spend(self, now: float) -> None:
        """A slot was turned over at ``now``."""
        if self.ready(now):
            self._tokens -= 1.0


@dataclass
class Tally:
    """Which admission decisions are worth a log line: the first for an address, then at most one per
    ``every`` seconds, which stands for the ones since (a flood of connections, each evicting the one
    before, must not become a flood of log lines: one WARNING per evicted socket wrote ~190 lines a
    second per node in the hostile-peers benchmark). Remembers at most ``size`` addresses."""

    every: float = 60.0
    size: int = 1024
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict)

    def note(self, address: str, now: float) -> int:
        """Count one decision about ``address``; the number a line written now stands for (0: stay
        quiet, 1: just this one, n: this one and the n - 1 kept quiet since the last line)."""
        logged, quiet = self._seen.pop(address, (-math.inf, 0))
        if now - logged < self.every:
            self._seen[address] = (logged, quiet + 1)  # (re-inserted: the most recent address last)
            return 0
        self._seen[address] = (now, 0)
        while len(self._seen) > self.size:
            del self._seen[next(iter(self._seen))]
        return quiet + 1


@dataclass
class Arrivals:
    """How fast new inbound connections may arrive: a token bucket per address (``per_ip`` a second,
    bursts of ``ip_burst``) and per subnet (``per_subnet``, ``subnet_burst``). An honest peer opens a
    connection to a node once, and again after a failure: far below the rates. Remembers the ``size``
    most recent addresses and subnets (one forgotten starts again with a full bucket)."""

    per_ip: float = 1.0
    ip_burst: float = 64.0
    per_subnet: float = 4.0
    subnet_burst: float = 128.0
    size: int = 4096
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def allow(self, ip: str, now: float) -> bool:
        """Count a new connection from ``ip`` at ``now`` (seconds); False: over the rate, refuse it
        (a refused attempt takes no token)."""
        subnet = subnet_of(ip)
        keys = [(ip, self.per_ip, self.ip_burst)]
        if subnet != ip:
            keys.append((subnet, self.per_subnet, self.subnet_burst))
        levels = []
        for key, rate, burst in keys:
            tokens, when = self._buckets.pop(key, (burst, now))
            tokens = min(burst, tokens + max(0.0, now - when) * rate)
            self._buckets[key] = (tokens, now)  # (re-inserted: the most recent last)
            levels.append((key, tokens))
        while len(self._buckets) > self.size:
            self._buckets.popitem(last=False)
        if any(tokens < 1.0 for _, tokens in levels):
            return False
        for key, tokens in levels:
            self._buckets[key] = (tokens - 1.0, now)
        return True
