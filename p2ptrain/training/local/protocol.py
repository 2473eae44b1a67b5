"""The protocol every rank of a local group speaks: rank 0's commands, the store's keys, the collectives.

Rank 0 (:class:`~.group.LocalGroup`) writes numbered commands to its store (``ctrl/0``, ``ctrl/1``, ...,
each a set of the flags below); the workers (:mod:`.worker`) obey them in order. The tensors travel in
collectives over flat buffers (:class:`FlatSpace`): :func:`reduce_gradients` and
:func:`broadcast_tensors` are run by every rank, rank 0 included, with the same arguments in the same
order: that is what keeps the ranks in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from ..state.codec import digest as state_digest

# Command flags, written by rank 0 as the value of ctrl/<seq>; a worker handles them in this order.
PARAMS = 1  # rank 0 broadcasts its parameters (and floating-point buffers)
DIGEST = 2  # each worker writes a digest of its parameters to digest/<seq>/<rank>
STOP = 4  # leave the group and exit
COMPUTE = 8  # compute the next batch and join the gradient all-reduce

GO_KEY = "go"  # rank 0 writes "run" (join the process group) or "stop" once every worker is ready
BUCKET_BYTES = 64 << 20  # gradients and parameters travel in collectives of at most this size

Wait = Callable[[Any], None]  # waits for a collective's Work to finish (or raises)


def ctrl_key(seq: int) -> str:
    return f"ctrl/{seq}"


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def digest_key(seq: int, rank: int) -> str:
    return f"digest/{seq}/{rank}"


def backend_for(devices: Sequence[str]) -> str:
    """NCCL for CUDA devices, gloo for CPU ones; a mix is refused."""
    kinds = {torch.device(d).type for d in devices}
    if kinds == {"cpu"}:
        return "gloo"
    if kinds == {"cuda"}:
        return "nccl"
    raise ConfigError(f"local devices must be all CPU or all CUDA, not {', '.join(devices)}")


# ---- what both sides do: flat buffers, the gradient all-reduce, the parameter broadcast -------------


def sync_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What rank 0 gives its workers: every parameter and every floating-point buffer (BatchNorm's
    running statistics, say). Integer and boolean buffers (masks, counters) are left alone."""
    return list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]


def grad_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def parameter_digest(model: torch.nn.Module) -> bytes:
    """A digest of the tensors a LocalGroup keeps equal on every rank (see :func:`sync_tensors`)."""
    named: dict[str, torch.Tensor] = dict(model.named_parameters())
    named.update((f"buffer:{n}", b) for n, b in model.named_buffers() if b.is_floating_point())
    return state_digest(named)


class FlatSpace:
    """Tensors laid end to end in one buffer per dtype on one device, so a collective moves them all in
    a few big calls instead of one per tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        sizes: dict[torch.dtype, int] = {}
        self.slots: list[tuple[torch.dtype, int, int]] = []
        for t in tensors:
            offset = sizes.get(t.dtype, 0)
            self.slots.append((t.dtype, offset, t.numel()))
            sizes[t.dtype] = offset + t.numel()
        self.buffers = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}

    def view(self, i: int) -> torch.Tensor:
        dtype, offset, n = self.slots[i]
        return self.buffers[dtype][offset : offset + n]

    def buckets(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for buf in self.buffers.values():
            step = max(1, BUCKET_BYTES // buf.element_size())
            out.extend(buf[i : i + step] for i in range(0, buf.numel(), step))
        return out


@dataclass(frozen=True)
class Reduced:
    """One batch over the whole local group."""

    samples: int  # on all ranks together
    loss: float  # the sample-weighted mean over the ranks
    nonfinite: int  # ranks whose loss was NaN or infinite: then no gradient was reduced


def reduce_gradients(
    params: Sequence[torch.Tensor],
    space: FlatSpace,
    loss: float,
    samples: int,
    device: torch.device,
    wait: Wait,
) -> Reduced:
    """All-reduce the sample counts, then the gradients scaled by this rank's share of the samples, into
    ``space`` (the callers' gradients are read, never written: see :func:`unpack_gradients`)."""
    finite = math.isfinite(loss)
    stats = [float(samples), loss * samples if finite else 0.0, 0.0 if finite else 1.0]
    counts = torch.tensor(stats, dtype=torch.float64, device=device)
    wait(dist.all_reduce(counts, async_op=True))
    total, loss_sum, nonfinite = counts.tolist()
    reduced = Reduced(round(total), loss_sum / total if total > 0 else 0.0, round(nonfinite))
    if nonfinite or total <= 0:
        return reduced  # every rank sees the same counts, so every rank skips the same way
    with torch.no_grad():
        for i, p in enumerate(params):
            if p.grad is None:
                space.view(i).zero_()
            else:
                space.view(i).copy_(p.grad.reshape(-1))
        for buf in space.buffers.values():
            buf.mul_(samples / total)
    for work in [dist.all_reduce(b, async_op=True) for b in space.buckets()]:
        wait(work)
    return reduced


def unpack_gradients(params: Sequence[torch.Tensor], space: FlatSpace) -> None:
    with torch.no_grad():
        for i, p in enumerate(params):
            mean = space.view(i).view_as(p)
            if p.grad is not None:
                p.grad.copy_(mean)
            elif bool(mean.any()):  # a parameter unused here but used on another rank
                p.grad = mean.clone()


def broadcast_tensors(tensors: Sequence[torch.Tensor], space: FlatSpace, wait: Wait, *, root: bool) -> None:
    """Rank 0's ``tensors`` into every rank's ``tensors``."""
    with torch.no_grad():
        if root:
            for i, t in enumerate(tensors):
                space.view(i).copy_(t.reshape(-1))
        for work in [dist.broadcast(b, src=0, async_op=True) for b in space.buckets()]:
            wait(work)
        if not root:
            for i, t in enumerate(tensors):
                t.copy_(space.view(i).view_as(t))
