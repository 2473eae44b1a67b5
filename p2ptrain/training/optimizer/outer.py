"""DiLoCo's outer side: the global parameters, pseudo-gradients, the outer step and top-k error feedback.

Theory of operation. Each peer keeps the global parameters (the last step every member agreed on) beside
its local ones. At the end of an epoch its pseudo-gradient (global minus local) goes into the
contribution's buffer, the round averages it, and the outer optimizer (SGD, Nesterov with
``diloco.outer_momentum``) steps the global parameters with the average, one parameter at a time; the
local parameters then restart from the new global ones. On a CPU host with a large model the global
parameters and momentum live in a file (``state.file_tensors``), so that they cost page cache rather
than resident memory. Streaming DiLoCo averages one fragment of the parameters per step (``fragments``):
the buffer then holds that fragment only. Top-k rounds fold the error feedback (``feedback``) into what
they send, and keep the residual only if the round committed.

:class:`OuterStep` owns all of it; only a DiLoCo run has one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import trio

from ...averaging.compression import Compression
from ...averaging.spill import Spilled, SpillFile
from ...config import DilocoSection
from ...errors import ConfigError
from ..state import serve
from ..state.codec import raw_bytes
from ..state.file_tensors import FileTensors
from .buffers import Contribution, ParamBuffer
from .feedback import ErrorFeedback, Saved

log = logging.getLogger(__name__)


class OuterStep:
    """The global parameters, the outer Nesterov SGD over them, and top-k's error feedback."""

    # A pseudo-gradient may leave in a buffer of its own (``Contribution.take``) while a replay applies
    # results in another: a peer joined ahead hands its work over as its group forms (``rounds``).
    hands_over_ahead = True
    # DiLoCo with overlap: the pseudo-gradient is taken at once as the group forms, whatever the training
    # loop is doing (a pass over the local parameters, between two inner steps). An outer step whose
    # pseudo-gradient is a collective of several processes (a site's ranks) is handed over by the training
    # loop itself, between two batches (``RoundRunner.hand_over``).
    hands_over_between_batches = False

    def __init__(
        self,
        params: list[torch.Tensor],
        contribution: Contribution,
        d: DilocoSection,
        compression: Compression,
    ) -> None:
        """The global parameters start as copies of ``params``; the momentum buffers exist from the start
        (zeros: the first step's result is the same as from none) so that they can live in a file."""
        self.params, self.contribution = params, contribution
        self.param_bytes = sum(p.numel() * p.element_size() for p in params)
        self.file: FileTensors | None = None
        self.momentum: list[torch.Tensor] = []
        on_cpu = all(p.device.type == "cpu" for p in params)
        large = self.param_bytes >= serve.THREAD_BYTES
        if d.outer_state == "file" and not on_cpu:
            raise ConfigError("diloco.outer_state = 'file' needs the parameters on the CPU")
        if d.outer_state == "file" or (d.outer_state == "auto" and on_cpu and large):
            n = len(params) if d.outer_momentum > 0 else 0
            self.file = FileTensors(params + params[:n])
            self.global_params = self.file.tensors[: len(params)]
            self.momentum = self.file.tensors[len(params) :]
            with torch.no_grad():
                for g, p in zip(self.global_params, params, strict=True):
                    g.copy_(p)
            self.file.release()
        else:
            self.global_params = [p.detach().clone() for p in params]
            if d.outer_momentum > 0:
                self.momentum = [torch.zeros_like(p) for p in params]
        self.sgd = torch.optim.SGD(
            self.global_params, lr=d.outer_lr, momentum=d.outer_momentum, nesterov=d.outer_momentum > 0
        )
        for g, m in zip(self.global_params, self.momentum, strict=True) if self.momentum else ():
            self.sgd.state[g]["momentum_buffer"] = m
        self.feedback = ErrorFeedback(params, compression) if compression.sparse else None

    def pseudo_gradients(self) -> None:
        """Global minus local parameters, into the contribution's buffer (a new one if the last round
        may still relay averages from it to slower members)."""
        buffer = self.contribution.unrelayed()
        with torch.no_grad():
            for d, i in zip(buffer.views, self.contribution.slots, strict=True):
                g = self.global_params[i]
                torch.sub(g, self.params[i].detach(), out=d)
                self._release(g)
        self.release()

    def step(
        self,
        before: Callable[[int], None] | None = None,
        after: Callable[[int], None] | None = None,
    ) -> None:
        """The outer step of the global parameters with the averaged pseudo-gradients, one parameter at a
        time: ``before(i)`` runs ahead of parameter i's update, ``after(i)`` right after it (the local
        parameters' side), then a file-backed outer state's pages of parameter i leave the resident set.
        (SGD updates only the parameters that have a gradient.) Streaming: the current fragment's."""
        for d, i in zip(self.contribution.buffer.views, self.contribution.slots, strict=True):
            g = self.global_params[i]
            if before is not None:
                before(i)
            g.grad = d
            self.sgd.step()
            g.grad = None
            if after is not None:
                after(i)
            self._release(g, *self.momentum[i : i + 1])
        self.release()

    def land_on_top(self, own: list[Spilled | torch.Tensor]) -> None:
        """DiLoCo with overlap, a committed round: the outer step (see :meth:`step`), and each local
        parameter restarts from the new global one with the progress made since the handoff on top:
        local now - (old global - ``own``), ``own`` being the pseudo-gradient as handed over, kept aside
        (:meth:`keep_aside`), in the order of the contribution's slots."""
        kept = dict(zip(self.contribution.slots, own, strict=True))
        params, global_params = self.params, self.global_params

        def progress(i: int) -> None:
            p, g, h = params[i], global_params[i], kept[i]
            values = h if isinstance(h, torch.Tensor) else torch.frombuffer(h.read(), dtype=p.dtype)
            with torch.no_grad():
                p.sub_(g).add_(values.view(p.shape).to(p.device))

        def on_top(i: int) -> None:
            with torch.no_grad():
                params[i].add_(global_params[i])

        self.step(progress, on_top)

    async def keep_aside(self, buffer: ParamBuffer) -> list[Spilled | torch.Tensor]:
        """DiLoCo with overlap: the pseudo-gradient in ``buffer`` (as handed over) in a spill file (a
        worker thread's job when large), for :meth:`land_on_top`: a model-sized copy that the landing
        reads once, so it need not stay in memory meanwhile (in memory if the file cannot be written: a
        full disk)."""
        file = SpillFile()

        def write() -> list[Spilled | torch.Tensor]:
            try:
                return [file.put(raw_bytes(v)) for v in buffer.views]
            except OSError as e:
                log.warning("cannot spill the pseudo-gradient (%s): keeping a copy in memory", e)
                file.close()
                return [v.detach().clone() for v in buffer.views]

        if self.param_bytes < serve.THREAD_BYTES:
            return write()
        return await trio.to_thread.run_sync(write)

    def reset_local(self, i: int) -> None:
        """The local parameter ``i`` restarts from the new global one."""
        with torch.no_grad():
            self.params[i].copy_(self.global_params[i])

    def _release(self, *tensors: torch.Tensor) -> None:
        if self.file is not None:
            self.file.release(tensors)

    def release(self) -> None:
        """A file-backed outer state: drop the pages this process touched (see ``state.file_tensors``).
        After a pass over it, a read fault also mapped in the neighbouring pages already in the page
        cache (Linux's fault-around, 64 KiB), which releasing each tensor's own pages leaves resident."""
        if self.file is not None:
            self.file.release()

    def rehome_momentum(self) -> None:
        """After the outer optimizer loaded a state: its momentum goes back into this peer's own buffers
        (file-backed ones stay file-backed; a state without momentum, an older format's first step,
        means zeros), and what the restore touched leaves the resident set."""
        with torch.no_grad():
            for g, m in zip(self.global_params, self.momentum, strict=True) if self.momentum else ():
                slot = self.sgd.state[g]
                loaded = slot.get("momentum_buffer")
                if loaded is None:
                    m.zero_()
                elif loaded is not m:
                    m.copy_(loaded)
                slot["momentum_buffer"] = m
        self.release()

    # ---- top-k rounds' error feedback ----

    async def fold(self, buffer: ParamBuffer) -> Saved | None:
        """Top-k rounds: ``buffer`` becomes what the round sends, with the error feedback (see
        ``feedback``); returns the residual as it was (None without top-k)."""
        if self.feedback is None:
            return None
        start = self.contribution.start()
        if self.param_bytes < serve.THREAD_BYTES:
            return self.feedback.fold(buffer, start)
        return await trio.to_thread.run_sync(self.feedback.fold, buffer, start)

    def unfold(self, before: Saved | None, *, committed: bool) -> None:
        """After a top-k round: the residual stays if it committed, else goes back to ``before``."""
        if self.feedback is None or before is None:
            return
        if committed:
            self.feedback.forget(before)
        else:
            self.feedback.unfold(before)

    def flush_feedback(self) -> None:
        """A step alone: nothing to send, so what earlier rounds left out goes in whole."""
        if self.feedback is not None:
            self.feedback.flush_into(self.contribution.buffer, self.contribution.start())
