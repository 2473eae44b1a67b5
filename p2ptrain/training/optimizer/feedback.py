"""Error feedback for DiLoCo's top-k rounds: what a round leaves out is sent in later rounds.

Theory of operation
-------------------
A top-k round (``averaging.compression = "topk..."``) sends, of each block of a peer's pseudo-gradient,
the largest values at 2 or 4 bits (see ``averaging.sparse``). Dropped alone, the rest would be lost:
most coordinates would never move. With error feedback the peer keeps a residual ``e`` (zeros at
first): at each outer round it sends ``c = C(Δ + e)`` instead of ``C(Δ)`` and keeps ``e := Δ + e - c``,
so every bit of local progress is sent eventually, late rather than never (SparseLoCo, DeMo).

``C`` is :func:`compression.roundtrip` on the whole flattened vector, on the same block grid as the
round's partitions (they start on whole blocks), so ``c`` is exactly what the round sends: re-encoding
it in the round changes nothing. (Parameters that are not float32 are sent as their dtype holds ``c``,
and the residual keeps the difference to that.)

The residual belongs to this peer's own trajectory. If the round aborts, the local parameters still
hold the progress (the next round's ``Δ`` includes it), so the residual goes back to what it was
(:meth:`ErrorFeedback.fold` returns the way back). A checkpoint keeps it; a state downloaded from
another peer does not carry it (its donor still holds and sends its own: a copy would send it twice),
and adopting another peer's state zeroes it, like the local progress it came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...averaging import sparse
from ...averaging.compression import Compression, roundtrip
from ...averaging.spill import Spilled, SpillFile
from ..state.codec import StateError
from .buffers import ParamBuffer

FEEDBACK = "feedback"
"""The residual's name among a checkpoint's extra tensors."""
PIECE = 256 * sparse.BLOCK  # elements compressed at a time: whole blocks, a small temporary


@dataclass(frozen=True)
class Saved:
    """The residual's values from ``start`` as they were before a fold (see :meth:`ErrorFeedback.unfold`)."""

    start: int
    values: Spilled | torch.Tensor


class ErrorFeedback:
    """The residual of a peer's top-k rounds (a flat float32 CPU vector, the parameters' order)."""

    def __init__(self, params: Sequence[torch.Tensor], mode: Compression) -> None:
        if not Compression(mode).sparse:
            raise ValueError(f"error feedback is for top-k compression, not {mode}")
        self.mode = Compression(mode)
        self.residual = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)

    def fold(self, buf: ParamBuffer, start: int = 0) -> Saved:
        """``buf`` (the pseudo-gradient about to be averaged) := ``C(buf + residual)``, the values the
        round will send; the residual := what they leave out. ``start``: where ``buf``'s values begin
        in the flat order of all parameters (streaming DiLoCo averages one fragment of them). Returns
        the residual as it was before (in a spill file, else in memory), for :meth:`unfold` if the
        round aborts."""
        residual = self._part(buf, start)
        before = self._keep(start, residual)
        if buf.sendable:
            assert buf.flat is not None
            self._fold_flat(buf.flat, residual)
        else:  # on a GPU, or mixed dtypes: on a float32 copy, then back
            flat = torch.cat([v.detach().reshape(-1).to("cpu", torch.float32) for v in buf.views])
            self._fold_flat(flat, residual)
            at = 0
            for v in buf.views:
                v.copy_(flat[at : at + v.numel()].view(v.shape))
                sent = v.detach().reshape(-1).to("cpu", torch.float32)  # as its dtype holds it
                residual[at : at + v.numel()].add_(flat[at : at + v.numel()]).sub_(sent)
                at += v.numel()
        return before

    def _part(self, buf: ParamBuffer, start: int) -> torch.Tensor:
        n = sum(v.numel() for v in buf.views)
        if start < 0 or start + n > self.residual.numel():
            raise ValueError(f"values {start}..{start + n} are not within the {self.residual.numel()} kept")
        return self.residual[start : start + n]

    def _fold_flat(self, flat: torch.Tensor, residual: torch.Tensor) -> None:
        for a in range(0, flat.numel(), PIECE):
            v, e = flat[a : a + PIECE], residual[a : a + PIECE]
            v.add_(e)
            c = roundtrip(v, self.mode)
            torch.sub(v, c, out=e)
            v.copy_(c)

    def flush_into(self, buf: ParamBuffer, start: int = 0) -> None:
        """``buf += residual`` (its part from ``start``, see :meth:`fold`) and that part is zero (a step
        taken alone sends nothing)."""
        residual = self._part(buf, start)
        at = 0
        for v in buf.views:
            v.add_(residual[at : at + v.numel()].view(v.shape).to(v.device, v.dtype))
            at += v.numel()
        residual.zero_()

    @staticmethod
    def _keep(start: int, part: torch.Tensor) -> Saved:
        """The part of the residual a fold is about to change (a streaming round's fragment, not all)."""
        file = SpillFile()
        try:
            return Saved(start, file.put(part.view(torch.uint8).numpy().data))
        except OSError:  # (a full disk): in memory
            file.close()
            return Saved(start, part.clone())

    def unfold(self, before: Saved) -> None:
        """The round aborted: the residual goes back to what it was before :meth:`fold`."""
        values = before.values
        n = values.numel() if isinstance(values, torch.Tensor) else values.length // 4
        part = self.residual[before.start : before.start + n]
        if isinstance(values, torch.Tensor):
            part.copy_(values)
            return
        part.view(torch.uint8).numpy()[:] = memoryview(values.read())
        values.file.close()

    @staticmethod
    def forget(before: Saved) -> None:
        """The round committed: the way back is not needed."""
        if isinstance(before.values, Spilled):
            before.values.file.close()

    def check(self, saved: torch.Tensor) -> None:
        """StateError unless ``saved`` can be this residual (checked before a restore changes anything)."""
        if saved.shape != self.residual.shape or saved.dtype != torch.float32:
            raise StateError(
                f"the checkpoint's error feedback is {saved.dtype} {tuple(saved.shape)}, expected float32"
                f" ({self.residual.numel()},)"
            )

    def load(self, saved: torch.Tensor | None) -> None:
        """A checkpoint's residual (see :meth:`check`); None (a state from another peer, or a
        checkpoint without one): zeros."""
        if saved is None:
            self.residual.zero_()
        else:
            self.check(saved)
            self.residual.copy_(saved)
