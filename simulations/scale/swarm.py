"""N training peers of the real node in one process, on trio's virtual clock, over the message-level
in-memory network; and what the run measures (see the package docstring).

Each peer is a real :class:`~p2ptrain.Node` (host, DHT, relays, averager) and a real
:class:`~p2ptrain.training.CollaborativeOptimizer` on a small model (an MLP, 8 hidden units per member
of a full group: 3,073 parameters for groups of 64, so that every member reduces a partition and
verifies its contributors, as in a real run): progress records, matchmaking, butterfly rounds, bans,
state-sync metadata and downloads all run as in a deployment. A peer computes one batch per ``compute /
speed`` virtual seconds (its compute is a sleep), so the swarm's step rate at a fixed per-peer batch is
a property of the protocol alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import math
import random
import re
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import trio
import trio.testing

from p2ptrain import Node, NodeConfig
from p2ptrain.config import RunConfig
from p2ptrain.dht.protocol import FindValueReq, ValueResp
from p2ptrain.dht.reads import Reader
from p2ptrain.dht.records import Entry, key_id
from p2ptrain.dht.replicas import Replicas
from p2ptrain.dht.routing import Contact
from p2ptrain.dht.server import CONTACT_BYTES, Server
from p2ptrain.dht.service import DHT
from p2ptrain.dht.spread import SpreadKey
from p2ptrain.identity import KEPT_SIGNATURES, Identity, PeerID, remember_verified_signatures
from p2ptrain.net import HostConfig, PeerAddress
from p2ptrain.net.messages import MessageNetwork
from p2ptrain.net.rpc import CallContext, Reply
from p2ptrain.training import CollaborativeOptimizer
from simulations.scale.heap import few_collections
from simulations.scale.model import Churn, PeerPlace, World, churn_events, pct
from simulations.scale.scheduling import seeded_scheduling

PORT = 4000
RUN_ID = "scale"
BATCH = 8  # samples per batch, every peer
DATA_METHODS = frozenset(
    {
        "avg.part",
        "avg.fetch",
        "avg.fetch_early",
        "avg.relay_result",
        "avg.audit_slice",
        "train.state_chunks",
        "train.result_data",
    }
)
"""Methods that carry tensors (the model's values); everything else a peer sends is control traffic. (A
relayed result is the model's values too: it was counted as control before, 2.1 MB a peer a step of the
128-peer run whose reducers stopped serving, see the docs' scale page.)"""
PEER_NAME: contextvars.ContextVar[str] = contextvars.ContextVar("peer", default="-")
"""The simulated peer whose task runs (every task a peer's node starts inherits it): for log lines."""
LANDING = 5.0  # virtual seconds a committed round is given to land on every member before the run ends
VERIFIED_SIGNATURES = 1 << 18  # good signatures the run's nodes share (about 300 bytes each)


@dataclass(frozen=True)
class SwarmSpec:
    peers: int
    duration: float = 300.0  # virtual seconds
    warmup: float = 90.0  # virtual seconds before the measurement window opens
    # virtual seconds the run goes on after ``duration`` (the window's end), measuring no bytes: a step
    # whose first round landed in the window is counted with every region's round that landed by then
    # (without it, the regions of the window's last step that landed after its end counted as left out)
    settle: float = 0.0
    batches_per_step: int = 10  # the target batch is peers x BATCH x this
    compute: float = 1.0  # virtual seconds per batch of a peer of speed 1
    join_spread: float = 30.0  # peers join over this many virtual seconds
    nat_share: float = 0.0
    churn: Churn = field(default_factory=Churn)
    loss: float = 0.0
    seed: int = 0
    max_group: int = 64  # the run's ``averaging.max_group_size``
    # The model's hidden units (0: 8 per member of a full group). Every member of a group reduces a
    # partition and verifies the contributors' slices of it, and trust is earned only there; with 49
    # parameters (8 hidden units) a member of a group of 100 reduced nothing, half the swarm verified
    # nobody, and its quorums were those of peers that trust a handful.
    width: int = 0
    buckets: int = 1  # the run's ``progress.buckets``: keys its progress records spread over
    regions: int = 1  # the run's ``progress.regions``: a step's groups, one per region
    # Each host's inbound connection cap (``HostConfig.max_inbound``; 0: its default, 512). A swarm of
    # more peers than the cap fills it with the DHT's connections; a smaller cap shows that at a
    # smaller, faster size (see the docs' scale page, "full inbound slots").
    max_inbound: int = 0

    @property
    def hidden(self) -> int:
        return self.width or 8 * self.max_group


@dataclass
class SimPeer:
    index: int
    place: PeerPlace
    node: Node
    opt: CollaborativeOptimizer
    model: torch.nn.Module
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    joined: float = 0.0
    gone: float | None = None
    bootstrapped: float | None = None  # when its DHT joined the swarm (a join peer answered it)
    steps: list[tuple[int, int, bytes, str, int, float]] = field(default_factory=list)
    # what it noted of each step, whether or not it took one: (epoch, outcome, reason)
    notes: list[tuple[int, str, str]] = field(default_factory=list)
    # (epoch left, epoch now, digest, outcome, samples of this peer in it, time)
    # the steps it was on, each with whether it was anchored there (it may lead a group of its region:
    # ``ProgressBoard.anchored``) at any of its ``step`` calls while on it
    anchored_on: dict[int, bool] = field(default_factory=dict)
    # the peers it trusted (``ProgressBoard.trusted``: None, every peer) as it landed each step's round
    trusted_at: dict[int, frozenset[PeerID] | None] = field(default_factory=dict)


def identity_of(name: str) -> Identity:
    return Identity.from_seed(hashlib.blake2b(name.encode(), digest_size=32).digest())


def make_model(hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def run_config(spec: SwarmSpec) -> RunConfig:
    return (
        RunConfig()
        .replace(
            "training",
            mode="sync",
            target_batch_size=spec.peers * BATCH * spec.batches_per_step,
            warmup_steps=0,
            lr=0.01,
            grad_clip=0.0,
        )
        .replace("averaging", matchmaking_time=3.0, max_group_size=spec.max_group)
        .replace("progress", buckets=spec.buckets, regions=spec.regions)
    )


def key_names(run_id: str, max_bits: int = 8) -> dict[bytes, str]:
    """The run's DHT keys that a reader reads, by key id: the peer list, and each bucket key of the
    progress, ban and matchmaking (``looks``) records at every spread up to ``2^max_bits`` buckets (a
    key the table lacks, such as a step's own matchmaking key in an unspread run, is ``other``)."""
    names = {}
    for what, base in (
        ("peer list", f"p2ptrain/{run_id}/peers"),
        ("progress", f"p2ptrain/{run_id}/progress"),
        ("bans", f"p2ptrain/{run_id}/bans"),
        ("looks", f"averaging/{run_id}/looks"),
    ):
        for bits in range(max_bits + 1):
            for b, key in enumerate(SpreadKey.of(base, bits).keys):
                names.setdefault(key_id(key), f"{what} {b}/{1 << bits}" if bits else what)
    return names


def key_name(names: dict[bytes, str], kid: bytes, *, kind: bool = False) -> str:
    """A key id's name in ``names`` (``key_names``), or ``other`` and its first bytes; ``kind``: without
    its bucket (``progress 3/8`` is ``progress``), and ``other`` alone."""
    if kind:
        return re.sub(r" \d+/\d+$", "", names.get(kid, "other"))
    return names.get(kid, f"other {kid.hex()[:8]}")


# what started a node lookup (``Reader.find_node``), by the function that called it
LOOKUP_CAUSES = {
    "find_replicas": "store",
    "_read_replicas": "read",
    "bootstrap": "join",
    "_refresh": "bucket refresh",
    "find_node": "find a peer",
}

# why a peer forgot a key's replicas (``Replicas.drop``: its next read or store looks them up again), by
# the function that dropped them
DROP_CAUSES = {
    "heard": "a replica named more closer peers than a read asks itself",
    "ask": "a replica failed a read",  # (``Reader._read_replicas``'s query of one replica)
    "_read_replicas": "fewer replicas held the key than the read's quorum",
    "store_entries": "a replica failed or refused a store",
}


@contextlib.contextmanager
def counting_value_replies(sim: Simulation) -> Iterator[None]:
    """Count each ``dht.find_value`` reply's bytes (its entries and contacts) by the serving peer and the
    key read, into ``sim.value_replies``, and each read a peer starts (``DHT.get``: a lookup, or the
    replicas it keeps) by its key, into ``sim.reads`` (while ``sim.counting``): which key a busy node
    serves, and whether its readers read it often or it answers much. And each node lookup
    (``dht.find_node``'s queries) by its cause, into ``sim.lookups``: a store's or a read's finding
    the replicas of a key this peer never looked up before (``first``), again once they expired
    (``expired``: ``replicas.TARGETS_TTL``) or were dropped (``dropped``: a replica failed, refused, or
    named a closer peer), a join's, a bucket refresh's. And each time a peer forgot a key's replicas,
    by its cause (``DROP_CAUSES``), into ``sim.drops``: what the ``dropped`` lookups follow."""
    answer, read, find, drop = Server.on_find_value, DHT.get, Reader.find_node, Replicas.drop

    async def on_find_value(self: Server, ctx: CallContext, req: FindValueReq) -> Reply[ValueResp]:
        reply = await answer(self, ctx, req)
        if sim.counting:
            sim.value_replies[PEER_NAME.get(), req.key_id] += len(reply.body) + CONTACT_BYTES * len(
                reply.message.contacts
            )
        return reply

    async def get(self: DHT, key: bytes, **kw: Any) -> dict[bytes, Entry]:
        if sim.counting:
            sim.reads[key_id(key)] += 1
        return await read(self, key, **kw)

    async def find_node(self: Reader, target: bytes) -> list[Contact]:
        caller = sys._getframe(1).f_code.co_name  # (the awaiting function)
        if caller == "replicas_of":  # (one lookup for every read and store that waits on it)
            caller = sys._getframe(2).f_code.co_name
        looked = (PEER_NAME.get(), target)
        if sim.counting:
            cause = LOOKUP_CAUSES.get(caller, caller)
            if caller in ("find_replicas", "_read_replicas"):
                if looked not in sim.looked_up:
                    cause += ": first"
                else:
                    expired = self._replicas.remembered(target) is not None  # (dropped: forgotten)
                    cause += ": expired" if expired else ": dropped"
            sim.lookups[cause] += 1
        sim.looked_up.add(looked)
        return await find(self, target)

    def dropping(self: Replicas, kid: bytes) -> None:
        if sim.counting:
            caller = sys._getframe(1).f_code.co_name
            sim.drops[DROP_CAUSES.get(caller, caller)] += 1
        drop(self, kid)

    Server.on_find_value = on_find_value  # type: ignore[method-assign]
    DHT.get = get  # type: ignore[method-assign]
    Reader.find_node = find_node  # type: ignore[method-assign]
    Replicas.drop = dropping  # type: ignore[method-assign]
    try:
        yield
    finally:
        Server.on_find_value = answer  # type: ignore[method-assign]
        DHT.get = read  # type: ignore[method-assign]
        Reader.find_node = find  # type: ignore[method-assign]
        Replicas.drop = drop  # type: ignore[method-assign]


class Simulation:
    def __init__(self, spec: SwarmSpec, nursery: trio.Nursery) -> None:
        self.spec = spec
        self.nursery = nursery
        self.world = World(spec.seed, spec.nat_share)
        self.net = MessageNetwork(latency=self.world.latency, loss=spec.loss, seed=spec.seed)
        self.config = run_config(spec)
        self.rng = random.Random(spec.seed + 1)
        self.peers: list[SimPeer] = []
        self.samples: Counter[int] = Counter()  # epoch -> samples the swarm computed on it
        self.reached: dict[int, float] = {}  # epoch -> when its samples reached the target
        self.events: Counter[str] = Counter()
        # epoch -> the contributors of a round that committed it, as a member that landed it noted them
        # (short ids): a member killed after the commit, before the round landed on it, was in it
        self.contributors: dict[int, set[str]] = {}
        # (serving peer's name, key id) -> bytes of its find_value replies, while counting (the window)
        self.value_replies: Counter[tuple[str, bytes]] = Counter()
        self.reads: Counter[bytes] = Counter()  # key id -> reads the peers started, while counting
        self.lookups: Counter[str] = Counter()  # cause -> node lookups the peers started, while counting
        self.looked_up: set[tuple[str, bytes]] = set()  # (peer's name, key id) of every node lookup
        self.drops: Counter[str] = Counter()  # cause -> a key's replicas forgotten, while counting
        self.counting = False

    def live(self) -> list[SimPeer]:
        return [p for p in self.peers if p.gone is None]

    async def start_peer(self) -> SimPeer:
        i = len(self.peers)
        place = self.world.place(i)
        self.net.set_host(place.name, place.link)
        if place.natted:
            self.net.nat(place.name)
        public = [p for p in self.live() if not p.place.natted]
        join: tuple[PeerAddress, ...] = ()
        if public:
            picks = [public[0], *self.rng.sample(public, min(2, len(public)))]
            join = tuple(dict.fromkeys(p.node.addresses[0] for p in picks))
        node = Node(
            identity_of(place.name),
            NodeConfig(
                run_id=RUN_ID,
                listen=((place.name, PORT),),
                join=join,
                peer_list_buckets=self.spec.buckets,
                host=HostConfig(max_inbound=self.spec.max_inbound) if self.spec.max_inbound else HostConfig(),
            ),
            transport=self.net.transport(place.name),
            clock=trio.current_time,
        )
        model = make_model(self.spec.hidden)
        inner = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = CollaborativeOptimizer(node, model, inner, self.config, clock=trio.current_time)
        peer = SimPeer(i, place, node, opt, model, joined=trio.current_time())
        self.peers.append(peer)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            PEER_NAME.set(place.name)
            with peer.scope:
                async with trio.open_nursery() as inner_nursery:
                    await inner_nursery.start(node.run)
                    inner_nursery.start_soon(self._note_bootstrap, peer)
                    await inner_nursery.start(opt.run)
                    task_status.started()
                    await self._train(peer)

        await self.nursery.start(run)
        return peer

    async def _note_bootstrap(self, peer: SimPeer) -> None:
        await peer.node.dht.bootstrapped.wait()
        peer.bootstrapped = trio.current_time()

    async def _train(self, peer: SimPeer) -> None:
        g = torch.Generator().manual_seed(100 + peer.index)
        x = torch.randn(BATCH, 4, generator=g)
        y = x.sum(1, keepdim=True)
        target = self.config.training.target_batch_size
        noted: dict[str, Any] = {}
        params = list(peer.model.parameters())
        # A peer's batch is the same every time, so its gradients change only when its parameters do (a
        # step applied, a state loaded: in place, which bumps each tensor's version): they are worked
        # out again only then, and the same values handed to the optimizer otherwise, which reads them
        # and lets go of them (at 64 peers, the tiny model's forward and backward passes were a third
        # of the simulator's main thread, the same values every time)
        grads: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        while True:
            version = tuple(p._version for p in params)
            if grads is None or grads[0] != version:
                torch.nn.functional.mse_loss(peer.model(x), y).backward()
                grads = (version, [p.grad for p in params if p.grad is not None])
            else:
                for p, g in zip(params, grads[1], strict=True):
                    p.grad = g
            await trio.sleep(self.spec.compute / peer.place.speed)
            epoch = peer.opt.epoch
            self.samples[epoch] += BATCH
            if self.samples[epoch] >= target and epoch not in self.reached:
                self.reached[epoch] = trio.current_time()
            took = await peer.opt.step(BATCH)
            on = peer.opt.epoch
            peer.anchored_on[on] = peer.anchored_on.get(on, False) or peer.opt.board.anchored
            last = peer.opt.stats.last
            if last and last is not noted:
                noted = last
                epoch_noted, why = int(last.get("epoch", -1)), str(last.get("reason", ""))
                peer.notes.append((epoch_noted, str(last["outcome"]), why))
            if took and last.get("outcome") == "averaged":
                peer.trusted_at[int(last.get("epoch", epoch))] = peer.opt.board.trusted()
                # (every round of the step's: one per region where the swarm is split)
                self.contributors.setdefault(int(last.get("epoch", epoch)), set()).update(
                    set(last.get("shares", {})) - set(last.get("excluded", {}))
                )
            if took:
                peer.steps.append(
                    (
                        int(last.get("epoch", epoch)),
                        peer.opt.epoch,
                        peer.opt.digest,
                        str(last.get("outcome")),
                        int(last.get("mine", 0)),
                        trio.current_time(),
                    )
                )

    def stop(self, peer: SimPeer, crash: bool) -> None:
        if crash:
            self.net.kill(peer.place.name)
        peer.gone = trio.current_time()
        peer.scope.cancel()

    async def churn(self, events: list[tuple[float, str]]) -> None:
        for at, kind in events:
            await trio.sleep_until(at)
            self.events[kind] += 1
            if kind == "join":
                await self.start_peer()
                continue
            candidates = [p for p in self.live() if p.index != 0]  # the seed stays
            if candidates:
                self.stop(self.rng.choice(candidates), crash=kind == "kill")


class LogContext(logging.Filter):
    """Adds the virtual time (``vt``) and the simulated peer (``peer``) to every log record, so that a
    run's log says who saw what, when (``--verbose``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.vt = trio.current_time()
        except RuntimeError:
            record.vt = -1.0
        record.peer = PEER_NAME.get()
        return True


def snapshot(peers: list[SimPeer]) -> dict[int, tuple[Counter[str], int]]:
    """Each live peer's bytes sent by method and bytes received, now."""
    return {p.index: (Counter(p.node.host.sent_by_method()), p.node.host.traffic()[1]) for p in peers}


async def simulate(spec: SwarmSpec) -> dict[str, Any]:
    """Run the swarm for ``spec.duration`` virtual seconds and measure it (see the package docstring)."""
    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        sim = Simulation(spec, nursery)
        with counting_value_replies(sim):
            report = await _simulate(sim, spec, began)
        nursery.cancel_scope.cancel()
    return report


async def _simulate(sim: Simulation, spec: SwarmSpec, began: float) -> dict[str, Any]:
    gap = spec.join_spread / max(1, spec.peers)
    for _ in range(spec.peers):
        await sim.start_peer()
        await trio.sleep(gap)
    built = time.perf_counter() - began
    events = churn_events(spec.churn, spec.peers, spec.warmup, spec.duration - spec.warmup, sim.rng)
    sim.nursery.start_soon(sim.churn, events)
    await trio.sleep_until(spec.warmup)
    window_start = trio.current_time()
    before = snapshot(sim.live())
    epoch_before = max(p.opt.epoch for p in sim.live())
    sim.counting = True
    await trio.sleep_until(spec.duration)
    sim.counting = False
    window = trio.current_time() - window_start
    after = snapshot(sim.live())
    epoch_after = max(p.opt.epoch for p in sim.live())
    await trio.sleep(spec.settle)
    report = measure(sim, before, after, epoch_before, epoch_after, window_start, window)
    report["sim"] = {
        "wall_s": round(time.perf_counter() - began, 1),
        "build_wall_s": round(built, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "connections_made": sim.net.connections_made,
        "churn_events": dict(sim.events),
    }
    return report


def measure(
    sim: Simulation,
    before: dict[int, tuple[Counter[str], int]],
    after: dict[int, tuple[Counter[str], int]],
    epoch_before: int,
    epoch_after: int,
    window_start: float,
    window: float,
) -> dict[str, Any]:
    steps = max(1, epoch_after - epoch_before)
    # ---- bytes, per peer present over the whole window ----
    by_method: Counter[str] = Counter()
    control_sent: list[float] = []
    control_received: list[float] = []
    data_sent: list[float] = []
    both = [i for i in after if i in before]
    for i in both:
        delta = after[i][0] - before[i][0]
        by_method.update(delta)
        control = sum(v for m, v in delta.items() if m not in DATA_METHODS)
        control_sent.append(control / steps)
        data_sent.append(sum(v for m, v in delta.items() if m in DATA_METHODS) / steps)
        control_received.append((after[i][1] - before[i][1]) / steps)
    # the node that sent the most control bytes, and by which methods (the hot spot, named)
    busiest = max(both, key=lambda i: control_sent[both.index(i)], default=None)
    hot: dict[str, Any] = {}
    names = key_names(RUN_ID)
    if busiest is not None:
        delta = after[busiest][0] - before[busiest][0]
        top = [(m, v) for m, v in delta.most_common() if m not in DATA_METHODS][:4]
        # its place among the peers closest to a progress key (0: a key's closest replica)
        rank = len(both)
        for key in sim.peers[busiest].opt.board.keys:
            kid = int.from_bytes(key_id(key), "big")
            order = sorted(both, key=lambda i: int.from_bytes(sim.peers[i].node.peer_id.digest, "big") ^ kid)
            rank = min(rank, order.index(busiest))
        name = sim.peers[busiest].place.name
        served = Counter({kid: v for (who, kid), v in sim.value_replies.items() if who == name})
        hot = {
            "peer": name,
            "progress_key_rank": rank,
            "by_method_per_step": {m: round(v / steps) for m, v in top},
            "find_value_by_key_per_step": {
                key_name(names, kid): round(v / steps) for kid, v in served.most_common(4)
            },
        }
    n = max(1, len(both))
    # which keys the reads' replies carried: per peer a step by kind of key, and the keys served most
    by_kind: Counter[str] = Counter()
    by_key: Counter[bytes] = Counter()
    for (_, kid), v in sim.value_replies.items():
        by_kind[key_name(names, kid, kind=True)] += v
        by_key[kid] += v
    reads: Counter[str] = Counter()
    for kid, v in sim.reads.items():
        reads[key_name(names, kid, kind=True)] += v
    value_replies = {
        "per_peer_per_step": {k: round(v / n / steps) for k, v in by_kind.most_common()},
        "reads_per_peer_per_step": {k: round(v / n / steps, 2) for k, v in reads.most_common()},
        "busiest_keys_per_step": {key_name(names, kid): round(v / steps) for kid, v in by_key.most_common(5)},
    }
    per_method = {m: round(v / n / steps) for m, v in by_method.most_common() if m not in DATA_METHODS}
    median_sent = statistics.median(control_sent) if control_sent else 0.0
    # ---- steps: forks, who was in each committed round, target reached -> committed ----
    # A fork: two states of one step. Where the swarm is split, each region's round leaves a state of
    # its own, and only the states that rounds left count (a download takes another region's). Two
    # groups of one region of a step are a fork when a member of the one that landed later trusted a
    # member of one that landed before, as it landed its round: what it trusted could tell it the
    # region's step was taken. Groups linked so by no trust are a region split (``region_splits``): to
    # the later group, the earlier one's members are keys it never verified, whose records no free id
    # must be able to imitate into stopping its group (docs/scale.md, Regions, "One region, two
    # groups").
    held: dict[tuple[int, int], dict[bytes, list[tuple[float, SimPeer]]]] = {}
    committed_at: dict[int, float] = {}
    for p in sim.peers:
        regions = p.opt.board.regions
        for left, now, digest, outcome, _mine, at in p.steps:
            if regions.split and outcome != "averaged":
                continue
            key = (now, regions.of_peer(p.node.peer_id, left))
            held.setdefault(key, {}).setdefault(digest, []).append((at, p))
            if outcome == "averaged":
                committed_at[left] = min(committed_at.get(left, math.inf), at)
    digests = {key: set(by) for key, by in held.items()}
    split = bool(sim.peers) and sim.peers[0].opt.board.regions.split
    # each region's groups of a step that left it with different states, in the order they landed
    twice = {
        key: [[p for _, p in g] for g in sorted(by.values(), key=lambda g: min(at for at, _ in g))]
        for key, by in held.items()
        if len(by) > 1
    }
    landed = {
        key: sorted(round(min(at for at, _ in g), 1) for g in by.values())
        for key, by in held.items()
        if len(by) > 1
    }
    linked = {key: not split or trust_linked(groups, key[0] - 1) for key, groups in twice.items()}
    forks = sorted({e for (e, r) in twice if linked[e, r]})
    region_splits = sorted({e for (e, r) in twice if not linked[e, r]})
    # who: each group's members and when it landed, and who of a later group trusted whom of an earlier
    apart = [
        {
            "epoch": e,
            "region": r,
            "fork": linked[e, r],
            "groups": [
                {"members": sorted(p.place.name for p in g), "landed_at": at}
                for g, at in zip(groups, landed[e, r], strict=True)
            ],
            "links": sorted(
                f"{q.place.name}->{p.place.name}"
                for i, g in enumerate(groups)
                for h in groups[i + 1 :]
                for p in g
                for q in h
                if trust_linked([[p], [q]], e - 1)
            )[:12],
        }
        # (forks first: a run of 512 peers had eight region splits listed and its one fork left out)
        for (e, r), groups in sorted(twice.items(), key=lambda kv: (not linked[kv[0]], kv[0]))[:8]
    ]
    shares = []
    # what the live peers left out of a committed round noted of its step instead (no group, aborted,
    # synced to the next: "none" if nothing), and why, where they say: where the share is lost
    missed: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    # when each live peer's look for the step's group began, after the step's first look: members',
    # the left-out's that looked before the commit, and how many of those did not
    member_looks: list[float] = []
    left_looks: list[float] = []
    missed_look = 0
    # when each left-out peer got onto the step (its state of it: a round or a download), from the
    # step's first look: where it came late to the step itself (caught up from the step before, left
    # out there), its look could not be in time; and per step, the left-out by where they were
    arrivals: list[float] = []
    per_step: list[dict[str, Any]] = []
    for epoch, at in sorted(committed_at.items()):
        if at < window_start or at > window_start + window - LANDING:
            continue  # (a round committed as the run ends may not have landed on all its members yet)
        alive = [p for p in sim.peers if p.joined < at - 30.0 and (p.gone is None or p.gone > at)]
        # in the round: landed it with samples of its own, or listed among its contributors (killed before
        # it landed: a peer dead within the landing's seconds was counted as left out, and noted nothing)
        listed = sim.contributors.get(epoch, set())
        inside = {
            p.index
            for p in alive
            if p.node.peer_id.short() in listed
            or any(s[0] == epoch and s[3] == "averaged" and s[4] for s in p.steps)
        }
        if alive:
            shares.append(len(inside) / len(alive))
        began_at = {p.index: p.opt.rounds.began_looking.get(epoch, math.inf) for p in alive}
        first = min((t for t in began_at.values() if t < math.inf), default=at)
        kinds: Counter[str] = Counter()
        landed: list[float] = []  # when each left-out peer got onto the step, from the commit
        for p in alive:
            began = began_at[p.index]
            if p.index in inside:
                member_looks.append(began - first)
                continue
            arrived = _arrived(p, epoch)
            if arrived < math.inf:
                arrivals.append(arrived - first)
                landed.append(round(arrived - at, 1))
            if arrived >= at:
                kinds["on_step_after_commit"] += 1
            elif began >= at:
                kinds["on_step_no_look_before_commit"] += 1
            else:
                kinds["looked_before_commit"] += 1
            if began < at:
                left_looks.append(began - first)
            else:
                missed_look += 1
            of = [n for n in p.notes if n[0] == epoch and n[1] != "synced"]
            of += [n for n in p.notes if n[0] == epoch + 1 and n[1] == "synced"]
            missed["+".join(sorted({n[1] for n in of})) or "none"] += 1
            reasons.update({_pattern(n[2]) for n in of if n[2]})
        per_step.append(
            {"epoch": epoch, "committed_at": round(at, 1), "members": len(inside), "alive": len(alive)}
            | dict(kinds)
            | {"left_out_on_step_from_commit_s": sorted(landed)}
        )
    # (steps first committed in the window: with ``settle``, the run goes on past it)
    windowed = {e: at for e, at in committed_at.items() if at <= window_start + window}
    waits = [
        committed_at[e] - sim.reached[e]
        for e in windowed
        if e in sim.reached and committed_at[e] >= window_start
    ]
    # from a step's first commit to the next step's samples reaching the target: the step's own work,
    # which a fixed per-peer batch keeps the same at any N unless peers spend the step elsewhere
    # (waiting for a group, catching up)
    accumulating = [
        sim.reached[e + 1] - committed_at[e]
        for e in windowed
        if e + 1 in sim.reached and committed_at[e] >= window_start
    ]
    # from one step's first commit to the next's, both in the window: the step rate, without the window's
    # rounding to whole steps (4 or 5 steps of about 12 s in a window of 50 s are 4.8 or 6.0 a minute)
    periods = step_periods(windowed, window_start)
    # ---- DHT lookups ----
    hops: list[float] = []
    queries: list[float] = []
    for p in sim.peers:
        for h, q in p.node.dht.reader.recent_lookups:
            hops.append(h)
            queries.append(q)
    # from a peer's start to its DHT's join (a join peer answered), every peer that started; a live peer
    # never joined trains alone on a swarm of one (at 128 peers with 48 slots, 11 heard "busy" from every
    # join peer for a minute)
    joins = [p.bootstrapped - p.joined for p in sim.peers if p.bootstrapped is not None]
    return {
        "peers": sim.spec.peers,
        "live_at_end": len(sim.live()),
        "join_s": {
            "median": round(pct(joins, 0.5), 2) if joins else None,
            "max": round(max(joins), 2) if joins else None,
            "never": sum(p.bootstrapped is None for p in sim.live()),
        },
        "parameters": 6 * sim.spec.hidden + 1,  # (the model's: 4 -> hidden -> 1)
        "virtual_s": round(window, 1),
        "global_steps": steps,
        "step_rate_per_min": round(steps / window * 60, 2),
        "step_period_s_median": round(pct(periods, 0.5), 2) if periods else None,
        "control_bytes_sent_per_peer_per_step": round(median_sent),
        "control_bytes_sent_per_peer_per_step_mean": round(statistics.fmean(control_sent))
        if control_sent
        else 0,
        "control_bytes_received_per_peer_per_step": round(statistics.median(control_received))
        if control_received
        else 0,
        "data_bytes_sent_per_peer_per_step": round(statistics.median(data_sent)) if data_sent else 0,
        "control_by_method_per_peer_per_step": per_method,
        "max_node_control_over_median": round(max(control_sent) / median_sent, 2) if median_sent else None,
        "busiest_node": hot,
        "find_value_replies": value_replies,
        "dht_lookup_hops_median": pct(hops, 0.5),
        "dht_lookup_hops_p99": pct(hops, 0.99),
        "dht_lookup_queries_median": pct(queries, 0.5),
        "dht_lookups": len(hops),
        "node_lookups_per_peer_per_step": {
            cause: round(v / max(1, len(both)) / steps, 2) for cause, v in sim.lookups.most_common()
        },
        "replicas_dropped_per_peer_per_step": {
            cause: round(v / max(1, len(both)) / steps, 2) for cause, v in sim.drops.most_common()
        },
        "target_to_commit_s_median": round(pct(waits, 0.5), 2) if waits else None,
        "target_to_commit_s_p90": round(pct(waits, 0.9), 2) if waits else None,
        "commit_to_target_s_median": round(pct(accumulating, 0.5), 2) if accumulating else None,
        "share_in_committed_round_mean": round(statistics.fmean(shares), 3) if shares else 0.0,
        "share_in_committed_round_min": round(min(shares), 3) if shares else 0.0,
        "steps_with_95pct": round(sum(s >= 0.95 for s in shares) / len(shares), 3) if shares else 0.0,
        "shares": [round(x, 3) for x in shares],
        "left_out_by_outcome": dict(missed.most_common()),
        "left_out_reasons": dict(reasons.most_common(6)),
        "look_after_first_s": {
            "members_p50": round(pct(member_looks, 0.5), 2) if member_looks else None,
            "members_max": round(max(member_looks), 2) if member_looks else None,
            "left_out_p50": round(pct(left_looks, 0.5), 2) if left_looks else None,
            "left_out_looked": len(left_looks),
            "left_out_no_look_before_commit": missed_look,
            "left_out_on_step_p50": round(pct(arrivals, 0.5), 2) if arrivals else None,
        },
        "left_out_per_step": per_step,
        "forks": len(forks),
        "fork_epochs": forks[:10],
        "region_splits": len(region_splits),
        "region_split_epochs": region_splits[:10],
        "two_groups_of_a_region": apart,
        # the live peers' parameters at the run's end, on the step most of them are on: the largest
        # distance of one from their mean, over the mean's norm (0 with one group a step; regions leave
        # each region its own state, mixed by the next steps' pairings)
        "drift": _drift(sim.live()),
        "groups_per_step": round(len(digests) / max(1, len({e for e, _ in digests})), 2),
        "regions_per_step": _regions_per_step(sim),
        # members' copies of rounds that aborted or were not applied, over the whole run (a round whose
        # contributors miss a member's signed quorum aborts on all its members)
        "aborted_round_copies": sum(p.opt.stats.aborted for p in sim.peers),
        # landing members' asks of the peers they trust, and copies not applied because one stayed busy
        "landing_asks": sum(p.opt.rounds.taken.asked for p in sim.peers),
        "landing_busy_drops": sum(p.opt.rounds.taken.busy for p in sim.peers),
        # members that leaders signed out of their groups' rounds: their quorums could not be met
        "signed_out_members": sum(p.node.averager.groups.signed_out for p in sim.peers),
    }


def step_periods(committed_at: dict[int, float], window_start: float) -> list[float]:
    """Seconds from each step's first commit to the next step's (``committed_at``: step -> its first
    commit), for the consecutive steps committed in the window (from ``window_start``)."""
    return [
        committed_at[e + 1] - at
        for e, at in sorted(committed_at.items())
        if at >= window_start and e + 1 in committed_at
    ]


def trust_linked(groups: list[list[SimPeer]], epoch: int) -> bool:
    """Whether a member of one of ``groups`` (the peers that left one region of step ``epoch`` with
    different states, in the order their rounds landed) trusted a member of an earlier one as it landed
    its round there (``trusted_at``; not recorded, or None: it trusted every peer)."""

    def trusts(q: SimPeer, p: SimPeer) -> bool:
        t = q.trusted_at.get(epoch)
        return t is None or p.node.peer_id in t

    return any(
        trusts(q, p)
        for i, earlier in enumerate(groups)
        for later in groups[i + 1 :]
        for p in earlier
        for q in later
    )


def _regions_per_step(sim: Simulation) -> list[dict[str, Any]]:
    """Where the swarm is split into regions, for each step of the run (its start included): each
    region's peers that were on the step, those of them anchored there (it may lead), and the members
    of its committed round. A region forms a group where an anchored peer is, or where its records name
    nobody who may lead but newcomers (``RoundRunner._form_group``), and its rounds' members are
    anchored at the next step, in the regions that step pairs: the table shows how leaders spread and
    where peers sat out (empty with one region). ``landed_s``: when each region's round first landed,
    in seconds after the step's first round did (how far apart a step's regions finish: the next
    step's samples start adding up as each region's members move on to it)."""
    if not sim.peers or not sim.peers[0].opt.board.regions.split:
        return []
    regions = sim.peers[0].opt.board.regions
    out = []
    for epoch in range(1 + max(max(p.anchored_on, default=0) for p in sim.peers)):
        rows: dict[int, list[int]] = {}
        landed: dict[int, float] = {}
        for p in sim.peers:
            if epoch not in p.anchored_on:
                continue
            region = regions.of_peer(p.node.peer_id, epoch)
            row = rows.setdefault(region, [0, 0, 0])
            row[0] += 1
            row[1] += p.anchored_on[epoch]
            at = min((s[5] for s in p.steps if s[0] == epoch and s[3] == "averaged"), default=math.inf)
            row[2] += at < math.inf
            landed[region] = min(landed.get(region, math.inf), at)
        first = min(landed.values(), default=math.inf)
        out.append(
            {
                "epoch": epoch,
                "committed": sum(r[2] > 0 for r in rows.values()),
                "regions": {str(k): rows[k] for k in sorted(rows)},  # [on the step, anchored, members]
                "landed_s": {
                    str(k): round(landed[k] - first, 1) for k in sorted(landed) if landed[k] < math.inf
                },
            }
        )
    return out


def _drift(peers: list[SimPeer]) -> float | None:
    """The largest distance of a peer's parameters from the mean of those on the most common step, over
    the mean's norm (see ``measure``)."""
    on = Counter(p.opt.epoch for p in peers)
    if not on:
        return None
    epoch = on.most_common(1)[0][0]
    flat = [
        torch.cat([t.detach().flatten() for t in p.model.parameters()]) for p in peers if p.opt.epoch == epoch
    ]
    mean = torch.stack(flat).mean(0)
    return round(max(float((f - mean).norm()) for f in flat) / max(float(mean.norm()), 1e-12), 6)


def _arrived(peer: SimPeer, epoch: int) -> float:
    """When ``peer`` got onto ``epoch`` (a round or a download took it there; its start for the step it
    began on), infinity if it never was on it."""
    began_on = peer.steps[0][0] if peer.steps else peer.opt.epoch
    if began_on == epoch:
        return peer.joined
    return min((s[5] for s in peer.steps if s[1] == epoch), default=math.inf)


def _pattern(reason: str) -> str:
    """A reason with its peer ids and numbers left out, so that reasons alike count together."""
    return re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\w{6}\.\.\w{4}", "X", reason))[:60]


def run(spec: SwarmSpec) -> dict[str, Any]:
    """One run on an autojump clock, the same run again for the same spec (``seeded_scheduling``,
    ``threads_inline``). The nodes share one process: a signature one of them checked is not checked
    again by another (each member of a group checks every contributor's signed scale of every
    partition, k^2 checks a member; the simulation's CPU, not what it measures)."""
    remember_verified_signatures(VERIFIED_SIGNATURES)
    clock = trio.testing.MockClock(autojump_threshold=0)
    try:
        with threads_inline(), few_collections(), seeded_scheduling(spec.seed):
            result: dict[str, Any] = trio.run(simulate, spec, clock=clock)
    finally:
        remember_verified_signatures(KEPT_SIGNATURES)
    return result


@contextlib.contextmanager
def threads_inline() -> Iterator[None]:
    """Work the node hands to a worker thread (``trio.to_thread.run_sync``: a state snapshot, a large
    reduction) runs on the simulator's own thread instead, after a checkpoint: it takes no virtual time
    (a peer's compute sleeps stand for it), and what runs meanwhile does not depend on how long the
    machine takes over it. Held still while a real thread ran, the clock kept the work's virtual time
    at zero, but the ready tasks went on meanwhile, as many as the machine's load let: two runs of one
    command under load differed. (Nothing a simulated node hands a thread calls back into trio.)"""
    real = trio.to_thread.run_sync

    async def run_sync(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    trio.to_thread.run_sync = run_sync  # type: ignore[assignment]
    try:
        yield
    finally:
        trio.to_thread.run_sync = real  # type: ignore[assignment]
