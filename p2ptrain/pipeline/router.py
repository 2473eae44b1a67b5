"""The router: a caller sends its micro-batches through one peer of every stage, and back.

Theory of operation (see docs/pipeline.md): for each stage in order, :func:`pick` chooses one of the
stage's peers at random with weight ``throughput / (1 + queue)`` (SWARM's stochastic wiring: the load
spreads by measured speed, and no peer is a fixed link in anyone's chain), leaving out the peers this
caller dropped and those already tried for this micro-batch. The caller keeps what it sent each stage
(the bytes as the previous stage encoded them; relayed unchanged once checked), so that a failure costs
only the failed stage's work again:

- a forward that fails (connection closed, refused, no answer within ``timeout``) is sent to another
  peer of the stage;
- a backward that fails is replayed on another peer of the stage: the forward of the kept input, then
  the backward; the stages above keep what they committed;
- after ``retries`` other peers the micro-batch is given up (the stages that committed it keep it: each
  stage's mean is over the samples *it* counted).

Nothing that arrives is used before it is checked (``codec``: the shape this caller expects, the exact
byte size, finite values within ``max_abs``); a peer whose answer fails a check is dropped by this
caller for good, logged and counted (``RouterStats.bans``), and the stage is retried elsewhere.

Duplicated micro-batches (``check_fraction``): at a stage drawn for a check, the forward goes to a
second peer too and the answers are compared (``codec.agree``), then the gradients their backwards send
back; on a mismatch a third peer decides, the odd one is dropped and reported; with no third, or no
majority, the micro-batch is given up. Only the
peer whose answer is used is committed; the others are told to drop their state.

A stage's parameter gradients are committed (``pipeline_commit``) only at the peer whose backward answer
this caller used, once it has that answer: a sample enters each stage's sum at most once.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import trio

from ..errors import HandshakeRefused, P2PError, PeerUnavailable, RemoteCallError, RemoteProtocolError
from ..identity import PeerID
from ..net.host import Host
from ..tasks.gpt import GPTConfig
from . import codec
from .directory import effective, link_bytes_per_sample
from .protocol import (
    BACKWARD,
    COMMIT,
    FORWARD,
    MB_ID_BYTES,
    NOT_YET,
    BackwardReq,
    CommitReq,
    ForwardReq,
    ForwardResp,
)
from .server import StageServer
from .settings import PipelineSection

log = logging.getLogger(__name__)

R = TypeVar("R")
NOT_YET_WAIT = 0.25  # seconds before asking a peer that is still on an earlier step again
SUSPECT_SECONDS = 30.0  # a peer that failed a call is tried last for this long


@dataclass(frozen=True)
class Candidate:
    """A peer of a stage, as the directory says (its own claims: used to weigh, never trusted)."""

    peer: PeerID
    address: str
    throughput: float = 0.0
    queue: int = 0
    bandwidth: float = 0.0  # bytes per second its link carries (measured by it), 0: unknown


def weight(c: Candidate, typical: float, link_bytes: float = 0.0) -> float:
    """How likely ``c`` is picked: its throughput (``typical`` while it has measured none), at most
    what its link carries (``directory.effective``: ``link_bytes`` per sample through the stage), over
    its queue plus one."""
    speed = c.throughput if c.throughput > 0 else typical
    speed = effective(speed, c.bandwidth, link_bytes)
    return max(speed, 1e-9) / (1 + c.queue)


def pick(
    candidates: list[Candidate], rng: random.Random, exclude: set[PeerID], link_bytes: float = 0.0
) -> Candidate | None:
    """One of ``candidates`` not in ``exclude``, at random by :func:`weight`; None when none is left."""
    left = [c for c in candidates if c.peer not in exclude]
    if not left:
        return None
    known = sorted(c.throughput for c in left if c.throughput > 0)
    typical = known[len(known) // 2] if known else 1.0
    return rng.choices(left, weights=[weight(c, typical, link_bytes) for c in left])[0]


class _Garbage(Exception):
    """A peer's answer failed a check: drop the peer."""


class _Failed(Exception):
    """A peer did not answer usefully (gone, stalled, refused): try another."""


class GiveUp(P2PError):
    """A micro-batch could not pass a stage (no peer of it left to try)."""


@dataclass
class RouterStats:
    micro_batches: int = 0
    given_up: int = 0
    retries: int = 0  # forwards or backwards sent again to another peer
    checks: int = 0  # stages of micro-batches run on two peers
    mismatches: int = 0
    bans: dict[PeerID, str] = field(default_factory=dict)
    bytes_sent: int = 0  # activation, gradient and token bytes to stage peers (local calls count too)
    bytes_received: int = 0
    commits_lost: int = 0  # stages whose commit did not reach the peer (that sample counts zero there)
    reasons: list[str] = field(default_factory=list)  # why micro-batches were given up (the last 32)


@dataclass
class MicroBatch:
    """What one micro-batch did."""

    loss: float | None  # None: given up
    samples: int
    retries: int = 0
    committed: list[bool] = field(default_factory=list)  # per stage
    reason: str = ""


@dataclass
class _Run:
    """One micro-batch in flight: its id, what each stage was sent, who answered, what to commit."""

    step: int
    mb: bytes
    batch: int
    seq: int
    sent: list[bytes | memoryview]
    used: list[Candidate | None]
    commits: list[tuple[Candidate, int, bool]] = field(default_factory=list)  # (peer, stage, keep)
    checked: dict[int, Candidate] = field(default_factory=dict)  # a stage's second peer, forward agreed
    retries: int = 0


class Router:
    """Sends this peer's micro-batches through the pipeline (see the module docstring)."""

    def __init__(
        self,
        host: Host,
        pipeline: PipelineSection,
        model: GPTConfig,
        candidates: Callable[[int], list[Candidate]],
        *,
        local: StageServer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``candidates(stage)``: the stage's peers as the directory says now; ``local``: this peer's own
        stage server, called in process when the router picks this peer."""
        self.host = host
        self.pipeline = pipeline
        self.model = model
        self.candidates = candidates
        self.local = local
        self.rng = rng or random.Random()
        self.stats = RouterStats()
        self.checking = True  # duplicated micro-batches allowed this step (see ``PipelinePeer.step``)
        self.stages = pipeline.num_stages
        self.link_bytes = link_bytes_per_sample(model, pipeline)
        self._suspects: dict[PeerID, float] = {}  # peers that failed a call lately -> until when
        self._busy: Counter[PeerID] = Counter()  # this caller's calls in flight, per peer

    def _pick(self, s: int, tried: set[PeerID]) -> Candidate | None:
        """A peer of stage ``s`` not tried and not dropped; one that failed lately only if no other is
        left (it may have been a passing fault)."""
        now = trio.current_time()
        self._suspects = {p: t for p, t in self._suspects.items() if t > now}
        excluded = tried | set(self.stats.bans)
        cands, per_sample = self.candidates(s), self.link_bytes[s]
        # the directory's queues are as old as its last read: this caller's own calls in flight now
        # count at once (callers pick at the same moments; without this they pile onto one peer)
        cands = [
            dataclasses.replace(c, queue=max(c.queue, self._busy[c.peer])) if self._busy[c.peer] else c
            for c in cands
        ]
        return pick(cands, self.rng, excluded | set(self._suspects), per_sample) or pick(
            cands, self.rng, excluded, per_sample
        )

    def _suspect(self, cand: Candidate) -> None:
        if cand.peer != self.host.peer_id:
            self._suspects[cand.peer] = trio.current_time() + SUSPECT_SECONDS

    async def done(self, step: int, peers: list[Candidate]) -> tuple[set[PeerID], set[PeerID]]:
        """Tell ``peers`` (every stage peer) that this caller sent every micro-batch of ``step``:
        ``(heard, finished)``, the peers that heard it and those of them that answered that they, as
        callers, are done with ``step`` too. A peer that did not hear it (gone, unreachable) is not
        calling this peer either: a step's end waits for ``heard`` alone."""
        heard: set[PeerID] = set()
        finished: set[PeerID] = set()
        req = CommitReq(step, (), True, True)

        async def one(cand: Candidate) -> None:
            try:
                with trio.fail_after(self.pipeline.timeout):
                    if cand.peer == self.host.peer_id:
                        if self.local is not None:
                            self.local.local_commit(self.host.peer_id, req)
                        resp = None
                    else:
                        conn = await self.host.connect(cand.address, timeout=self.pipeline.timeout)
                        resp = await conn.call(COMMIT, req, timeout=self.pipeline.timeout)
                heard.add(cand.peer)
                if resp is not None and resp.done:
                    finished.add(cand.peer)
            except (P2PError, trio.TooSlowError) as e:
                log.info("%s did not hear that step %d is done here: %s", cand.peer.short(), step, e)
                self._suspect(cand)

        async with trio.open_nursery() as nursery:
            for cand in peers:
                nursery.start_soon(one, cand)
        return heard, finished

    # ------------------------------------------------------------------ one micro-batch

    async def run(self, step: int, x: torch.Tensor, y: torch.Tensor) -> MicroBatch:
        """Send one micro-batch (token ids ``x`` and targets ``y``, both (B, T)) through the pipeline,
        forward and backward; its gradients are committed at one peer of each stage it passed."""
        b, t = int(x.shape[0]), int(x.shape[1])
        if not (1 <= b <= self.pipeline.micro_batch and 1 <= t <= self.model.block_size):
            raise ValueError(f"a micro-batch of shape {tuple(x.shape)} does not fit the pipeline")
        run = _Run(step, self.rng.randbytes(MB_ID_BYTES), b, t, [b""] * self.stages, [None] * self.stages)
        self.stats.micro_batches += 1
        committed = [False] * self.stages
        try:
            h: bytes | memoryview = codec.encode_tokens(x)
            for s in range(self.stages - 1):
                run.sent[s] = h
                cand, _, h = await self._forward_stage(run, s, h)
                run.used[s] = cand
            run.sent[-1] = h
            targets = codec.encode_tokens(y)
            cand, resp, g = await self._forward_stage(run, self.stages - 1, h, targets)
            run.used[-1] = cand
            run.commits.append((cand, self.stages - 1, True))
            loss = resp.loss
            for s in range(self.stages - 2, -1, -1):
                cand, g = await self._backward_stage(run, s, g)
                run.commits.append((cand, s, True))
            result = MicroBatch(loss, b, run.retries)
        except GiveUp as e:
            self.stats.given_up += 1
            self.stats.reasons = [*self.stats.reasons[-31:], str(e)]
            log.warning("micro-batch given up: %s", e)
            result = MicroBatch(None, b, run.retries, reason=str(e))
        finally:
            with trio.CancelScope(shield=True):
                done = await self._flush(run)
        for s in done:
            committed[s] = True
        result.committed = committed
        self.stats.retries += run.retries
        return result

    # ------------------------------------------------------------------ stages

    def _in_shape(self, run: _Run, s: int) -> tuple[int, ...]:
        return (run.batch, run.seq) if s == 0 else (run.batch, run.seq, self.model.n_embd)

    def _out_shape(self, run: _Run, s: int) -> tuple[int, ...]:
        if s == self.stages - 1:  # the last stage answers with its input's gradient
            return self._in_shape(run, s)
        return (run.batch, run.seq, self.model.n_embd)

    async def _forward_stage(
        self, run: _Run, s: int, h: bytes | memoryview, targets: bytes = b""
    ) -> tuple[Candidate, ForwardResp, bytes | memoryview]:
        """The stage's answer to ``h``, from the first peer that gives a good one (and, if this stage
        is drawn for a check, one that a second peer confirms)."""
        tried: set[PeerID] = set()
        check = self.checking and self.pipeline.check_fraction > 0
        check = check and self.rng.random() < self.pipeline.check_fraction
        answer = await self._forward_somewhere(run, s, h, targets, tried)
        assert answer is not None  # (not optional: GiveUp instead)
        if not check:
            return answer
        second = await self._forward_somewhere(run, s, h, targets, tried, optional=True)
        if second is None:
            return answer
        self.stats.checks += 1
        if self._agree(s, answer, second):
            run.commits.append((second[0], s, False))
            run.checked[s] = second[0]  # its backward is compared too
            return answer
        self.stats.mismatches += 1
        third = await self._forward_somewhere(run, s, h, targets, tried, optional=True)
        if third is None or not (self._agree(s, answer, third) or self._agree(s, second, third)):
            for a in (answer, second, *([third] if third else [])):
                run.commits.append((a[0], s, False))
            raise GiveUp(f"stage {s}: the answers of two peers disagree and no third settles it")
        odd, winner = (second, answer) if self._agree(s, answer, third) else (answer, second)
        self.ban(odd[0], f"its stage-{s} answer disagreed with two other peers'")
        for a in (odd, third):
            run.commits.append((a[0], s, False))
        run.checked[s] = third[0]
        return winner

    def _agree(
        self,
        s: int,
        a: tuple[Candidate, ForwardResp, bytes | memoryview],
        b: tuple[Candidate, ForwardResp, bytes | memoryview],
    ) -> bool:
        wire = self.pipeline.wire
        shape = self._out_shape_of(a)
        ta = wire.decode(a[2], shape, self.pipeline.max_abs, "")
        tb = wire.decode(b[2], shape, self.pipeline.max_abs, "")
        if s == self.stages - 1 and abs(a[1].loss - b[1].loss) > 1e-4 * max(1.0, abs(a[1].loss)):
            return False
        return wire.agree(ta, tb)

    @staticmethod
    def _out_shape_of(a: tuple[Candidate, ForwardResp, bytes | memoryview]) -> tuple[int, ...]:
        return tuple(a[1].shape)

    async def _forward_somewhere(
        self,
        run: _Run,
        s: int,
        h: bytes | memoryview,
        targets: bytes,
        tried: set[PeerID],
        *,
        optional: bool = False,
    ) -> tuple[Candidate, ForwardResp, bytes | memoryview] | None:
        """A checked forward of stage ``s`` from a peer not in ``tried`` (added to it), trying others on
        failure; GiveUp when none is left (None instead when ``optional``: a check's second peer)."""
        attempts = 0
        while True:
            cand = self._pick(s, tried)
            if cand is None or attempts > self.pipeline.retries:
                if optional:
                    return None
                raise GiveUp(f"stage {s} has no peer left to try (tried {len(tried)})")
            tried.add(cand.peer)
            if attempts:
                run.retries += 1
            attempts += 1
            try:
                resp, out = await self._call_forward(run, s, cand, h, targets)
                return cand, resp, out
            except _Garbage as e:
                self.ban(cand, str(e))
            except _Failed as e:
                self._suspect(cand)
                log.info("stage %d peer %s failed a forward: %s; trying another", s, cand.peer.short(), e)

    async def _backward_stage(
        self, run: _Run, s: int, g: bytes | memoryview
    ) -> tuple[Candidate, bytes | memoryview]:
        """The gradient for stage ``s``'s input (see :meth:`_backward_once`); when the stage's forward was
        checked on a second peer, that peer's backward is compared too, and a third decides a mismatch."""
        cand, gin = await self._backward_once(run, s, g)
        other = run.checked.get(s)
        if s == 0 or other is None or other.peer == cand.peer or other.peer in self.stats.bans:
            return cand, gin  # (stage 0 sends no gradient back: nothing to compare)
        try:
            gin2 = await self._call_backward(run, s, other, g)
        except _Garbage as e:
            self.ban(other, str(e))
            return cand, gin
        except _Failed:
            return cand, gin
        self.stats.checks += 1
        if self._agree_grads(run, s, gin, gin2):
            return cand, gin
        self.stats.mismatches += 1
        run.commits += [(cand, s, False), (other, s, False)]
        third = self._pick(s, {cand.peer, other.peer})
        if third is None:
            raise GiveUp(f"stage {s}: two peers' backward answers disagree and no third settles it")
        run.commits.append((third, s, False))
        try:
            await self._call_forward(run, s, third, run.sent[s], b"")
            gin3 = await self._call_backward(run, s, third, g)
        except (_Garbage, _Failed) as e:
            raise GiveUp(
                f"stage {s}: two backward answers disagree, and the third peer failed: {e}"
            ) from None
        if self._agree_grads(run, s, gin, gin3):
            self.ban(other, f"its stage-{s} backward disagreed with two other peers'")
            run.commits.remove((cand, s, False))
            return cand, gin
        if self._agree_grads(run, s, gin2, gin3):
            self.ban(cand, f"its stage-{s} backward disagreed with two other peers'")
            run.commits.remove((other, s, False))
            run.used[s] = other
            return other, gin2
        raise GiveUp(f"stage {s}: three peers' backward answers disagree")

    def _agree_grads(self, run: _Run, s: int, a: bytes | memoryview, b: bytes | memoryview) -> bool:
        wire, shape = self.pipeline.wire, self._in_shape(run, s)
        ta = wire.decode(a, shape, self.pipeline.max_abs, "")
        tb = wire.decode(b, shape, self.pipeline.max_abs, "")
        return wire.agree(ta, tb)

    async def _backward_once(
        self, run: _Run, s: int, g: bytes | memoryview
    ) -> tuple[Candidate, bytes | memoryview]:
        """The gradient for stage ``s``'s input, from the peer that ran its forward, else replayed (forward
        then backward) on another peer of the stage."""
        first = run.used[s]
        assert first is not None
        tried = {first.peer}
        try:
            return first, await self._call_backward(run, s, first, g)
        except _Garbage as e:
            self.ban(first, str(e))
        except _Failed as e:
            self._suspect(first)
            log.info("stage %d peer %s failed a backward: %s; replaying elsewhere", s, first.peer.short(), e)
        attempts = 0
        while True:
            cand = self._pick(s, tried)
            if cand is None or attempts >= self.pipeline.retries:
                raise GiveUp(f"stage {s}: no peer left to replay the backward on (tried {len(tried)})")
            tried.add(cand.peer)
            attempts += 1
            run.retries += 1
            try:
                await self._call_forward(run, s, cand, run.sent[s], b"")
                run.used[s] = cand
                return cand, await self._call_backward(run, s, cand, g)
            except _Garbage as e:
                self.ban(cand, str(e))
            except _Failed as e:
                self._suspect(cand)
                log.info("stage %d peer %s failed a replay: %s", s, cand.peer.short(), e)

    # ------------------------------------------------------------------ calls

    async def _call_forward(
        self, run: _Run, s: int, cand: Candidate, h: bytes | memoryview, targets: bytes
    ) -> tuple[ForwardResp, bytes | memoryview]:
        wire = self.pipeline.wire
        req = ForwardReq(run.step, s, run.mb, self._in_shape(run, s), wire.name, len(targets) // 4)
        body = bytes(h) + targets if targets else h
        expected = self._out_shape(run, s)
        limit = wire.size(expected)

        async def remote() -> tuple[ForwardResp, bytes | memoryview]:
            conn = await self.host.connect(cand.address, timeout=self.pipeline.timeout)
            async with conn.open_stream(FORWARD, req, timeout=self.pipeline.timeout) as stream:
                await stream.send(body)
                await stream.send_eof()
                out = await stream.receive_all(limit)
                resp = await stream.response()
            return resp, out

        resp, out = await self._call(
            cand, remote, lambda srv: srv.local_forward(self.host.peer_id, req, body)
        )
        self.stats.bytes_sent += len(memoryview(body))
        self.stats.bytes_received += len(memoryview(out))
        if tuple(resp.shape) != expected:
            raise _Garbage(f"stage {s} answered with shape {tuple(resp.shape)}, expected {expected}")
        try:
            wire.decode(out, expected, self.pipeline.max_abs, f"stage {s}'s answer")
        except RemoteProtocolError as e:
            raise _Garbage(str(e)) from None
        if s == self.stages - 1 and not resp.loss >= 0:
            raise _Garbage(f"stage {s} answered with loss {resp.loss}")
        return resp, out

    async def _call_backward(
        self, run: _Run, s: int, cand: Candidate, g: bytes | memoryview
    ) -> bytes | memoryview:
        wire = self.pipeline.wire
        req = BackwardReq(run.step, s, run.mb, (run.batch, run.seq, self.model.n_embd), wire.name)
        expected: tuple[int, ...] = () if s == 0 else self._in_shape(run, s)
        limit = wire.size(expected) if expected else 0

        async def remote() -> tuple[ForwardResp, bytes | memoryview]:
            conn = await self.host.connect(cand.address, timeout=self.pipeline.timeout)
            async with conn.open_stream(BACKWARD, req, timeout=self.pipeline.timeout) as stream:
                await stream.send(g)
                await stream.send_eof()
                out = await stream.receive_all(limit)
                resp = await stream.response()
            return ForwardResp(resp.shape), out

        async def local(srv: StageServer) -> tuple[ForwardResp, bytes | memoryview]:
            resp, out = await srv.local_backward(self.host.peer_id, req, g)
            return ForwardResp(resp.shape), out

        resp, out = await self._call(cand, remote, local)
        self.stats.bytes_sent += len(memoryview(g))
        self.stats.bytes_received += len(memoryview(out))
        if tuple(resp.shape) != expected:
            raise _Garbage(
                f"stage {s}'s backward answered with shape {tuple(resp.shape)}, expected {expected}"
            )
        if expected:
            try:
                wire.decode(out, expected, self.pipeline.max_abs, f"stage {s}'s input gradient")
            except RemoteProtocolError as e:
                raise _Garbage(str(e)) from None
        elif len(memoryview(out)):
            raise _Garbage(f"stage {s}'s backward sent {len(memoryview(out))} bytes, expected none")
        return out

    async def _call(
        self,
        cand: Candidate,
        remote: Callable[[], Awaitable[tuple[R, bytes | memoryview]]],
        local: Callable[[StageServer], Awaitable[tuple[R, bytes | memoryview]]],
    ) -> tuple[R, bytes | memoryview]:
        """One call to ``cand``, local or remote, within ``timeout``; failures sorted into _Failed (try
        another) and _Garbage (drop the peer). A peer still on an earlier step is asked again."""
        self._busy[cand.peer] += 1
        try:
            return await self._call_once(cand, remote, local)
        finally:
            self._busy[cand.peer] -= 1

    async def _call_once(
        self,
        cand: Candidate,
        remote: Callable[[], Awaitable[tuple[R, bytes | memoryview]]],
        local: Callable[[StageServer], Awaitable[tuple[R, bytes | memoryview]]],
    ) -> tuple[R, bytes | memoryview]:
        while True:
            with trio.move_on_after(self.pipeline.timeout) as scope:
                try:
                    if cand.peer == self.host.peer_id and self.local is not None:
                        return await local(self.local)
                    return await remote()
                except RemoteCallError as e:
                    if e.code == NOT_YET:
                        await trio.sleep(NOT_YET_WAIT)
                        continue
                    if e.code == "bad_request":
                        raise _Failed(f"refused our request: {e.message}") from None
                    raise _Failed(f"{e.code}: {e.message}") from None
                except P2PError as e:
                    if isinstance(e, RemoteProtocolError):
                        raise _Garbage(f"broke the protocol: {e}") from None
                    if isinstance(e, PeerUnavailable | HandshakeRefused):
                        raise _Failed(str(e)) from None
                    if getattr(e, "code", None) == NOT_YET:  # a local CallRefused
                        await trio.sleep(NOT_YET_WAIT)
                        continue
                    raise _Failed(str(e)) from None
            if scope.cancelled_caught:
                raise _Failed(f"no answer within {self.pipeline.timeout:g} s")

    def ban(self, cand: Candidate, reason: str) -> None:
        if cand.peer == self.host.peer_id:
            return  # (our own stage: nothing to drop)
        if cand.peer not in self.stats.bans:
            log.warning("dropping stage peer %s: %s", cand.peer.short(), reason)
            self.stats.bans[cand.peer] = reason

    async def _flush(self, run: _Run) -> set[int]:
        """Send the micro-batch's commits and drops, one call per peer, at once; the stages whose
        commit was counted."""
        by_peer: dict[PeerID, tuple[Candidate, list[tuple[int, bool]]]] = {}
        for cand, s, keep in run.commits:
            by_peer.setdefault(cand.peer, (cand, []))[1].append((s, keep))
        counted: set[int] = set()

        async def one(cand: Candidate, items: list[tuple[int, bool]]) -> None:
            for keep in (True, False):
                stages = [s for s, k in items if k == keep]
                if not stages:
                    continue
                req = CommitReq(run.step, (run.mb,), keep)
                try:
                    with trio.fail_after(self.pipeline.timeout):
                        if cand.peer == self.host.peer_id and self.local is not None:
                            resp = self.local.local_commit(self.host.peer_id, req)
                        else:
                            conn = await self.host.connect(cand.address, timeout=self.pipeline.timeout)
                            resp = await conn.call(COMMIT, req, timeout=self.pipeline.timeout)
                except (P2PError, trio.TooSlowError) as e:
                    if keep:
                        self.stats.commits_lost += len(stages)
                        log.info("commit to %s lost: %s", cand.peer.short(), e)
                    continue
                if keep and resp.counted:
                    counted.update(stages)
                elif keep:
                    self.stats.commits_lost += len(stages)

        async with trio.open_nursery() as nursery:
            for cand, items in by_peer.values():
                nursery.start_soon(one, cand, items)
        return counted
