"""A stage server: one stage of the model, served to the callers that route micro-batches through it.

Theory of operation (see docs/pipeline.md for the whole protocol):

- ``pipeline_forward`` reads the stage's input (token ids for the first stage, activations otherwise),
  checks it (``codec``: the shape must be one this stage takes, the bytes the exact encoded size, the
  values finite and bounded), runs the stage and keeps the input and the autograd graph of the output
  under ``(caller, micro-batch id)`` until the backward comes or ``timeout`` passes. The last stage also
  reads the targets, computes the loss and at once the gradients: it answers with the loss and the
  gradient for its input.
- ``pipeline_backward`` takes the gradient for the output, computes the gradient for the input (sent
  back) and the parameters' gradients, which it keeps *pending*.
- ``pipeline_commit`` adds pending gradients into the step's sum, counting their samples (``keep``), or
  drops them. Only the caller that sent a micro-batch can commit it, only once, only in its step: a
  sample enters a stage's sum at most once, whatever retries its caller made elsewhere.
- :meth:`StageServer.close_step` stops the step (later calls for it are refused with
  ``pipeline_closed``) and hands the mean gradient and its sample count to the stage-wise average;
  :meth:`StageServer.open_step` starts the next one.

The gradients kept per micro-batch are the gradients of its mean loss times its samples, so that the
step's sum divided by its samples is the mean gradient over every sample the stage counted, and equal
micro-batches give exactly the unsplit model's gradient of the batch's mean loss.

Compute runs under one lock (a stage computes one micro-batch at a time, as a GPU would), in a worker
thread when the stage is large enough to block the event loop for more than a few milliseconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch
import trio

from ..errors import CallRefused
from ..identity import PeerID
from ..net.rpc import CallContext, RpcRegistry
from ..net.streams import RpcStream
from . import codec
from .protocol import (
    BACKWARD,
    BUSY,
    COMMIT,
    FORWARD,
    MB_ID_BYTES,
    NOT_YET,
    STEP_CLOSED,
    UNKNOWN_MB,
    WRONG_STAGE,
    BackwardReq,
    BackwardResp,
    CommitReq,
    CommitResp,
    ForwardReq,
    ForwardResp,
)
from .settings import PipelineSection
from .stages import Stage, stage_loss

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 256  # micro-batches held (forward state or pending gradients) at once
MAX_IN_FLIGHT_PER_PEER = 32  # ... of one caller
THREAD_PARAMS = 2_000_000  # stages larger than this compute in a worker thread


@dataclass
class _Held:
    """A micro-batch this stage ran the forward of: its input, its output's graph, then its gradients."""

    step: int
    samples: int
    created: float
    x: torch.Tensor | None = None  # the input (a leaf that requires grad, except token ids)
    y: torch.Tensor | None = None  # the output, with its graph
    grads: list[torch.Tensor] | None = None  # pending parameter gradients (times samples)


@dataclass
class ServerStats:
    forwards: int = 0
    backwards: int = 0
    committed: int = 0  # micro-batches counted into a step's sum
    committed_samples: int = 0
    dropped: int = 0  # released by callers, expired, or left over when a step closed
    refused: int = 0
    compute_seconds: float = 0.0
    computed_samples: int = 0
    received_bytes: int = 0  # request bodies (activations, gradients, tokens) received ...
    receive_seconds: float = 0.0  # ... in this long: from a request's header to its body's last byte
    per_step: list[int] = field(default_factory=list)  # samples counted in each closed step


class StageServer:
    """Serves one stage of the model; owns its weights' gradient sum for the current step."""

    def __init__(
        self,
        stage: Stage,
        pipeline: PipelineSection,
        *,
        step: int = 0,
        clock: Callable[[], float] = trio.current_time,
        slowdown: float = 1.0,
        cost: float = 0.0,
    ) -> None:
        """``slowdown``: compute takes that many times longer here (an emulated slow device: the
        benchmarks' and the simulation's heterogeneous peers); ``cost``: if positive, compute is
        emulated instead of measured: it takes ``cost * slowdown`` seconds per sample on the server's
        clock (a benchmark on a virtual clock, where real compute takes no time)."""
        self.stage = stage
        self.slowdown = slowdown
        self.cost = cost
        self.pipeline = pipeline
        self.params: list[torch.Tensor] = [p for p in stage.parameters() if p.requires_grad]
        self.grad_sum = [torch.zeros_like(p) for p in self.params]
        self.samples = 0
        self.step = step
        self.open = True
        self.stats = ServerStats()
        self._held: dict[tuple[PeerID, bytes], _Held] = {}
        self._clock = clock
        self._lock = trio.Lock()
        self._active = 0  # calls being served now
        self._idle = trio.Event()
        self._idle.set()
        self._last_call = clock()
        self._threaded = stage.num_parameters() > THREAD_PARAMS
        self._done: dict[int, set[PeerID]] = {}  # step -> the callers that told this peer they are done
        self._answered: dict[int, set[PeerID]] = {}  # step -> callers done by their answer (``mark_done``)
        self._done_changed = trio.Event()
        # the last step whose micro-batches this peer's own router sent them all (see ``PipelinePeer``)
        self.caller_done = -1
        # tests: awaited at the start of every forward and backward (a stall, a crash at that point)
        self.fault: Callable[[str], Awaitable[None]] | None = None

    # ------------------------------------------------------------------ state the swarm sees

    @property
    def index(self) -> int:
        return self.stage.index

    @property
    def queue(self) -> int:
        """Micro-batches in flight here: being served, or waiting for their backward."""
        return self._active + sum(1 for h in self._held.values() if h.grads is None)

    @property
    def throughput(self) -> float:
        """Samples per second this stage computed (forward and backward), 0 before the first."""
        s = self.stats
        return s.computed_samples / s.compute_seconds if s.compute_seconds > 0 else 0.0

    @property
    def bandwidth(self) -> float:
        """Bytes per second this stage received request bodies at (its link as its callers reach it),
        0 before the first measurable one."""
        s = self.stats
        return s.received_bytes / s.receive_seconds if s.receive_seconds > 0 else 0.0

    async def _receive(self, stream: RpcStream, n: int) -> bytes | memoryview:
        began = trio.current_time()
        body = await stream.receive_all(n)
        self.stats.received_bytes += n
        self.stats.receive_seconds += trio.current_time() - began
        return body

    def register(self, registry: RpcRegistry, *, replace: bool = False) -> None:
        """Serve the stage's methods on ``registry`` (``replace``: in place of another server's)."""
        if replace and registry.get(FORWARD.name) is not None:
            registry.replace(FORWARD, self._on_forward)
            registry.replace(BACKWARD, self._on_backward)
            registry.replace(COMMIT, self._on_commit)
            return
        registry.add_stream(FORWARD, self._on_forward)
        registry.add_stream(BACKWARD, self._on_backward)
        registry.add_unary(COMMIT, self._on_commit)

    # ------------------------------------------------------------------ steps

    def close_step(self) -> tuple[list[torch.Tensor], int]:
        """Stop the current step: ``(mean gradients, samples counted)``; every held micro-batch is dropped
        (its caller's commit now finds nothing: counted zero times)."""
        self.open = False
        self.stats.dropped += len(self._held)
        self._held.clear()
        n = self.samples
        mean = [g / n for g in self.grad_sum] if n else [torch.zeros_like(g) for g in self.grad_sum]
        self.stats.per_step.append(n)
        return mean, n

    def open_step(self, step: int) -> None:
        """Start ``step`` with an empty gradient sum."""
        for g in self.grad_sum:
            g.zero_()
        self.samples = 0
        self.step = step
        self.open = True
        self._done = {s: d for s, d in self._done.items() if s >= step}
        self._answered = {s: d for s, d in self._answered.items() if s >= step}

    def done(self, step: int) -> frozenset[PeerID]:
        """The callers that said they sent every micro-batch of ``step``."""
        return frozenset(self._done.get(step, set()) | self._answered.get(step, set()))

    def told(self, step: int) -> frozenset[PeerID]:
        """Those of :meth:`done` that told this peer so themselves (they knew it served then)."""
        return frozenset(self._done.get(step, ()))

    def mark_done(self, step: int, peers: set[PeerID]) -> None:
        """``peers`` are done calling in ``step`` (they said so when answering this peer's own "done")."""
        if peers and self.step <= step <= self.step + 1:
            self._answered.setdefault(step, set()).update(peers)
            self._done_changed.set()

    async def wait_done(self, expected: set[PeerID], *, limit: float) -> frozenset[PeerID]:
        """Wait until every caller in ``expected`` is done with the current step (or ``limit`` passed:
        a caller that died says nothing); the callers that are done."""
        with trio.move_on_after(limit):
            while not expected <= self.done(self.step):
                self._done_changed = trio.Event()
                await self._done_changed.wait()
        return self.done(self.step)

    async def quiet(self, *, idle: float, limit: float) -> None:
        """Return once no call has been served for ``idle`` seconds (or after ``limit``): the callers of
        this step are done with this stage."""
        with trio.move_on_after(limit):
            while True:
                await self._idle.wait()
                wait = self._last_call + idle - self._clock()
                if wait <= 0 and self._active == 0:
                    return
                await trio.sleep(max(wait, 0.01))

    # ------------------------------------------------------------------ handlers

    def _admit(self, step: int, stage: int) -> None:
        self._expire()
        if stage != self.index:
            raise CallRefused(WRONG_STAGE, f"this peer serves stage {self.index}, not {stage}")
        if step > self.step:
            raise CallRefused(NOT_YET, f"this peer is on step {self.step}, not yet {step}")
        if step < self.step or not self.open:
            raise CallRefused(STEP_CLOSED, f"step {step} is closed here")

    def _expire(self) -> None:
        cutoff = self._clock() - 2 * self.pipeline.timeout
        for key in [k for k, h in self._held.items() if h.created < cutoff]:
            del self._held[key]
            self.stats.dropped += 1

    def _input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` if this stage takes inputs of that shape, else RemoteProtocolError-like refusal."""
        cfg = self.stage.config
        ok = len(shape) == (2 if self.stage.is_first else 3)
        ok = ok and 1 <= shape[0] <= self.pipeline.micro_batch and 1 <= shape[1] <= cfg.block_size
        if ok and not self.stage.is_first:
            ok = shape[2] == cfg.n_embd
        if not ok:
            raise CallRefused("bad_request", f"stage {self.index} takes no input of shape {tuple(shape)}")
        return tuple(shape)

    def _enter(self) -> None:
        self._active += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._last_call = self._clock()

    def _leave(self) -> None:
        self._active -= 1
        self._last_call = self._clock()
        if self._active == 0:
            self._idle.set()

    async def _compute(self, fn: Callable[[], object], samples: int) -> None:
        async with self._lock:
            began = time.perf_counter()
            if self._threaded:
                await trio.to_thread.run_sync(fn)
            else:
                fn()
            spent = time.perf_counter() - began
            if self.cost > 0:  # emulated compute (see __init__)
                spent = self.cost * self.slowdown * samples
                await trio.sleep(spent)
            elif self.slowdown > 1:  # a slower device: the same work, later
                await trio.sleep((self.slowdown - 1) * spent)
                spent *= self.slowdown
            self.stats.compute_seconds += spent
            self.stats.computed_samples += samples

    async def _on_forward(self, ctx: CallContext, req: ForwardReq, stream: RpcStream) -> ForwardResp:
        in_bytes = self._check_forward(ctx.peer, req)
        self._enter()
        try:
            body = await self._receive(stream, in_bytes)
            resp, out = await self._forward(ctx.peer, req, body)
            await stream.send(out)
            await stream.send_eof()
            return resp
        finally:
            self._leave()

    async def _on_backward(self, ctx: CallContext, req: BackwardReq, stream: RpcStream) -> BackwardResp:
        in_bytes = self._check_backward(ctx.peer, req)
        self._enter()
        try:
            body = await self._receive(stream, in_bytes)
            resp, out = await self._backward(ctx.peer, req, body)
            if out:
                await stream.send(out)
            await stream.send_eof()
            return resp
        finally:
            self._leave()

    async def local_forward(
        self, peer: PeerID, req: ForwardReq, body: bytes | memoryview
    ) -> tuple[ForwardResp, bytes | memoryview]:
        """A forward for a caller on this same peer (no connection to ourselves): the same checks and
        state as a remote call's."""
        in_bytes = self._check_forward(peer, req)
        if len(memoryview(body)) != in_bytes:
            raise CallRefused("bad_request", f"the input must be {in_bytes} bytes")
        self._enter()
        try:
            return await self._forward(peer, req, body)
        finally:
            self._leave()

    async def local_backward(
        self, peer: PeerID, req: BackwardReq, body: bytes | memoryview
    ) -> tuple[BackwardResp, bytes | memoryview]:
        """A backward for a caller on this same peer (see :meth:`local_forward`)."""
        in_bytes = self._check_backward(peer, req)
        if len(memoryview(body)) != in_bytes:
            raise CallRefused("bad_request", f"the gradient must be {in_bytes} bytes")
        self._enter()
        try:
            return await self._backward(peer, req, body)
        finally:
            self._leave()

    def local_commit(self, peer: PeerID, req: CommitReq) -> CommitResp:
        return self._commit(peer, req)

    def _check_forward(self, peer: PeerID, req: ForwardReq) -> int:
        """The request's body size, once the request is one this stage serves now; else CallRefused."""
        self._admit(req.step, req.stage)
        if req.compression != self.pipeline.wire.name:
            raise CallRefused("bad_request", f"this run sends {self.pipeline.wire.name} activations")
        shape = self._input_shape(req.shape)
        if len(req.mb) != MB_ID_BYTES:
            raise CallRefused("bad_request", f"a micro-batch id is {MB_ID_BYTES} bytes")
        mine = sum(1 for p, _ in self._held if p == peer)
        if len(self._held) >= MAX_IN_FLIGHT or mine >= MAX_IN_FLIGHT_PER_PEER:
            self.stats.refused += 1
            raise CallRefused(BUSY, "too many micro-batches in flight here")
        n_targets = shape[0] * shape[1] if self.stage.is_last else 0
        if req.targets != n_targets:
            raise CallRefused(
                "bad_request", f"stage {self.index} takes {n_targets} targets, not {req.targets}"
            )
        in_bytes = 4 * codec.numel(shape) if self.stage.is_first else self.pipeline.wire.size(shape)
        return in_bytes + 4 * n_targets

    def _check_backward(self, peer: PeerID, req: BackwardReq) -> int:
        self._admit(req.step, req.stage)
        if self.stage.is_last:
            raise CallRefused("bad_request", "the last stage's backward comes with its forward")
        if req.compression != self.pipeline.wire.name:
            raise CallRefused("bad_request", f"this run sends {self.pipeline.wire.name} gradients")
        held = self._held.get((peer, req.mb))
        if held is None or held.y is None:
            raise CallRefused(UNKNOWN_MB, "no forward of that micro-batch is held here")
        expected = tuple(held.y.shape)
        if tuple(req.shape) != expected:
            raise CallRefused("bad_request", f"the output gradient must have shape {expected}")
        return self.pipeline.wire.size(expected)

    async def _forward(
        self, peer: PeerID, req: ForwardReq, body: bytes | memoryview
    ) -> tuple[ForwardResp, bytes | memoryview]:
        if self.fault is not None:
            await self.fault("forward")
        wire, shape = self.pipeline.wire, tuple(req.shape)
        in_bytes = 4 * codec.numel(shape) if self.stage.is_first else wire.size(shape)
        view = memoryview(body).cast("B")
        what = f"stage {self.index}'s input from {peer.short()}"
        x: torch.Tensor
        if self.stage.is_first:
            x = codec.decode_tokens(view[:in_bytes], shape, self.stage.config.vocab_size, what)
        else:
            x = wire.decode(view[:in_bytes], shape, self.pipeline.max_abs, what)
            x.requires_grad_(True)
        held = _Held(req.step, shape[0], self._clock(), x=x)
        out: dict[str, torch.Tensor] = {}
        if self.stage.is_last:
            targets = codec.decode_tokens(
                view[in_bytes:], shape[:2], self.stage.config.vocab_size, f"targets from {peer.short()}"
            )

            def last() -> None:
                with torch.enable_grad():
                    loss = stage_loss(self.stage(x), targets)
                    grads = torch.autograd.grad(loss, [x, *self.params], allow_unused=True)
                out["loss"] = loss.detach()
                assert grads[0] is not None
                out["dx"] = grads[0]
                held.grads = _scaled(grads[1:], self.params, shape[0])

            await self._compute(last, shape[0])
            held.x = None
            result: torch.Tensor = out["dx"]
        else:

            def forward() -> None:
                with torch.enable_grad():
                    out["y"] = self.stage(x)

            await self._compute(forward, shape[0])
            held.y = out["y"]
            result = out["y"].detach()
        if self.step != req.step or not self.open:  # the step closed while we computed
            raise CallRefused(STEP_CLOSED, f"step {req.step} closed here")
        self._held[(peer, req.mb)] = held
        self.stats.forwards += 1
        loss = float(out["loss"]) if "loss" in out else 0.0
        return ForwardResp(tuple(result.shape), loss), wire.encode(result)

    async def _backward(
        self, peer: PeerID, req: BackwardReq, body: bytes | memoryview
    ) -> tuple[BackwardResp, bytes | memoryview]:
        if self.fault is not None:
            await self.fault("backward")
        held = self._held.get((peer, req.mb))
        if held is None or held.y is None or held.x is None:  # (taken meanwhile: a duplicate call)
            raise CallRefused(UNKNOWN_MB, "no forward of that micro-batch is held here")
        wire = self.pipeline.wire
        what = f"stage {self.index}'s output gradient from {peer.short()}"
        g = wire.decode(body, tuple(held.y.shape), self.pipeline.max_abs, what)
        x, y = held.x, held.y
        held.y = None  # one backward per forward: a second call finds nothing
        inputs = self.params if self.stage.is_first else [x, *self.params]
        out: dict[str, list[torch.Tensor | None]] = {}

        def backward() -> None:
            out["grads"] = list(torch.autograd.grad(y, inputs, grad_outputs=g, allow_unused=True))

        await self._compute(backward, held.samples)
        grads = out["grads"]
        dx = None if self.stage.is_first else grads.pop(0)
        held.grads = _scaled(grads, self.params, held.samples)
        held.x = None
        if self.step != req.step or not self.open:
            raise CallRefused(STEP_CLOSED, f"step {req.step} closed here")
        self.stats.backwards += 1
        if dx is None:
            return BackwardResp(()), b""
        return BackwardResp(tuple(dx.shape)), wire.encode(dx)

    async def _on_commit(self, ctx: CallContext, req: CommitReq) -> CommitResp:
        return self._commit(ctx.peer, req)

    def _commit(self, peer: PeerID, req: CommitReq) -> CommitResp:
        if req.done and self.step <= req.step <= self.step + 1:
            self._done.setdefault(req.step, set()).add(peer)
            self._done_changed.set()
        counted = 0
        for mb in req.mbs:
            held = self._held.get((peer, mb))
            if held is None:
                continue
            if not req.keep:
                del self._held[(peer, mb)]
                self.stats.dropped += 1
                continue
            if held.grads is None or held.step != self.step or not self.open or req.step != self.step:
                continue
            del self._held[(peer, mb)]
            for acc, g in zip(self.grad_sum, held.grads, strict=True):
                acc.add_(g)
            self.samples += held.samples
            self.stats.committed += 1
            self.stats.committed_samples += held.samples
            counted += 1
        return CommitResp(counted, req.step < self.step or req.step <= self.caller_done)


def _scaled(
    grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], k: int
) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if g is None else g.detach() * k for g, p in zip(grads, params, strict=True)]
