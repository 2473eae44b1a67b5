"""DiLoCo's outer side on a site: the global parameters, outer momentum and error feedback, sharded.

Theory of operation. An unsharded peer keeps the outer state beside its parameters (``optimizer.outer``):
global parameters, Nesterov momentum and, for top-k rounds, the error-feedback residual. On a site every
rank keeps exactly its FSDP2 shard of each of them (DTensors placed like the model's parameters, so that
``torch.distributed.checkpoint`` saves and reshards them like the model). An outer round is two
collectives of the site, called by every rank in the same order:

- :meth:`ShardedOuter.contribute` streams the pseudo-gradient (global minus local) of the round's
  parameters into rank 0's wire buffer, piece by piece (``pieces``). With top-k, each owner sends
  ``Δ + e``; rank 0 compresses the piece (:func:`compression.roundtrip`, the same block grid an
  unsharded peer's ``feedback.fold`` uses: pieces of ``feedback.PIECE`` elements counted from the span's
  start), writes what the round will send, and sends it back; each owner keeps ``e := Δ + e - c``.
- :meth:`ShardedOuter.land` after the round: if it committed, rank 0 scatters the averaged pieces, each
  rank steps its shard of the global parameters with the same SGD (Nesterov) an unsharded peer uses,
  and its local shard restarts from them; if it aborted, each rank puts its residual back as it was, and
  nothing else changed (the work is still in the local parameters).

Invariant (tested against ``optimizer.outer.OuterStep``): for any N, the wire vector equals an unsharded
peer's contribution bit for bit given the same state, and so do the global parameters after the step,
because every value is computed by the same elementwise operations on the same inputs, only on a
different rank. No rank holds more of the model than its shards plus a piece: shard-sized buffers for
the average, a piece in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...averaging import sparse
from ...averaging.compression import Compression, roundtrip
from ...averaging.spill import Spilled, SpillFile
from ...config import DilocoSection
from ..optimizer.feedback import PIECE
from .layout import Run, WireLayout
from .pieces import PieceChannel
from .wire import WireBuffer


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor sharing its storage); a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    out = t.to_local() if isinstance(t, DTensor) else t
    return out.detach()


class ShardedOuter:
    """One rank's shards of DiLoCo's outer state, and the site's outer rounds over them."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: WireLayout,
        channel: PieceChannel,
        d: DilocoSection,
        compression: Compression,
        *,
        piece: int = PIECE,
    ) -> None:
        """``params``: the FSDP2 model's trainable parameters (DTensors), in ``named_parameters`` order.
        ``piece``: the elements moved at a time (whole top-k blocks: the fold's grid counts from each
        piece's start)."""
        if piece < 1 or piece % sparse.BLOCK:
            raise ValueError(f"a piece is a positive multiple of {sparse.BLOCK} elements (top-k's block)")
        self.params, self.layout, self.channel, self.piece = list(params), layout, channel, piece
        self.rank = channel.rank
        for n, p in zip(layout.names, self.params, strict=True):
            if p.dtype != torch.float32:
                raise ValueError(
                    f"parameter {n} is {p.dtype}: a site keeps float32 parameters (the wire's type; use"
                    " FSDP2's MixedPrecisionPolicy for lower-precision compute)"
                )
        layout.check_local(self.rank, self.locals())
        self.mode = Compression(compression)
        with torch.no_grad():
            self.global_params = [p.detach().clone() for p in self.params]
            self.momentum = [torch.zeros_like(g) for g in self.global_params] if d.outer_momentum > 0 else []
            self.residual = [torch.zeros_like(g) for g in self.global_params] if self.mode.sparse else []
        self._g = [local_of(g) for g in self.global_params]
        self._m = [local_of(m) for m in self.momentum]
        self._e = [local_of(e) for e in self.residual]
        self.sgd = torch.optim.SGD(
            self._g, lr=d.outer_lr, momentum=d.outer_momentum, nesterov=d.outer_momentum > 0
        )
        for g, m in zip(self._g, self._m, strict=True):
            self.sgd.state[g]["momentum_buffer"] = m
        self._saved: list[tuple[int, Spilled]] = []  # residual shards before a top-k round (for an abort)
        self._own: dict[int, Spilled | torch.Tensor] = {}  # overlap: pseudo-gradient shards at the handoff

    def locals(self) -> list[torch.Tensor]:
        """This rank's shards of the local (trained) parameters, read afresh (FSDP2 may swap them)."""
        return [local_of(p) for p in self.params]

    def span(self, params: range) -> tuple[int, int]:
        """The flat elements of parameters ``params`` (a streaming DiLoCo fragment; all of them)."""
        return self.layout.offsets[params.start], self.layout.offsets[params.stop]

    # ---- the round ----

    def _delta(self, run: Run, locals_: list[torch.Tensor]) -> torch.Tensor:
        g = self._g[run.param].view(-1)[run.at : run.at + run.size]
        p = locals_[run.param].view(-1)[run.at : run.at + run.size]
        d = torch.sub(g, p)
        if self._e:
            d.add_(self._e[run.param].view(-1)[run.at : run.at + run.size])
        return d

    def contribute(
        self, params: range, wire: WireBuffer | None, *, keep: bool = False, alone: bool = False
    ) -> None:
        """Collective: the pseudo-gradient of ``params`` (error feedback folded in) into rank 0's
        ``wire`` (the span's size; None on the other ranks). ``keep`` (DiLoCo with overlap: compute goes
        on during the round): every rank keeps its shard of the pseudo-gradient aside in a spill file, so
        that :meth:`land` can put the progress made meanwhile on top of the new global parameters.
        ``alone`` (a step alone: nothing goes on the wire): what earlier rounds left out goes in whole,
        uncompressed, and the residual becomes zero (an unsharded peer's ``flush_into``); land it
        committed."""
        lo, hi = self.span(params)
        if (wire is not None) != (self.rank == 0) or (wire is not None and wire.numel != hi - lo):
            raise ValueError("rank 0 alone contributes into a wire buffer of the span's size")
        locals_ = self.locals()
        self._forget_own()
        if keep:
            file = SpillFile()
            with torch.no_grad():
                for i in params:
                    d = torch.sub(self._g[i], locals_[i])
                    self._own[i] = file.put(d.cpu().view(torch.uint8).numpy().data) if d.numel() else d
        self._save_residual(params)
        for a, b in self.layout.pieces(lo, hi, self.piece):
            piece = wire.piece(a - lo, b - lo) if wire is not None else None
            self.channel.gather(a, b, lambda run: self._delta(run, locals_), piece)
            if self._e and not alone:
                if piece is not None:
                    piece.copy_(roundtrip(piece, self.mode))

                def keep_residual(run: Run, c: torch.Tensor) -> None:
                    e = self._e[run.param].view(-1)[run.at : run.at + run.size]
                    e.copy_(self._delta(run, locals_) - c.to(e.device))

                self.channel.scatter(a, b, piece, keep_residual)
            if wire is not None:
                wire.release(a - lo, b - lo)
        if alone and self._e:
            self._forget_residual()
            with torch.no_grad():
                for i in params:
                    self._e[i].zero_()

    def land(self, params: range, wire: WireBuffer | None, *, committed: bool, carry: bool = False) -> None:
        """Collective, after the round: committed, the average in rank 0's ``wire`` steps every rank's
        shards of the global parameters, and the local ones restart from them (with what was computed
        since the handoff on top, if :meth:`contribute` kept the pseudo-gradient aside; with all of
        their progress since the old global parameters on top, if ``carry``: a replayed step's result,
        see ``peer.SiteState``); aborted, the residual goes back to what it was before
        :meth:`contribute` and nothing else changes."""
        if carry and not committed:
            raise ValueError("only a committed step carries the local progress")
        if not committed:
            self._restore_residual()
            self._forget_own()
            return
        self._forget_residual()
        lo, hi = self.span(params)
        avg = {i: torch.empty_like(self._g[i]) for i in params}

        def put(run: Run, v: torch.Tensor) -> None:
            avg[run.param].view(-1)[run.at : run.at + run.size].copy_(v)

        for a, b in self.layout.pieces(lo, hi, self.piece):
            self.channel.scatter(a, b, wire.piece(a - lo, b - lo) if wire is not None else None, put)
            if wire is not None:
                wire.release(a - lo, b - lo)
        self._step(avg, carry=carry)

    def step_alone(self, params: range) -> None:
        """A step alone (no round): every rank steps with its own pseudo-gradient (and all the residual:
        nothing was left out of a round). Nothing crosses ranks."""
        self._forget_own()
        locals_ = self.locals()
        avg: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for i in params:
                d = torch.sub(self._g[i], locals_[i])
                if self._e:
                    d.add_(self._e[i])
                    self._e[i].zero_()
                avg[i] = d
        self._step(avg)

    def _step(self, avg: dict[int, torch.Tensor], *, carry: bool = False) -> None:
        """Each parameter of ``avg`` steps with it; the local one restarts from the new global one, with
        the progress since the handoff on top (kept aside by :meth:`contribute`), or, if ``carry``, all
        of its progress since the old global one (an unsharded peer's replay carries it so)."""
        locals_ = self.locals()
        own, self._own = self._own, {}
        with torch.no_grad():
            for i, d in avg.items():  # one parameter at a time, as an unsharded peer's OuterStep.step
                g, p = self._g[i], locals_[i]
                kept = own.get(i)
                if kept is not None:  # the progress since the handoff: local now - local at the handoff
                    raw = (
                        kept
                        if isinstance(kept, torch.Tensor)
                        else torch.frombuffer(kept.read(), dtype=p.dtype)
                    )
                    p.sub_(g).add_(raw.view(p.shape).to(p.device))
                elif carry:
                    p.sub_(g)  # the progress since the old global parameters
                g.grad = d
                self.sgd.step()
                g.grad = None
                if kept is not None or carry:
                    p.add_(g)
                else:
                    p.copy_(g)
        for kept in own.values():
            if isinstance(kept, Spilled):
                kept.file.close()

    # ---- the residual's way back after an abort ----

    def _save_residual(self, params: range) -> None:
        self._forget_residual()
        if not self._e:
            return
        file = SpillFile()
        for i in params:
            if self._e[i].numel():
                raw = self._e[i].detach().cpu().contiguous().view(torch.uint8)
                self._saved.append((i, file.put(raw.numpy().data)))

    def _restore_residual(self) -> None:
        for i, kept in self._saved:
            back = torch.frombuffer(kept.read(), dtype=self._e[i].dtype)
            self._e[i].copy_(back.view(self._e[i].shape))
        self._forget_residual()

    def _forget_own(self) -> None:
        for kept in self._own.values():
            if isinstance(kept, Spilled):
                kept.file.close()
        self._own = {}

    def _forget_residual(self) -> None:
        for _, kept in self._saved:
            kept.file.close()
        self._saved = []

    # ---- what checkpoints hold ----

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The outer state by parameter name, as DTensors sharded like the model (for DCP)."""
        out: dict[str, torch.Tensor] = {}
        for k, n in enumerate(self.layout.names):
            out[f"global.{n}"] = self.global_params[k]
            if self.momentum:
                out[f"momentum.{n}"] = self.momentum[k]
            if self.residual:
                out[f"feedback.{n}"] = self.residual[k]
        return out
