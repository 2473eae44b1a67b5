"""All-reduce groups without matchmaking: peers each running a Host and an Averager over one in-memory
network, handed a signed manifest directly (``async with open_group(n) as group``, then ``run_round``),
and ``check_invariant``, what every round must end in whatever fails: every survivor commits the same
bits or every survivor aborts.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
import trio

from p2ptrain.averaging import sparse
from p2ptrain.averaging.allreduce import AllReduceRound, RoundResult
from p2ptrain.averaging.averager import Averager, schema_of
from p2ptrain.averaging.compression import Compression
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, SignedManifest
from p2ptrain.errors import RoundAborted
from p2ptrain.net import Host, LinkProfile, MemoryNetwork
from tests.harness.identities import identity

RUN_ID = "avg-test"
PORT = 2000


@dataclass
class Peer:
    name: str
    host: Host
    averager: Averager
    listen: bool
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    round_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: trio.Event = field(default_factory=trio.Event)

    @property
    def addr(self) -> str:
        return str(self.host.advertised_addresses()[0]) if self.listen else ""


class Group:
    def __init__(self, nursery: trio.Nursery, net: MemoryNetwork) -> None:
        self.nursery, self.net = nursery, net
        self.peers: list[Peer] = []
        self.crashed: set[str] = set()

    async def start(self, name: str, *, listen: bool = True) -> Peer:
        host = Host(identity(name), RUN_ID, transport=self.net.transport(name))
        peer = Peer(name, host, Averager(host, None, clock=trio.current_time), listen)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with peer.scope:
                    async with trio.open_nursery() as inner:
                        await inner.start(host.run, [(name, PORT)] if listen else [])
                        await inner.start(peer.averager.run)
                        task_status.started()
            finally:
                peer.stopped.set()

        await self.nursery.start(run)
        self.peers.append(peer)
        return peer

    def crash(self, peer: Peer) -> None:
        """As if the process died: connections reset, listener gone, every task cancelled."""
        self.crashed.add(peer.name)
        self.net.kill(peer.name)
        peer.scope.cancel()
        peer.round_scope.cancel()


@asynccontextmanager
async def open_group(n: int, *, client_only: tuple[int, ...] = (), seed: int = 5) -> AsyncIterator[Group]:
    async with trio.open_nursery() as nursery:
        group = Group(nursery, MemoryNetwork(seed=seed, default=LinkProfile(latency=0.005)))
        for i in range(n):
            await group.start(f"p{i}", listen=i not in client_only)
        yield group
        nursery.cancel_scope.cancel()


def sign_manifest(
    peers: list[Peer],
    tensors: list[torch.Tensor],
    *,
    bandwidths: list[float] | None = None,
    compression: str = "none",
    timeout: float = 30.0,
    round_id: bytes | None = None,
    aggregation: str = "mean",
) -> SignedManifest:
    schema = schema_of(tensors)
    total = sum(t.numel() for t in tensors)
    bws = bandwidths or [1.0] * len(peers)
    align = sparse.BLOCK if Compression(compression).sparse else 1
    sizes = partition_sizes(total, bws, [p.listen for p in peers], align)
    manifest = Manifest(
        round_id=round_id or random.Random(len(peers)).randbytes(16),
        group_key="test",
        members=tuple(
            MemberMsg(p.host.identity.peer_id.digest, p.addr, bw) for p, bw in zip(peers, bws, strict=True)
        ),
        sizes=tuple(sizes),
        schema=schema,
        compression=compression,
        timeout=timeout,
        aggregation=aggregation,
    )
    return SignedManifest.sign(peers[0].host.identity, manifest)


def make_tensors(seed: int, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes, strict=True)]


Outcome = RoundResult | BaseException | None  # None: the member was crashed


async def run_round(
    group: Group,
    signed: SignedManifest,
    inputs: list[list[torch.Tensor]],
    weights: list[float],
    in_place: bool = False,
) -> list[Outcome]:
    outcomes: list[Outcome] = [None] * len(group.peers)

    async def one(i: int, peer: Peer) -> None:
        if peer.name in group.crashed:
            return  # (dead before its round began: it runs nothing)
        with peer.round_scope:
            try:
                outcomes[i] = await peer.averager.run_round(
                    signed, inputs[i], weight=weights[i], in_place=in_place
                )
            except RoundAborted as e:
                outcomes[i] = e

    async with trio.open_nursery() as nursery:
        for i, peer in enumerate(group.peers):
            nursery.start_soon(one, i, peer)
    # a member that crashed is no survivor, even if it committed before it died
    return [None if p.name in group.crashed else o for p, o in zip(group.peers, outcomes, strict=True)]


def check_invariant(
    originals: list[list[torch.Tensor]],
    inputs: list[list[torch.Tensor]],
    weights: list[float],
    outcomes: list[Outcome],
    *,
    atol: float = 1e-5,
    in_place: bool = False,
) -> str:
    """'commit' or 'abort' for the survivors; fails the test on any divergence. (In place, an abort may
    leave the caller's tensor spoilt: that is the bargain.)"""
    survivors = [i for i, o in enumerate(outcomes) if o is not None]
    committed = [i for i in survivors if isinstance(outcomes[i], RoundResult)]
    aborted = [i for i in survivors if isinstance(outcomes[i], RoundAborted)]
    assert len(committed) + len(aborted) == len(survivors), f"unexpected outcomes {outcomes}"
    for i in [] if in_place else aborted:  # an abort leaves the caller's tensors as they were
        for got, orig in zip(inputs[i], originals[i], strict=True):
            assert torch.equal(got, orig)
    if not committed:
        return "abort"
    assert not aborted, (
        f"members {committed} committed while {aborted} aborted: {[outcomes[i] for i in aborted]}"
    )
    first = outcomes[committed[0]]
    assert isinstance(first, RoundResult)
    peers_order = [r for r in first.contributors]
    for i in committed[1:]:
        res = outcomes[i]
        assert isinstance(res, RoundResult)
        assert res.contributors == peers_order
        for a, b in zip(inputs[committed[0]], inputs[i], strict=True):
            assert torch.equal(a, b), "members hold different bits"
    return "commit"


def contributors_of(group: Group, result: RoundResult) -> list[int]:
    ids = [p.host.identity.peer_id for p in group.peers]
    return [ids.index(c) for c in result.contributors]


PHASES = ["before_send", "mid_send", "mid_reduce", "decide", "after_reduce", "during_gather"]


def crash_at(group: Group, victim: Peer, phase: str, *, stall: float | None = None) -> Callable:
    """A fault hook: the victim crashes (or stalls ``stall`` seconds) the first time it reaches ``phase``."""
    fired = []

    async def hook(rnd: AllReduceRound, name: str) -> None:
        if name != phase or fired:
            return
        fired.append(trio.current_time())
        if stall is not None:
            await trio.sleep(stall)
            return
        group.crash(victim)
        await trio.sleep_forever()  # cancelled with the victim's scope

    return hook
