"""A site's checkpoints: every rank writes and reads its own shards (``torch.distributed.checkpoint``).

Theory of operation. A checkpoint of step s is a folder ``step-<s>`` that DCP fills: each rank writes
the shards it holds of the model (``get_model_state_dict``), of the inner optimizer's state
(``get_optimizer_state_dict``) and of DiLoCo's outer state (``outer.ShardedOuter.state_dict``: global
parameters, momentum, error feedback, DTensors placed like the model), and DCP's metadata records every
shard's place in the full tensors. Reading it back, DCP hands each rank the pieces of the full tensors
its own shards cover, whatever N wrote them: a site resumes with a different number of ranks. No rank
ever holds a full tensor, on writing or on reading.

Across hosts (``torchrun``) the folder must be one that every host sees (a shared file system): rank 0
writes ``site.json`` and DCP's metadata where the other hosts' ranks must read them. :func:`check_shared`
finds out at start, with every rank, and refuses a folder some rank does not see, by name, rather than
let the first resume fail on another host.

A checkpoint counts once it is whole: after every rank's writes returned, rank 0 writes ``site.json``
(the step, the ranks that wrote it, the parameters' names and shapes) last. :func:`latest` takes the
newest folder that has it; a site killed mid-write leaves a folder without one, which is ignored.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ...errors import ConfigError
from .layout import WireLayout
from .outer import ShardedOuter

MARK = "site.json"
_STEP = re.compile(r"step-(\d+)")
PROBE = ".shared-by-the-ranks"


def check_shared(folder: Path, device: str = "cpu") -> None:
    """Collective: ConfigError on every rank unless every rank sees the file rank 0 writes in ``folder``
    (a token drawn now, so an old probe left there by another site or run counts for nothing); the
    error names the ranks that did not. ``device``: where the group's collectives run (a GPU with
    NCCL)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    probe = Path(folder) / PROBE
    token = torch.zeros(2, dtype=torch.int64, device=device)
    if rank == 0:
        Path(folder).mkdir(parents=True, exist_ok=True)
        drawn = secrets.randbits(62)
        tmp = probe.with_suffix(".tmp")
        tmp.write_text(str(drawn))
        tmp.replace(probe)
        token[0] = drawn
    dist.broadcast(token, src=0)
    try:
        seen = probe.read_text().strip() == str(int(token[0]))
    except OSError:
        seen = False
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([int(seen)], dtype=torch.int64, device=device))
    dist.barrier()  # (every rank has read it before rank 0 removes it)
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, f in enumerate(flags) if not int(f)]
    if blind:
        raise ConfigError(
            f"the site's checkpoint folder {folder} is not shared by its hosts: rank(s) "
            + ", ".join(map(str, blind))
            + " cannot see the file rank 0 wrote there (rank 0 writes each checkpoint's metadata, every"
            " rank reads it on resuming): give every host the same --data-dir on a shared file system"
        )


def save(
    folder: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: ShardedOuter | None,
    layout: WireLayout,
) -> Path:
    """Collective: step ``step``'s checkpoint of every rank's shards, under ``folder``; returns its path."""
    where = Path(folder) / f"step-{step}"
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "outer": outer.state_dict() if outer is not None else {},
    }
    dcp_save(state, checkpoint_id=str(where))
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {
            "step": step,
            "ranks": dist.get_world_size(),
            "params": [[n, list(s)] for n, s in zip(layout.names, layout.shapes, strict=True)],
        }
        tmp = where / (MARK + ".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(where / MARK)
    dist.barrier()
    return where


def latest(folder: Path) -> tuple[int, Path] | None:
    """The newest whole checkpoint under ``folder`` (its step and path), if any."""
    best: tuple[int, Path] | None = None
    for p in Path(folder).glob("step-*"):
        m = _STEP.fullmatch(p.name)
        if m and (p / MARK).is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    return best


def load(
    where: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: ShardedOuter | None,
    layout: WireLayout,
) -> int:
    """Collective: every rank reads its shards of the checkpoint at ``where`` (written by any number of
    ranks); returns its step. ValueError (before anything changed) if it is another model's."""
    meta = json.loads((Path(where) / MARK).read_text())
    mine = [[n, list(s)] for n, s in zip(layout.names, layout.shapes, strict=True)]
    if meta.get("params") != mine:
        raise ValueError(f"the checkpoint at {where} holds other parameters than this model's")
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "outer": outer.state_dict() if outer is not None else {},
    }
    dcp_load(state, checkpoint_id=str(where))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(meta["step"])
