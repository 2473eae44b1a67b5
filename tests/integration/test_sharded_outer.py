"""A site's sharded DiLoCo outer step (plain, top-k, streaming, overlap) against an unsharded peer's
(``optimizer.outer.OuterStep``), on real ranks (gloo on the CPU, spawned processes): given the same
state, the wire vector rank 0 assembles from the ranks' pieces is the unsharded contribution bit for
bit, and after every outer step (committed or aborted, with and without top-k's error feedback) the
global and local parameters and the residual are the same bits. The full tensors are gathered here, in
the test only."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from p2ptrain.averaging import sparse
from p2ptrain.averaging.compression import Compression
from p2ptrain.config import DilocoSection
from p2ptrain.training.optimizer import fragments
from p2ptrain.training.optimizer.buffers import Contribution
from p2ptrain.training.optimizer.outer import OuterStep
from p2ptrain.training.site import launch
from p2ptrain.training.site.layout import WireLayout
from p2ptrain.training.site.outer import ShardedOuter, local_of
from p2ptrain.training.site.pieces import PieceChannel
from p2ptrain.training.site.wire import WireBuffer

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd row counts: uneven FSDP2 chunks, a rank with no rows of the bias of 2
    return torch.nn.Sequential(torch.nn.Embedding(37, 129), torch.nn.Linear(129, 67), torch.nn.Linear(67, 2))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def noise(shapes: list[torch.Size], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 0.01 for s in shapes]


def rows(t: torch.Tensor, layout: WireLayout, i: int, rank: int) -> torch.Tensor:
    from p2ptrain.training.site.layout import rows_of

    r = rows_of(layout.shapes[i].numel() and layout.shapes[i][0], layout.world, rank)
    return t[r.start : r.stop]


def check(rank: int, world: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for mode, count, overlap, stage in (
        ("none", 1, False, False),
        ("topk3-q4", 1, True, False),
        ("topk3-q4", 2, False, False),
        ("topk3-q4", 1, False, True),  # rank 0 staging pieces through one buffer (a GPU's pinned path)
    ):
        check_mode(rank, world, mesh, mode, count, overlap, stage)
    dist.barrier()
    if rank == 0:
        Path(out).write_text("ok")


def check_mode(
    rank: int, world: int, mesh: object, mode: str, count: int, overlap: bool, stage: bool = False
) -> None:
    """``count`` > 1: streaming DiLoCo, one fragment of the parameters a step; ``overlap``: the inner
    steps go on during the round, and their progress lands on top of the new global parameters;
    ``stage``: rank 0 moves every piece through one reused staging buffer (on a GPU: pinned memory)."""
    reference = model()
    site = copy.deepcopy(reference)
    fully_shard(site, mesh=mesh)
    names = [n for n, _ in site.named_parameters()]
    layout = WireLayout(names, [p.shape for p in site.parameters()], world)
    d = DilocoSection(outer_lr=0.7, outer_momentum=0.9)
    outer = ShardedOuter(
        list(site.parameters()),
        layout,
        PieceChannel(layout, rank, stage=stage),
        d,
        Compression(mode),
        piece=sparse.BLOCK,
    )
    ref_params = list(reference.parameters())
    split = fragments.split([p.numel() for p in ref_params], count)
    contribution = Contribution(ref_params, split, diloco=True, summed=False)
    ref = OuterStep(ref_params, contribution, d, Compression(mode)) if rank == 0 else None
    epoch = 0
    for step in range(5):
        slots = split[epoch % count]
        lo, hi = outer.span(slots)

        def inner(seed: int) -> None:  # "inner steps": the same change on both, each rank on its rows
            with torch.no_grad():
                for i, (dn, p) in enumerate(zip(noise(layout.shapes, seed), site.parameters(), strict=True)):
                    local_of(p).add_(rows(dn, layout, i, rank))
                    if ref is not None:
                        ref_params[i].add_(dn)

        inner(step)
        wire = WireBuffer(hi - lo) if rank == 0 else None
        outer.contribute(slots, wire, keep=overlap)
        committed = step != 2  # the third round aborts
        if ref is not None:
            assert wire is not None
            contribution.fit(epoch)
            assert contribution.slots == slots and contribution.start() == lo
            ref.pseudo_gradients()
            buf = contribution.buffer
            assert buf.flat is not None
            own = [v.clone() for v in buf.views]  # (the round runner keeps it aside before the fold)
            saved = ref.feedback.fold(buf, lo) if ref.feedback is not None else None
            assert torch.equal(wire.flat.view(torch.int32), buf.flat.view(torch.int32)), (
                f"wire differs at {step}"
            )
            other = torch.randn(hi - lo, generator=torch.Generator().manual_seed(100 + step))
            avg = (buf.flat + other) / 2  # "the round": another member's values, averaged
            wire.flat.copy_(avg)
            buf.flat.copy_(avg)
            if ref.feedback is not None and saved is not None:
                if committed:
                    ref.feedback.forget(saved)
                else:
                    ref.feedback.unfold(saved)
        if overlap:
            inner(50 + step)  # computed while the round runs
        if ref is not None:
            if committed and overlap:
                kept = dict(zip(contribution.slots, own, strict=True))

                def progress(i: int, kept: dict[int, torch.Tensor] = kept) -> None:
                    ref_params[i].detach().sub_(ref.global_params[i]).add_(kept[i])

                def on_top(i: int) -> None:
                    ref_params[i].detach().add_(ref.global_params[i])

                ref.step(progress, on_top)
            elif committed:
                ref.step(after=ref.reset_local)
        outer.land(slots, wire, committed=committed)
        epoch += committed
        if wire is not None:
            wire.close()
        got = [full(g) for g in outer.global_params]
        got_local = [full(p.detach()) for p in site.parameters()]
        got_e = [full(e) for e in outer.residual]
        if ref is not None:
            for a, b in zip(got, ref.global_params, strict=True):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"global differs at {step}"
            for a, b in zip(got_local, ref_params, strict=True):
                assert torch.equal(a.view(torch.int32), b.detach().view(torch.int32)), (
                    f"local differs at {step}"
                )
            if ref.feedback is not None:
                flat = torch.cat([e.reshape(-1) for e in got_e])
                assert torch.equal(flat, ref.feedback.residual), f"residual differs at {step}"
                assert flat.abs().sum() > 0


def test_a_sites_wire_vector_and_outer_steps_are_an_unsharded_peers_bits(tmp_path: Path) -> None:
    """3 ranks: uneven chunks, and a rank that holds no row of a parameter."""
    out = tmp_path / "ok"
    launch.spawn(check, 3, str(out), timeout=120)
    assert out.read_text() == "ok"
