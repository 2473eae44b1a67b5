"""Collaborative-training swarms: peers that each run a Node and a CollaborativeOptimizer on a small
model over one in-memory network, on the virtual clock (``async with swarm(run_config()) as s``).

Peer i trains on its own fixed batch (``batch_of(i)``), so the averaged gradient a step should take is
easy to compute; ``check_identical_per_epoch`` is the check every training test ends with.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.config import RunConfig
from p2ptrain.net import MemoryNetwork
from p2ptrain.training import CollaborativeOptimizer
from tests.harness.identities import identity

PORT = 4000
BATCH = 8
TARGET = 48


def run_config(mode: str = "sync", overlap: bool = False) -> RunConfig:
    return (
        RunConfig()
        .replace("training", mode=mode, target_batch_size=TARGET, warmup_steps=0, lr=0.01, grad_clip=0.0)
        .replace("diloco", overlap=overlap)
        .replace("averaging", timeout=10.0, matchmaking_time=2.0)
        .replace("progress", interval=0.5, ttl=3.0)
    )


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # as the trainer does: every peer starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def make_optimizer(model: torch.nn.Module, sgd: bool) -> torch.optim.Optimizer:
    # Plain SGD where a test checks the size of a step: Adam's steps hardly depend on the gradient's scale.
    if sgd:
        return torch.optim.SGD(model.parameters(), lr=0.01)
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def batch_of(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer i always computes on the same batch: the expected averaged gradient is easy to compute."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(BATCH, 4, generator=g)
    return x, x.sum(1, keepdim=True) * (i + 1)


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


@dataclass
class Peer:
    index: int
    node: Node
    model: torch.nn.Module
    opt: CollaborativeOptimizer
    compute: float  # virtual seconds per batch
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    steps: list[tuple[int, bytes, str, float]] = field(default_factory=list)  # epoch, digest, outcome, time
    batches_before_first_step: int = 0
    first_contribution: int = 0  # samples this peer put into its first global step
    params_at: dict[int, str] = field(default_factory=dict)  # epoch -> hash of the parameters taken on it

    def params_hash(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for p in self.model.parameters():
            h.update(p.detach().numpy().tobytes())
        return h.hexdigest()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


class Swarm:
    def __init__(
        self,
        nursery: trio.Nursery,
        config: RunConfig,
        sgd: bool = False,
        summed: bool = False,
        model: Callable[[], torch.nn.Module] = make_model,
    ) -> None:
        """``summed``: the peers scale each batch's loss by its samples and keep their gradients in the
        optimizer's accumulator (``summed_grads``); peer i's batches then have BATCH - i samples.
        ``model``: builds each peer's model (the same weights every time); ``make_model`` may be set
        before the peers start instead."""
        self.nursery, self.config, self.sgd, self.summed = nursery, config, sgd, summed
        self.net = MemoryNetwork(seed=7)
        self.peers: list[Peer] = []
        self.make_model = model

    async def start(
        self, compute: float = 0.1, *, train: bool = True, config: RunConfig | None = None
    ) -> Peer:
        """A new peer; ``config``: its own run file instead of the swarm's (settings that are a peer's
        own business, where its outer state lives say)."""
        i = len(self.peers)
        name = f"t{i}"
        node_config = NodeConfig(
            run_id="train",
            listen=((name, PORT),),
            join=(self.peers[0].node.addresses[0],) if self.peers else (),
            averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
        )
        node = Node(identity(name), node_config, transport=self.net.transport(name), clock=trio.current_time)
        model = self.make_model()
        inner = make_optimizer(model, self.sgd)
        opt = CollaborativeOptimizer(
            node, model, inner, config or self.config, clock=trio.current_time, summed_grads=self.summed
        )
        peer = Peer(i, node, model, opt, compute)
        self.peers.append(peer)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with peer.scope:
                async with trio.open_nursery() as inner_nursery:
                    await inner_nursery.start(node.run)
                    await inner_nursery.start(opt.run)
                    task_status.started()
                    if train:
                        await self._train(peer)
                    await trio.sleep_forever()  # a peer that does not train still serves

        await self.nursery.start(run)
        return peer

    async def _train(self, peer: Peer) -> None:
        batch = batch_of(peer.index)
        samples = BATCH - peer.index if self.summed else BATCH
        batch = (batch[0][:samples], batch[1][:samples])
        while True:
            (loss_of(peer.model, batch) * (samples if self.summed else 1)).backward()
            await trio.sleep(peer.compute)
            if not peer.steps:
                peer.batches_before_first_step += 1
            if await peer.opt.step(samples):
                last = peer.opt.stats.last
                if not peer.steps:
                    peer.first_contribution = last.get("mine", 0)
                peer.steps.append((peer.opt.epoch, peer.opt.digest, last["outcome"], trio.current_time()))
                peer.params_at[peer.opt.epoch] = peer.params_hash()

    def crash(self, peer: Peer) -> None:
        """As if the process died: connections reset, every task cancelled, nothing said to anyone."""
        self.net.kill(f"t{peer.index}")
        peer.scope.cancel()

    async def until(self, condition: object, timeout: float) -> None:
        """Poll a condition on the virtual clock (the peers' loops change it on every batch)."""
        with trio.fail_after(timeout):
            while not condition():  # type: ignore[operator]  # noqa: ASYNC110
                await trio.sleep(0.05)


@asynccontextmanager
async def swarm(
    config: RunConfig,
    *,
    sgd: bool = False,
    summed: bool = False,
    model: Callable[[], torch.nn.Module] = make_model,
) -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        s = Swarm(nursery, config, sgd, summed, model)
        yield s
        nursery.cancel_scope.cancel()


def check_identical_per_epoch(peers: list[Peer], since: int = 0) -> dict[int, set[bytes]]:
    """Every epoch (from ``since`` on) any two peers both reached: the same digest (the parameters are
    the same bits)."""
    by_epoch: dict[int, set[bytes]] = {}
    for p in peers:
        for epoch, digest, _, _ in p.steps:
            if epoch >= since:
                by_epoch.setdefault(epoch, set()).add(digest)
    diverged = {e: ds for e, ds in by_epoch.items() if len(ds) > 1}
    assert not diverged, f"peers hold different parameters on steps {sorted(diverged)}"
    return by_epoch


def check_healed(peers: list[Peer], within: int = 3) -> list[int]:
    """Peers that held different parameters on a step agree again within ``within`` steps, and on the
    last step all of them reached; returns the steps they held apart.

    Where a hostile reducer serves a result within one member's bound and beyond another's (each bounds
    a result by its own values, see ``averaging.bounds``), the first commits the round and the second
    refuses it and takes the step with the others: the swarm splits for a step, and the minority
    downloads the majority's state. Tests of such attacks check this instead of
    :func:`check_identical_per_epoch`."""
    by_epoch: dict[int, set[bytes]] = {}
    holders: dict[int, int] = {}
    for p in peers:
        for epoch, digest, _, _ in p.steps:
            by_epoch.setdefault(epoch, set()).add(digest)
        for epoch in {e for e, _, _, _ in p.steps}:
            holders[epoch] = holders.get(epoch, 0) + 1
    apart = sorted(e for e, ds in by_epoch.items() if len(ds) > 1)
    agreed = [e for e, ds in by_epoch.items() if len(ds) == 1 and holders[e] == len(peers)]
    for e in apart:
        assert any(e < a <= e + within for a in agreed), f"the peers split on step {e} and stayed apart"
    last = max((e for e in by_epoch if holders[e] == len(peers)), default=None)
    assert last is not None and len(by_epoch[last]) == 1, (
        f"the peers hold different parameters on step {last}"
    )
    return apart


async def take_local_steps(peer: Peer, n: int) -> None:
    """Steps of a peer on its own, driven directly (no swarm involved)."""
    for _ in range(n):
        loss_of(peer.model, batch_of(0)).backward()
        peer.opt.local.accumulate(BATCH)
        peer.opt.tally.count(BATCH)
        await peer.opt.solo_step()


def validation_loss(model: torch.nn.Module) -> float:
    g = torch.Generator().manual_seed(999)
    x = torch.randn(256, 4, generator=g)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * 2.0))


def mid_model() -> torch.nn.Module:
    """About 17k parameters: a few sparse blocks, so top-k has a choice to make."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 1),
    )


def record_steps(peers: list[Peer]) -> dict[int, list[dict[str, Any]]]:
    """From now on, what each of ``peers`` notes about each global step it takes (``RoundStats``'s
    ``note_step``: outcome, samples, its own share), by step."""
    steps: dict[int, list[dict[str, Any]]] = {}
    for p in peers:
        note = p.opt.stats.note_step

        def noted(last: dict[str, Any], note: Any = note) -> None:
            steps.setdefault(last["epoch"], []).append(last)
            note(last)

        p.opt.stats.note_step = noted  # type: ignore[method-assign]
    return steps
