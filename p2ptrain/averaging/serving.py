"""The serving side of an all-reduce round: the RPC handlers a member answers its group with.

Theory of operation: as a reducer a member takes the slices of its partition (``on_part``: from members
only, at plausible weights, from the origins the leader saw, each checked against its sender's
commitment in an audited round; the refusals are the round machine's), and serves the reduced partition
(``on_fetch``), or its chunks as they are reduced, before the decision (``on_fetch_early``: pipelined
rounds); as the coordinator it answers reports with the signed decision (``on_report``); as any member
it relays the decision and the partitions it holds to members that cannot reach their reducer
(``on_relay_decision``, ``on_relay_result``). Every handler serves the round's members only, and no
longer than the round's deadlines. The averager dispatches a call to the :class:`RoundServer` of the
round it names.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from ..errors import CallRefused, P2PError, RemoteProtocolError
from ..net.rpc import CallContext, Reply
from ..net.streams import RpcStream
from .audit import new_hasher, open_commit
from .bandwidth import RateMeter
from .compression import Compression, encoded_chunk
from .partition import chunks
from .protocol import (
    NOT_HELD,
    ROUND_OVER,
    Ack,
    DecisionResp,
    FetchReq,
    LeaveReq,
    PartReq,
    RelayDecisionReq,
    ReportReq,
)
from .reducer import SliceOutOfBounds
from .round_machine import RoundMachine
from .round_tensors import RoundTensors
from .signals import RoundSignals

log = logging.getLogger("p2ptrain.averaging.allreduce")  # (the round's lines, as before)


class RoundServer:
    """A round's RPC handlers, over the round's machine and memory (handed by its driver)."""

    def __init__(
        self,
        machine: RoundMachine,
        tensors: RoundTensors,
        signals: RoundSignals,
        meter: RateMeter,
        point: Callable[[str], Awaitable[None]],
    ) -> None:
        self.m, self.t, self.sig, self.meter, self._point = machine, tensors, signals, meter, point
        self.tag = machine.digest.hex()[:8]

    async def on_part(self, ctx: CallContext, req: PartReq, stream: RpcStream) -> Ack:
        m, p = self.m, req.partition
        sender = m.member_of(ctx.peer)
        why = m.bad_weight(req.weight)
        if why:
            return Ack(False, why)
        why = m.distrust(sender, p, req.weight, ctx.remote_host, ctx.relayed, ctx.seen_at)
        if why:
            log.warning("round %s: %s: slice refused: %s", self.tag, m.name(sender), why)
            self.sig.changed.fire()
            return Ack(False, why)
        why = m.misplaced(p)
        if why:
            return Ack(False, why)
        if p != m.me:  # a failed reducer's partition: only once the decision names us
            with trio.move_on_at(m.at.gather):
                await self.sig.decided.wait()
            why = m.takes_over(p)
            if why:
                return Ack(False, why)
        red = self.t.reducers.get(p)
        if red is None or sender in red.touched or sender == m.me:
            return Ack(False, "duplicate or unexpected slice")
        if red.result is not None or red.finalizing:
            return Ack(False, "too late: the partition is reduced")
        late = "too late: this reducer already reported"
        try:
            try:  # what it signed of its slice: the slice must stay within it (and members bound by it)
                tag, scales = self.t.open_table(sender, req.scale)
            except RemoteProtocolError as e:
                m.bad_slice(sender, p, f"its signed scales: {e}")
                raise
            red.bound_sender(sender, scales[p], tag, req.weight)
            hasher = None
            if self.t.audit:  # the sender signed what it sends: check it as it arrives
                commit = open_commit(req.commit, ctx.peer, m.digest, p)
                if commit.weight != req.weight:
                    raise RemoteProtocolError("the commitment's weight is not the one sent")
                hasher = new_hasher()
            for index in range(len(red.spans)):
                data = await stream.receive_some()
                if p == m.me and not m.scatter_open:
                    return Ack(False, late)
                if red.result is not None or red.finalizing:  # (finalize may run in a thread)
                    return Ack(False, "too late: the partition is reduced")
                try:
                    if red.add_chunk(sender, index, data, req.weight):
                        self.sig.published.fire()
                except SliceOutOfBounds:
                    raise
                except RemoteProtocolError as e:  # malformed or not finite: its own bytes, proof enough
                    m.bad_slice(sender, p, str(e))
                    raise
                if hasher is not None:
                    hasher.update(data)
                if index == 0:
                    await self._point("mid_reduce")
            if await stream.receive_some():
                raise RemoteProtocolError("more data than the partition holds")
            if hasher is not None:
                if hasher.digest() != commit.hash:
                    why = "the slice does not match its sender's commitment"
                    m.bad_slice(sender, p, why)
                    raise RemoteProtocolError(why)
                red.commits[sender] = req.commit
            if p == m.me and not m.scatter_open:
                return Ack(False, late)
            why = self.t.cap_problem(p, sender, red.claimed)  # (against the signed scales at hand)
            if why:
                raise SliceOutOfBounds(why)
            red.complete(sender, req.weight)
            self.meter.flow_done("download")
            return Ack(True)
        except SliceOutOfBounds as e:  # (well formed, too large for us: refused, its sender left out)
            log.warning("round %s: %s: slice of partition %d refused: %s", self.tag, m.name(sender), p, e)
            m.sender_failed(p, sender)
            return Ack(False, str(e))
        except P2PError as e:
            log.info("slice of partition %d from %s failed: %s", p, m.name(sender), e)
            m.sender_failed(p, sender)
            raise
        finally:
            self.sig.changed.fire()

    async def on_report(self, ctx: CallContext, req: ReportReq) -> Reply[DecisionResp]:
        m = self.m
        member = m.member_of(ctx.peer)
        if m.coordinator is None:
            return Reply(DecisionResp(False))
        if req.delivered is not None:
            why = m.take_report(member, req)
            if why:
                log.info("report from %s ignored: %s", m.name(member), why)
            self.sig.changed.fire()
        with trio.move_on_at(m.at.await_decision):
            await self.sig.decided.wait()
        return Reply(DecisionResp(m.decision is not None), m.decision_bytes)

    async def on_leave(self, ctx: CallContext, req: LeaveReq) -> Ack:
        """A member says it left the round before it started (it declined the group): it sends nothing,
        so it counts as gone now, not at the scatter deadline. Only the caller itself: a member cannot
        speak for another, and one that lies about itself drops only its own contribution. Refused once
        the decision is in (who contributed is settled then)."""
        m = self.m
        sender = m.member_of(ctx.peer)
        if sender == m.me:
            return Ack(False, "a call from this member itself")
        if m.decision is not None:
            return Ack(False, "the round was decided already")
        if sender not in m.gone:
            line = m.member_gone(sender, "it left the round before it started", self.t.delivered(m.me))
            log.info("round %s: %s", self.tag, line)
            self.sig.changed.fire()
        return Ack(True)

    async def on_relay_decision(self, ctx: CallContext, req: RelayDecisionReq) -> Reply[DecisionResp]:
        self.m.member_of(ctx.peer)
        return Reply(DecisionResp(self.m.decision is not None), self.m.decision_bytes)

    async def on_fetch(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        m, p = self.m, req.partition
        member = m.member_of(ctx.peer)
        if p not in self.t.reducers and m.decision is None:
            with trio.move_on_at(m.at.gather):  # a replacement learns it is one from the decision
                await self.sig.decided.wait()
        red = self.t.reducers.get(p)
        if red is None:
            return Ack(False, f"this member does not reduce partition {p}")
        with trio.move_on_at(m.at.gather):
            await self.sig.finalized(p).wait()
        if self.sig.retired.is_set():
            raise CallRefused(ROUND_OVER, f"the round is over here: partition {p} is not served again")
        if red.encoded is None:
            return Ack(False, f"partition {p} was not reduced in time")
        with self.t.reading():
            for index, piece in enumerate(red.encoded):
                await stream.send(piece)
                if index == 0:
                    await self._point("during_gather")
            await self._send_tables(stream, red.scales, req.have)
            await stream.send_eof()
            self.meter.flow_done("upload")
        self._served(p, member)
        return Ack(True, attestation=red.attestation, scales=red.scales)

    async def on_fetch_early(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        """Serve this reducer's partition chunk by chunk as each is published (every member's copy of it
        is in), then answer, once the decision is in, whether those chunks are the result. They are
        unless the decision leaves someone out or changes a weight; then the member fetches again."""
        m, p = self.m, req.partition
        member = m.member_of(ctx.peer)
        red = self.t.reducers.get(p)
        if p != m.me or red is None or red.early is None:
            return Ack(False, f"no early results of partition {p} here")
        end = m.at.gather
        sent = 0
        with self.t.reading():
            while sent < len(red.spans):
                while red.ready <= sent and m.decision is None and trio.current_time() < end:
                    if self.sig.retired.is_set():
                        break
                    await self.sig.published.wait_until(end)
                if red.ready <= sent or red.early_final is False or self.t.reducers.get(p) is not red:
                    break  # no more will be published (the decision is in), or they are void
                assert red.early is not None
                await stream.send(red.early[sent])
                if sent == 0:
                    await self._point("during_gather")
                sent += 1
            if sent == len(red.spans):
                self.meter.flow_done("upload")
                with trio.move_on_at(end):
                    await self.sig.finalized(p).wait()
                if red.early_final and self.t.reducers.get(p) is red:
                    # The tables the fetcher lacks, which it names once it holds those of the slices it
                    # reduced itself (it did not as this stream began, during the scatter)
                    with trio.move_on_at(end):
                        have = await stream.receive_some()
                        await self._send_tables(stream, red.scales, have)
            await stream.send_eof()
        if sent == len(red.spans) and red.early_final and not self.sig.retired.is_set():
            self._served(p, member)
            return Ack(True, scales=red.scales)
        return Ack(False, f"the early results of partition {p} are not the round's; fetch it again")

    async def on_relay_result(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        m, p = self.m, req.partition
        m.member_of(ctx.peer)
        if p >= m.n:
            return Ack(False, f"partition {p} is not held here")
        end = m.at.gather
        while p not in m.held and not self.sig.retired.is_set() and trio.current_time() < end:
            if m.decision is not None and m.holder(p) in m.out_of_reach:  # (nor may we get it from there)
                raise CallRefused(NOT_HELD, f"partition {p} is not held here, and its holder is out of reach")
            await self.sig.changed.wait_until(end)  # answer once we hold it ourselves
        if self.sig.retired.is_set():
            raise CallRefused(ROUND_OVER, f"the round is over here: partition {p} is not relayed")
        if p not in m.held:
            return Ack(False, f"partition {p} is not held here")
        values = self.t.slice(p)
        with self.t.reading():
            for a, b in chunks(m.sizes[p], Compression.NONE):
                await stream.send(encoded_chunk(values[a:b], Compression.NONE))
            await self._send_tables(stream, self.t.scales.get(p, ()), req.have)
            await stream.send_eof()
        return Ack(True, scales=self.t.scales.get(p, ()))

    async def on_tables(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        """The signed scale tables of the decided contributors that the caller lacks (see ``TABLES``)."""
        m = self.m
        if not self.t.first_ask(m.member_of(ctx.peer)):
            return Ack(False, "this member was sent the round's tables already")
        with trio.move_on_at(m.at.gather):
            await self.sig.decided.wait()
        decision = m.decision
        if decision is None:
            return Ack(False, "no decision here")
        tags = tuple(next(iter(self.t.tables.get(c, {})), b"") for c in decision.contributors)
        await self._send_tables(stream, tags, req.have)
        await stream.send_eof()
        return Ack(True, scales=tags)

    async def _send_tables(
        self, stream: RpcStream, tags: tuple[bytes, ...], have: bytes | memoryview
    ) -> None:
        """After a result: the signed scale tables of its contributors (``tags``) that the fetcher does
        not hold (``have``: the tags it holds, ``RoundTensors.have``), one per body chunk, each sent once
        (see ``bounds``)."""
        decision = self.m.decision
        if decision is None or len(tags) != len(decision.contributors):
            return
        for sealed in self.t.missing(tags, decision.contributors, bytes(have)):
            await stream.send(sealed)

    def _served(self, p: int, member: int) -> None:
        if self.m.served(p, member):
            self.sig.done.set()
