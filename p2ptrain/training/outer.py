"""DiLoCo's outer side: the global parameters, pseudo-gradients and the outer step.

Each peer keeps the global parameters (the last step every member agreed on) beside its local ones. At
the end of an epoch its pseudo-gradient (global minus local) goes into ``averaged``, the round averages
it, and the outer optimizer (SGD, Nesterov with ``diloco.outer_momentum``) steps the global parameters
with the average, one parameter at a time; the local parameters then restart from the new global ones.
On a CPU host with a large model the global parameters and momentum live in a file (``offheap``), so
that they cost page cache rather than resident memory. Streaming DiLoCo averages one fragment of the
parameters per step (``fragments``): ``averaged`` then holds that fragment only.

:class:`OuterSteps` is a mixin of :class:`~p2ptrain.training.collaborative.CollaborativeOptimizer`,
which owns the attributes declared below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import trio

from ..config import DilocoSection
from ..errors import ConfigError
from . import statesync
from .buffers import ParamBuffer
from .offheap import FileTensors
from .swarm_state import SwarmState


class OuterSteps(SwarmState):
    """The global parameters and DiLoCo's outer step (a mixin, over the shared state's)."""

    # Owned by CollaborativeOptimizer:
    fragments: list[range]
    _slots: range
    _param_bytes: int
    _relaying: trio.Event | None

    def _pseudo_gradients(self) -> None:
        """DiLoCo: global minus local parameters, into ``averaged`` (a new one if the last round may
        still relay averages from it to slower members)."""
        if self._relaying is not None and not self._relaying.is_set():
            self.averaged = ParamBuffer(self._slot_params())
        self._relaying = None
        with torch.no_grad():
            for d, i in zip(self.averaged.views, self._slots, strict=True):
                g = self.global_params[i]
                torch.sub(g, self.params[i].detach(), out=d)
                self._release(g)
        self._release_all()

    def _slot_params(self) -> list[torch.Tensor]:
        return [self.params[i] for i in self._slots]

    def _fit_buffer(self) -> None:
        """Streaming DiLoCo: ``averaged`` holds the fragment of the current step (a new buffer when the
        step moved to another: the last round may still relay from the one it had)."""
        slots = self.fragments[self.epoch % len(self.fragments)]
        if slots != self._slots:
            self._slots = slots
            self.averaged = ParamBuffer(self._slot_params())
            self._relaying = None

    def _after_abort(self, tensors: ParamBuffer) -> None:
        """DiLoCo: an aborted in-place round may still relay the averages it holds to members that
        commit: its buffer is left to it, and the next pseudo-gradient goes into a new one."""
        if self.diloco and tensors.sendable and tensors is self.averaged:
            self.averaged = ParamBuffer(self._slot_params())
            self._relaying = None

    def _init_outer(self, d: DilocoSection) -> None:
        """The global parameters and the outer Nesterov SGD, whose momentum buffers exist from the start
        (zeros: the first step's result is the same as from none) so that they can live in a file."""
        on_cpu = all(p.device.type == "cpu" for p in self.params)
        large = self._param_bytes >= statesync.THREAD_BYTES
        if d.outer_state == "file" and not on_cpu:
            raise ConfigError("diloco.outer_state = 'file' needs the parameters on the CPU")
        if d.outer_state == "file" or (d.outer_state == "auto" and on_cpu and large):
            n = len(self.params) if d.outer_momentum > 0 else 0
            self.outer_file = FileTensors(self.params + self.params[:n])
            self.global_params = self.outer_file.tensors[: len(self.params)]
            self.momentum = self.outer_file.tensors[len(self.params) :]
            with torch.no_grad():
                for g, p in zip(self.global_params, self.params, strict=True):
                    g.copy_(p)
            self.outer_file.release()
        else:
            self.global_params = [p.detach().clone() for p in self.params]
            if d.outer_momentum > 0:
                self.momentum = [torch.zeros_like(p) for p in self.params]
        self.outer = torch.optim.SGD(
            self.global_params, lr=d.outer_lr, momentum=d.outer_momentum, nesterov=d.outer_momentum > 0
        )
        for g, m in zip(self.global_params, self.momentum, strict=True) if self.momentum else ():
            self.outer.state[g]["momentum_buffer"] = m

    def _reset_local(self, i: int) -> None:
        """The local parameter ``i`` restarts from the new global one."""
        with torch.no_grad():
            self.params[i].copy_(self.global_params[i])

    def _release(self, *tensors: torch.Tensor) -> None:
        if self.outer_file is not None:
            self.outer_file.release(tensors)

    def _release_all(self) -> None:
        """After a pass over the file-backed outer state: a read fault also maps in the neighbouring
        pages already in the page cache (Linux's fault-around, 64 KiB), which releasing each tensor's
        own pages leaves resident; they go too."""
        if self.outer_file is not None:
            self.outer_file.release()

    def _outer_step(
        self,
        before: Callable[[int], None] | None = None,
        after: Callable[[int], None] | None = None,
    ) -> None:
        """The outer step of the global parameters with the averaged pseudo-gradients, one parameter at a
        time: ``before(i)`` runs ahead of parameter i's update, ``after(i)`` right after it (the local
        parameters' side), then a file-backed outer state's pages of parameter i leave the resident set.
        (SGD updates only the parameters that have a gradient.) Streaming: the current fragment's."""
        for d, i in zip(self.averaged.views, self._slots, strict=True):
            g = self.global_params[i]
            if before is not None:
                before(i)
            g.grad = d
            self.outer.step()
            g.grad = None
            if after is not None:
                after(i)
            self._release(g, *self.momentum[i : i + 1])
        self._release_all()
