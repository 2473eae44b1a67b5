"""Model-sized buffers of the collaborative optimizer: one flat tensor, a view per parameter.

Why flat: an averaging round sends a single contiguous float32 CPU tensor from where it lies and reduces
its own partition right where the mean goes (see ``averaging.averager``); a list of tensors it must first
copy into a flat buffer of its own, a model-sized copy per round. So the gradient accumulator (sync) and
the pseudo-gradient (DiLoCo) are one flat tensor whenever the parameters share a dtype and a device, and
each parameter sees its part through a view.

Why views: in sync mode the views can be the parameters' ``.grad`` themselves. A backward pass then adds
its gradients straight into the accumulator (autograd accumulates into an existing ``.grad`` in place),
and no separate gradient tensor exists besides it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ParamBuffer:
    """Zeros shaped like ``params``: ``views[i]`` is parameter i's part of ``flat`` (``flat`` is None when
    the parameters have different dtypes or devices: then the views are separate tensors)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) == 1 and len(devices) == 1 and params:
            self.flat: torch.Tensor | None = torch.zeros(
                sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
            )
            self.views: list[torch.Tensor] = []
            off = 0
            for p in params:
                self.views.append(self.flat[off : off + p.numel()].view(p.shape))
                off += p.numel()
        else:
            self.flat = None
            self.views = [torch.zeros_like(p) for p in params]

    @property
    def sendable(self) -> bool:
        """Whether a round can average ``flat`` in place (one contiguous float32 tensor in host memory)."""
        return self.flat is not None and self.flat.dtype == torch.float32 and self.flat.device.type == "cpu"

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What an averaging round takes: the flat tensor alone when there is one."""
        return [self.flat] if self.flat is not None else self.views

    def zero_(self) -> None:
        for t in self.tensors:
            t.zero_()

    def div_(self, x: float) -> None:
        for t in self.tensors:
            t.div_(x)

    def add_(self, other: ParamBuffer, alpha: float = 1.0) -> None:
        for a, b in zip(self.tensors, other.tensors, strict=True):
            a.add_(b, alpha=alpha)
