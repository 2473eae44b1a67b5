"""Model-sized buffers of the collaborative optimizer: one flat tensor, a view per parameter.

Why flat: an averaging round sends a single contiguous float32 CPU tensor from where it lies and reduces
its own partition right where the mean goes (see ``averaging.averager``); a list of tensors it must first
copy into a flat buffer of its own, a model-sized copy per round. So the gradient accumulator (sync) and
the pseudo-gradient (DiLoCo) are one flat tensor whenever the parameters share a dtype and a device, and
each parameter sees its part through a view.

Why views: in sync mode the views can be the parameters' ``.grad`` themselves. A backward pass then adds
its gradients straight into the accumulator (autograd accumulates into an existing ``.grad`` in place),
and no separate gradient tensor exists besides it.

:class:`Contribution` owns the buffer the next round takes (and the spare and relaying ones around it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import trio


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


class Contribution:
    """What this peer hands to its next round, and the buffers around it.

    ``buffer`` holds the gradient sums (sync; with ``summed`` its views are the parameters' ``.grad``) or
    the pseudo-gradients (DiLoCo) of the parameters of the current step's fragment (``slots``: streaming
    DiLoCo averages one fragment of the parameters a step, see ``fragments``; all of them otherwise). A
    round that averaged a buffer in place may still relay averages from it to slower members after this
    peer applied them (``relay``): the next contribution then goes into a new buffer. Sync mode swaps in
    a ``spare`` accumulator when it hands its gradients to a round, and takes it back after.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        fragments: list[range],
        *,
        diloco: bool,
        summed: bool,
        make_buffer: Callable[[Sequence[torch.Tensor]], ParamBuffer] = ParamBuffer,
    ) -> None:
        """``make_buffer``: a buffer shaped like the parameters it is given (a sharded site's rank 0
        gives one in a mapped file, see ``site.wire``)."""
        self.params = list(params)
        self.make_buffer = make_buffer
        self.fragments = fragments
        self.diloco, self.summed = diloco, summed
        sizes = [p.numel() for p in self.params]
        self.starts = [sum(sizes[: f.start]) for f in fragments]  # each fragment's first element
        self.slots = fragments[0]  # the parameters ``buffer`` holds: the current step's fragment
        self.buffer = self.make_buffer(self.slot_params())
        self._spare: ParamBuffer | None = None  # sync: the accumulator the last round gave back
        # each set once its reader stopped reading ``buffer`` (the last round relaying averages from it,
        # the keeping of its result for peers behind: see ``SharedState.keep_result``)
        self._readers: list[trio.Event] = []
        if summed:
            self.attach()

    def slot_params(self) -> list[torch.Tensor]:
        return [self.params[i] for i in self.slots]

    def start(self) -> int:
        """Where the current fragment's values begin in the flat order of all parameters."""
        return self.starts[self.fragments.index(self.slots)]

    def attach(self) -> None:
        """Summed gradients: the accumulator's views become the parameters' .grad."""
        for p, acc in zip(self.params, self.buffer.views, strict=True):
            p.grad = acc

    def fit(self, epoch: int) -> None:
        """Streaming DiLoCo: ``buffer`` holds the fragment of step ``epoch`` (a new buffer when the step
        moved to another: the last round may still relay from the one it had)."""
        slots = self.fragments[epoch % len(self.fragments)]
        if slots != self.slots:
            self.slots = slots
            self.buffer = self.make_buffer(self.slot_params())
            self._readers = []

    def unrelayed(self) -> ParamBuffer:
        """The buffer to write the next pseudo-gradient into: a new one if the last round may still relay
        averages from the current one to slower members."""
        if any(not r.is_set() for r in self._readers):
            self.buffer = self.make_buffer(self.slot_params())
        self._readers = []
        return self.buffer

    def take(self) -> ParamBuffer:
        """DiLoCo, a round joined ahead while a replay is in flight: the pseudo-gradient in ``buffer``
        leaves with the round, and the replay writes the results it applies into a new one meanwhile
        (it would overwrite what the round sends). The round's landing puts its buffer back (``adopt``)."""
        tensors = self.buffer
        self.buffer = self.make_buffer(self.slot_params())
        self._readers = []
        return tensors

    def adopt(self, tensors: ParamBuffer) -> None:
        """A round's buffer, holding the averages it committed, becomes ``buffer`` again: the outer step
        applies ``buffer`` (see ``take``)."""
        if tensors is not self.buffer:
            self.buffer = tensors
            self._readers = []

    def relay(self, retired: trio.Event) -> None:
        """The committed round may relay from ``buffer`` until ``retired`` is set."""
        self.reading(retired)

    def reading(self, done: trio.Event) -> None:
        """Something reads ``buffer`` until ``done`` is set: the next pseudo-gradient goes into a new
        buffer if it is not set by then (:meth:`unrelayed`)."""
        self._readers = [r for r in self._readers if not r.is_set()] + [done]

    def after_abort(self, tensors: ParamBuffer) -> None:
        """DiLoCo: an aborted in-place round may still relay the averages it holds to members that
        commit: its buffer is left to it, and the next pseudo-gradient goes into a new one."""
        if self.diloco and tensors.sendable and tensors is self.buffer:
            self.buffer = self.make_buffer(self.slot_params())
            self._readers = []

    def hand_over(self) -> ParamBuffer:
        """Sync: the accumulated gradients leave for a round; a fresh accumulator (the spare the last
        round gave back, if any) takes the batches computed meanwhile."""
        tensors = self.buffer
        self.buffer = self._spare or self.make_buffer(self.params)  # (a spare only when not in place)
        self._spare = None
        if self.summed:
            self.attach()
        return tensors

    def keep_spare(self, tensors: ParamBuffer) -> None:
        """Sync: a landed round's buffer (zeroed) is the next hand-over's fresh accumulator."""
        self._spare = tensors
