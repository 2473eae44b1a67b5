"""A site's checkpoint (``torch.distributed.checkpoint``, every rank its own shards) written by 4 ranks
resumes on 2: the model, AdamW's moments and DiLoCo's outer state (global parameters, momentum, error
feedback) are the same full tensors after the load (gathered here, in the test only); a folder that was
never finished is not taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from p2ptrain.averaging.compression import Compression
from p2ptrain.config import DilocoSection
from p2ptrain.training.site import checkpoint, launch
from p2ptrain.training.site.layout import WireLayout
from p2ptrain.training.site.outer import ShardedOuter
from p2ptrain.training.site.pieces import PieceChannel

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)


def build(rank: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardedOuter, WireLayout]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.Linear(30, 6))
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    layout = WireLayout([n for n, _ in m.named_parameters()], [p.shape for p in m.parameters()], world)
    outer = ShardedOuter(
        list(m.parameters()), layout, PieceChannel(layout, rank), DilocoSection(), Compression("topk3-q4")
    )
    return m, opt, outer, layout


def gathered(m: torch.nn.Module, opt: torch.optim.Optimizer, outer: ShardedOuter) -> dict[str, torch.Tensor]:
    full = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v for k, v in get_model_state_dict(m, options=full).items()}
    for k, slot in get_optimizer_state_dict(m, opt, options=full)["state"].items():
        for name, v in slot.items():
            out[f"optim.{k}.{name}"] = v
    for k, v in outer.state_dict().items():
        out[f"outer.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def writer(rank: int, world: int, folder: str) -> None:
    m, opt, outer, layout = build(rank, world)
    for k in range(3):
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank * 10 + k))
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # an outer state that is not the parameters', with momentum and a residual
        for g, mo, e in zip(outer.global_params, outer.momentum, outer.residual, strict=True):
            g.add_(0.5)
            mo.add_(0.25)
            e.add_(0.125)
    checkpoint.save(Path(folder), 7, m, opt, outer, layout)
    (Path(folder) / "step-9").mkdir(exist_ok=True)  # a newer one that was never finished
    state = gathered(m, opt, outer)
    if rank == 0:
        torch.save(state, Path(folder) / "expected.pt")


def reader(rank: int, world: int, folder: str) -> None:
    m, opt, outer, layout = build(rank, world)
    found = checkpoint.latest(Path(folder))
    assert found is not None and found[0] == 7, found
    assert checkpoint.load(found[1], m, opt, outer, layout) == 7
    state = gathered(m, opt, outer)
    if rank == 0:
        expected = torch.load(Path(folder) / "expected.pt")
        assert expected.keys() == state.keys()
        for k, v in expected.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state[k])), k
        (Path(folder) / "ok").write_text("ok")


def test_a_checkpoint_written_by_4_ranks_resumes_on_2(tmp_path: Path) -> None:
    launch.spawn(writer, 4, str(tmp_path), timeout=120)
    launch.spawn(reader, 2, str(tmp_path), timeout=120)
    assert (tmp_path / "ok").read_text() == "ok"
