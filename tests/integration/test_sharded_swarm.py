"""A 2-rank site and an unsharded peer train one model with DiLoCo and average over the real averager
(two hosts on the in-memory network, a signed manifest): each trains on its own data (the site with
FSDP2 over gloo, the peer with plain AdamW), and after every outer step both hold the same global
parameters, bit for bit, and a round that aborts changes neither. The site's full parameters are
gathered here, in the test only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.averager import schema_of
from p2ptrain.averaging.compression import Compression
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, SignedManifest
from p2ptrain.config import DilocoSection
from p2ptrain.training.optimizer.buffers import Contribution
from p2ptrain.training.optimizer.outer import OuterStep
from p2ptrain.training.site import launch
from p2ptrain.training.site.commands import Command, Commands, Op
from p2ptrain.training.site.layout import WireLayout
from p2ptrain.training.site.outer import ShardedOuter
from p2ptrain.training.site.pieces import PieceChannel
from p2ptrain.training.site.wire import WireBuffer
from tests.harness.averaging import Group, open_group, run_round
from tests.harness.clock import process_clock

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)
STEPS, INNER = 3, 2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 16))


def batch(who: int, k: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * who + k))


def inner(m: torch.nn.Module, opt: torch.optim.Optimizer, who: int, k: int) -> None:
    x = batch(who, k)
    loss = (m(x) - x.flip(1)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def manifest(group: Group, wire: torch.Tensor, step: int) -> SignedManifest:
    peers = group.peers
    m = Manifest(
        round_id=step.to_bytes(16, "big"),
        group_key="site",
        members=tuple(MemberMsg(p.host.identity.peer_id.digest, p.addr, 1.0) for p in peers),
        sizes=tuple(partition_sizes(wire.numel(), [1.0] * len(peers), [True] * len(peers), 1)),
        schema=schema_of([wire]),
        compression="none",
        timeout=30.0,
    )
    return SignedManifest.sign(peers[0].host.identity, m)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def site(rank: int, world: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    m = model()
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    names = [n for n, _ in m.named_parameters()]
    layout = WireLayout(names, [p.shape for p in m.parameters()], world)
    d = DilocoSection()
    outer = ShardedOuter(list(m.parameters()), layout, PieceChannel(layout, rank), d, Compression.NONE)
    every = range(len(names))
    commands = Commands(rank)
    k = 0
    if rank != 0:
        while (cmd := commands.receive()).op is not Op.STOP:
            if cmd.op is Op.TRAIN:
                for _ in range(cmd.a):
                    inner(m, opt, rank, k)
                    k += 1
            elif cmd.op is Op.CONTRIBUTE:
                outer.contribute(range(cmd.a, cmd.b), None)
            elif cmd.op is Op.LAND:
                outer.land(range(cmd.a, cmd.b), None, committed=bool(cmd.c))
                [full(g) for g in outer.global_params]  # (the test's gather, on every rank)
        return

    peer_model = model()
    peer_opt = torch.optim.AdamW(peer_model.parameters(), lr=1e-2)
    params = list(peer_model.parameters())
    contribution = Contribution(params, [every], diloco=True, summed=False)
    peer = OuterStep(params, contribution, d, Compression.NONE)

    async def main() -> None:
        nonlocal k
        async with open_group(2) as group:
            for step in range(STEPS):
                commands.send(Command(Op.TRAIN, INNER))
                for _ in range(INNER):
                    inner(m, opt, 0, k)
                    inner(peer_model, peer_opt, 7, k)
                    k += 1
                wire = WireBuffer(layout.total)
                commands.send(Command(Op.CONTRIBUTE, 0, len(names)))
                outer.contribute(every, wire)
                peer.pseudo_gradients()
                theirs = contribution.buffer.flat
                assert theirs is not None
                before = [g.clone() for g in peer.global_params]
                signed = manifest(group, wire.flat, step)
                for p in group.peers:
                    p.round_scope = trio.CancelScope()
                if step == 1:  # the round is called off (as a short quorum is): nothing may change
                    committed = False
                else:
                    outcomes = await run_round(group, signed, [[wire.flat], [theirs]], [16.0, 16.0], True)
                    assert all(isinstance(o, RoundResult) for o in outcomes), outcomes
                    result = outcomes[0]
                    assert isinstance(result, RoundResult) and len(result.contributors) == 2
                    committed = True
                    await result.retired.wait()
                commands.send(Command(Op.LAND, 0, len(names), int(committed)))
                outer.land(every, wire, committed=committed)
                wire.close()
                got = [full(g) for g in outer.global_params]
                if committed:
                    peer.step(after=peer.reset_local)
                    for a, b in zip(got, peer.global_params, strict=True):
                        assert torch.equal(a, b), f"the site's global parameters differ at step {step}"
                    assert not all(torch.equal(a, b) for a, b in zip(got, before, strict=True))
                else:
                    for a, b in zip(got, before, strict=True):
                        assert torch.equal(a, b), "an aborted round changed the site's global parameters"
            commands.send(Command(Op.STOP))

    trio.run(main, clock=process_clock())  # (a round's thread takes no virtual time: no timeout under load)
    Path(out).write_text("ok")


def test_a_site_and_an_unsharded_peer_hold_the_same_global_parameters_after_every_outer_step(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ok"
    launch.spawn(site, 2, str(out), timeout=120)
    assert out.read_text() == "ok"
