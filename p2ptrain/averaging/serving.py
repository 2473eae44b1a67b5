"""The serving side of an all-reduce round: the RPC handlers a member answers its group with.

As a reducer it takes the slices of its partition (``on_part``: from members only, at plausible
weights, from the origins the leader saw, each checked against its sender's commitment in an audited
round), and serves the reduced partition (``on_fetch``), or its chunks as they are reduced, before the
decision (``on_fetch_early``: pipelined rounds); as the coordinator it answers reports with the signed
decision (``on_report``); as any member it relays the decision and the partitions it holds to members
that cannot reach their reducer (``on_relay_decision``, ``on_relay_result``). Every handler serves the
round's members only, and no longer than the round's deadlines.

:class:`RoundServing` is a mixin of :class:`~p2ptrain.averaging.allreduce.AllReduceRound`, which owns
the attributes declared below.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import torch
import trio

from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..net.rpc import CallContext, Reply
from ..net.streams import RpcStream
from .agreement import WEIGHT_SLACK, Coordinator
from .audit import new_hasher, open_commit
from .bandwidth import RateMeter
from .compression import Compression, encoded_chunk
from .partition import chunks
from .protocol import Ack, Decision, DecisionResp, FetchReq, PartReq, RelayDecisionReq, ReportReq
from .reducer import PartitionReducer
from .rules import SeenOrigins

log = logging.getLogger("p2ptrain.averaging.allreduce")  # (the round's lines, as before)


class Signal:
    """A level-triggered 'something changed' for tasks that re-check a condition."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self._event.wait()


class RoundServing:
    """The round's RPC handlers (a mixin)."""

    # Owned by AllReduceRound:
    digest: bytes
    peers: list[PeerID]
    n: int
    me: int
    sizes: list[int]
    audit: bool
    deadline: dict[str, float]
    seen: set[int]
    caps: dict[int, float]
    origins: SeenOrigins
    failed_senders: dict[int, set[int]]
    reducers: dict[int, PartitionReducer]
    scatter_open: bool
    coordinator: Coordinator | None
    decision: Decision | None
    decision_bytes: bytes
    decided: trio.Event
    finalized: dict[int, trio.Event]
    held: set[int]
    fetches_left: int
    finished: bool
    done: trio.Event
    retired: trio.Event
    streaming: int
    changed: Signal
    published: Signal
    meter: RateMeter
    name: Callable[[int], str]
    _point: Callable[[str], Awaitable[None]]
    _release: Callable[[], None]
    _slice: Callable[[int], torch.Tensor]

    def _sender(self, ctx: CallContext) -> int:
        try:
            i = self.peers.index(ctx.peer)
        except ValueError:
            raise RemoteProtocolError(f"{ctx.peer.short()} is not a member of this round") from None
        self.seen.add(i)
        return i

    async def on_part(self, ctx: CallContext, req: PartReq, stream: RpcStream) -> Ack:
        sender = self._sender(ctx)
        p = req.partition
        if not (math.isfinite(req.weight) and req.weight > 0):
            return Ack(False, "the weight must be positive and finite")
        cap = self.caps.get(sender)
        why = self.origins.refusal(sender, ctx.remote_host, ctx.relayed, ctx.seen_at)
        if cap is not None and req.weight > WEIGHT_SLACK * cap:
            why = f"weight {req.weight:g} is over {WEIGHT_SLACK:g} x the {cap:g} its records make plausible"
        if why:
            log.warning("round %s: %s: slice refused: %s", self.digest.hex()[:8], self.name(sender), why)
            if p == self.me:  # its slice will not come: this reducer need not wait for it to report
                self.failed_senders.setdefault(p, set()).add(sender)
                self.changed.fire()
            return Ack(False, why)
        if p >= self.n or self.sizes[p] == 0:
            return Ack(False, f"partition {p} does not exist")
        if p != self.me:  # a failed reducer's partition: only once the decision names us
            with trio.move_on_at(self.deadline["gather"]):
                await self.decided.wait()
            if self.decision is None or self.decision.replacement_of(p) != self.me:
                return Ack(False, f"this member does not reduce partition {p}")
        elif not self.scatter_open:
            return Ack(False, "too late: this reducer already reported")
        red = self.reducers.get(p)
        if red is None or sender in red.touched or sender == self.me:
            return Ack(False, "duplicate or unexpected slice")
        try:
            hasher = None
            if self.audit:  # the sender signed what it sends: check it as it arrives
                commit = open_commit(req.commit, ctx.peer, self.digest, p)
                if commit.weight != req.weight:
                    raise RemoteProtocolError("the commitment's weight is not the one sent")
                hasher = new_hasher()
            for index in range(len(red.spans)):
                data = await stream.receive_some()
                if p == self.me and not self.scatter_open:
                    return Ack(False, "too late: this reducer already reported")
                if red.result is not None:
                    return Ack(False, "too late: the partition is reduced")
                if red.add_chunk(sender, index, data, req.weight):
                    self.published.fire()
                if hasher is not None:
                    hasher.update(data)
                if index == 0:
                    await self._point("mid_reduce")
            if await stream.receive_some():
                raise RemoteProtocolError("more data than the partition holds")
            if hasher is not None:
                if hasher.digest() != commit.hash:
                    raise RemoteProtocolError("the slice does not match its sender's commitment")
                red.commits[sender] = req.commit
            if p == self.me and not self.scatter_open:
                return Ack(False, "too late: this reducer already reported")
            red.complete(sender, req.weight)
            self.meter.flow_done("download")
            return Ack(True)
        except P2PError as e:
            log.info("slice of partition %d from %s failed: %s", p, self.name(sender), e)
            self.failed_senders.setdefault(p, set()).add(sender)
            raise
        finally:
            self.changed.fire()

    async def on_report(self, ctx: CallContext, req: ReportReq) -> Reply[DecisionResp]:
        member = self._sender(ctx)
        if self.coordinator is None:
            return Reply(DecisionResp(False))
        if req.delivered is not None:
            if len(req.weights) != len(req.delivered):
                raise RemoteProtocolError("one weight per delivered sender")
            why = self.coordinator.report(member, dict(zip(req.delivered, req.weights, strict=True)))
            if why:
                log.info("report from %s ignored: %s", self.name(member), why)
            self.changed.fire()
        with trio.move_on_at(self.deadline["await"]):
            await self.decided.wait()
        return Reply(DecisionResp(self.decision is not None), self.decision_bytes)

    async def on_relay_decision(self, ctx: CallContext, req: RelayDecisionReq) -> Reply[DecisionResp]:
        self._sender(ctx)
        return Reply(DecisionResp(self.decision is not None), self.decision_bytes)

    async def on_fetch(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        member = self._sender(ctx)
        if req.partition not in self.reducers and self.decision is None:
            with trio.move_on_at(self.deadline["gather"]):  # a replacement learns it is one from the decision
                await self.decided.wait()
        red = self.reducers.get(req.partition)
        if red is None:
            return Ack(False, f"this member does not reduce partition {req.partition}")
        event = self.finalized.setdefault(req.partition, trio.Event())
        with trio.move_on_at(self.deadline["gather"]):
            await event.wait()
        if red.encoded is None or self.retired.is_set():
            return Ack(False, f"partition {req.partition} was not reduced in time")
        self.streaming += 1
        try:
            for index, piece in enumerate(red.encoded):
                await stream.send(piece)
                if index == 0:
                    await self._point("during_gather")
            await stream.send_eof()
            self.meter.flow_done("upload")
        finally:
            self.streaming -= 1
            self._release()
        self._served(member)
        return Ack(True, attestation=red.attestation)

    async def on_fetch_early(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        """Serve this reducer's partition chunk by chunk as each is published (every member's copy of it
        is in), then answer, once the decision is in, whether those chunks are the result. They are
        unless the decision leaves someone out or changes a weight; then the member fetches again."""
        member = self._sender(ctx)
        p = req.partition
        red = self.reducers.get(p)
        if p != self.me or red is None or red.early is None:
            return Ack(False, f"no early results of partition {p} here")
        end = self.deadline["gather"]
        sent = 0
        self.streaming += 1
        try:
            while sent < len(red.spans):
                while red.ready <= sent and self.decision is None and trio.current_time() < end:
                    if self.retired.is_set():
                        break
                    await self.published.wait_until(end)
                if red.ready <= sent or red.early_final is False or self.reducers.get(p) is not red:
                    break  # no more will be published (the decision is in), or they are void
                assert red.early is not None
                await stream.send(red.early[sent])
                if sent == 0:
                    await self._point("during_gather")
                sent += 1
            if sent == len(red.spans):
                self.meter.flow_done("upload")
                with trio.move_on_at(end):
                    await self.finalized.setdefault(p, trio.Event()).wait()
            await stream.send_eof()
        finally:
            self.streaming -= 1
            self._release()
        if sent == len(red.spans) and red.early_final and not self.retired.is_set():
            self._served(member)
            return Ack(True)
        return Ack(False, f"the early results of partition {p} are not the round's; fetch it again")

    async def on_relay_result(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        self._sender(ctx)
        p = req.partition
        if p >= self.n:
            return Ack(False, f"partition {p} is not held here")
        end = self.deadline["gather"]
        while p not in self.held and not self.retired.is_set() and trio.current_time() < end:
            await self.changed.wait_until(end)  # answer once we hold it ourselves
        if p not in self.held or self.retired.is_set():
            return Ack(False, f"partition {p} is not held here")
        values = self._slice(p)
        self.streaming += 1
        try:
            for a, b in chunks(self.sizes[p], Compression.NONE):
                await stream.send(encoded_chunk(values[a:b], Compression.NONE))
            await stream.send_eof()
        finally:
            self.streaming -= 1
            self._release()
        return Ack(True)

    def _served(self, member: int) -> None:
        self.fetches_left -= 1
        if self.finished and self.fetches_left <= 0:
            self.done.set()
