"""The gathering side of an all-reduce round: each partition's result, reduced, attested and fetched.

After the decision, a partition's reducer (or the replacement the decision names) computes its result
over exactly the decided contributors (``_finalize``; attested in an audited round) and every member
fetches every partition (``_gather``): from its holder, and once that fails or stalls for
``STALLED_AFTER`` seconds, from the other members too, who relay it once they hold it. In a pipelined
round a member fetches each partition's mean chunk by chunk while the scatter still runs
(``_fetch_early``), held once its reducer confirms the chunks are the round's result. Every fetched chunk
is checked (size, finite values, in an audited round the reducer's signed attestation) before the
partition counts as held.

:class:`RoundGathering` is a mixin of :class:`~p2ptrain.averaging.allreduce.AllReduceRound`, which owns
the attributes declared below.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable

import numpy as np
import torch
import trio

from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..net.host import Host
from . import spill
from .audit import Attestation, hash_pieces, new_hasher, open_attestation, seal_attestation
from .bandwidth import RateMeter
from .compression import Compression, all_finite, decode, encoded_chunk
from .partition import chunks
from .protocol import FETCH, FETCH_EARLY, RELAY_RESULT, Decision, FetchReq, Manifest
from .reducer import PartitionReducer
from .serving import Signal
from .spill import Spilled, SpillFile

log = logging.getLogger("p2ptrain.averaging.allreduce")  # (the round's lines, as before)

RELAY_RETRY = 0.25  # seconds between rounds of relay queries
STALLED_AFTER = 2.0  # seconds a fetch may receive nothing before the other members are asked too


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` for a call's own timeout (an enclosing scope enforces the deadline)."""
    return max(1e-3, deadline - trio.current_time())


class RoundGathering:
    """Finalizing the partitions reduced here and fetching every partition (a mixin)."""

    # Owned by AllReduceRound:
    host: Host
    manifest: Manifest
    digest: bytes
    peers: list[PeerID]
    n: int
    me: int
    mode: Compression
    sizes: list[int]
    audit: bool
    deadline: dict[str, float]
    reducers: dict[int, PartitionReducer]
    decision: Decision | None
    finalized: dict[int, trio.Event]
    held: set[int]
    fetches_left: int
    progress: dict[int, float]
    early_done: dict[int, trio.Event]
    early_scopes: dict[int, trio.CancelScope]
    overwritten: set[int]
    gone: set[int]
    attestations: dict[int, bytes]
    flat: torch.Tensor
    source: torch.Tensor
    backup: SpillFile | None
    saved: dict[int, Spilled]
    changed: Signal
    meter: RateMeter
    name: Callable[[int], str]
    _point: Callable[[str], Awaitable[None]]
    _slice: Callable[[int], torch.Tensor]
    _pieces: Callable[[int], tuple[Iterable[bytes | memoryview], bytes]]

    async def _finalize(self, p: int, decision: Decision) -> None:
        red = self.reducers[p]
        event = self.finalized.setdefault(p, trio.Event())
        while not all(i in red.delivered for i in decision.contributors):
            if trio.current_time() >= self.deadline["gather"]:
                log.info("partition %d: not every contributor re-sent its slice in time", p)
                return
            await self.changed.wait_until(self.deadline["gather"])
        red.finalize(decision.contributors, decision.weights)
        for sender, ratio in red.outliers:
            log.warning(
                "round %s: the slice of partition %d from %s is an outlier (%s the median distance to "
                "the %s result): its influence was bounded",
                self.digest.hex()[:8],
                p,
                self.name(sender),
                "NaN times" if math.isnan(ratio) else f"{ratio:.0f}x",
                red.aggregation,
            )
        await self._point("after_reduce")  # (a test's fault hook may tamper with the result here)
        if self.audit:
            red.attestation = self._attest(p, red, decision)
        assert red.result is not None
        if red.result.data_ptr() != self._slice(p).data_ptr():  # (compressed, or not reduced in flat)
            self._slice(p).copy_(red.result)
        self.held.add(p)
        self.fetches_left += self.n - 1
        event.set()
        self.changed.fire()

    def _attest(self, p: int, red: PartitionReducer, decision: Decision) -> bytes:
        assert red.encoded is not None
        att = Attestation(
            round=self.digest,
            partition=p,
            contributors=decision.contributors,
            weights=decision.weights,
            commits=tuple(red.commits[c] for c in decision.contributors),
            result=hash_pieces(red.encoded),
        )
        return seal_attestation(self.host.identity, att)

    def _check_attestation(self, p: int, frm: int, data: bytes, result_hash: bytes) -> None:
        """The reducer's attestation fits the decision, the bytes it served, and this member's own
        commitment; RemoteProtocolError says what does not."""
        decision = self.decision
        assert decision is not None
        att = open_attestation(data, self.peers[frm], self.digest, p, self.n)
        if att.contributors != decision.contributors or att.weights != decision.weights:
            raise RemoteProtocolError("its attestation names other contributors or weights than the decision")
        if att.result != result_hash:
            raise RemoteProtocolError("the result it served is not the one it attested")
        # (Ed25519 signatures are deterministic: our commitment, made again, is the same bytes)
        if self.me in att.contributors and att.commits[att.contributors.index(self.me)] != self._pieces(p)[1]:
            raise RemoteProtocolError("its attestation does not carry this member's commitment")
        self.attestations[p] = bytes(data)

    async def _gather(self, p: int, holder: int) -> None:
        if holder == self.me:
            event = self.finalized.setdefault(p, trio.Event())
            with trio.move_on_at(self.deadline["gather"]):
                await event.wait()
            return
        self.progress[p] = trio.current_time()
        if p in self.early_done:
            # The early fetch confirms once its reducer has the decision: wait while it makes progress.
            done = self.early_done[p]
            while holder == p and not done.is_set():
                stalled_at = min(self.progress[p] + STALLED_AFTER, self.deadline["gather"])
                if trio.current_time() >= stalled_at:
                    break
                with trio.move_on_at(stalled_at):
                    await done.wait()
            self.early_scopes[p].cancel()
            await done.wait()
            if p in self.held:
                return
        direct_failed = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._fetch_from_holder, nursery.cancel_scope, p, holder, direct_failed)
            # The others fetch from the holder too: once the direct fetch failed, or stalled (a reducer
            # that serves some members and then hangs), ask them as well; each answers once it holds it.
            with trio.move_on_at(self.deadline["gather"]):
                while not direct_failed.is_set():
                    stalled_at = self.progress[p] + STALLED_AFTER
                    if trio.current_time() >= stalled_at:
                        break
                    with trio.move_on_at(stalled_at):
                        await direct_failed.wait()
                while p not in self.held:
                    async with trio.open_nursery() as relays:
                        for i, m in enumerate(self.manifest.members):
                            if i not in (self.me, holder) and m.addr:
                                relays.start_soon(self._relay_from, relays.cancel_scope, p, i)
                    if p not in self.held:
                        await trio.sleep(RELAY_RETRY)  # every relay failed at once: they may be back
            nursery.cancel_scope.cancel()

    async def _fetch_from_holder(
        self, scope: trio.CancelScope, p: int, holder: int, failed: trio.Event
    ) -> None:
        """Fetch partition ``p`` from its reducer, again after a pause if that failed while it lives."""
        while trio.current_time() < self.deadline["gather"]:
            if await self._fetch(p, holder, FETCH):
                scope.cancel()
                return
            failed.set()
            if holder in self.gone:
                return
            await trio.sleep(STALLED_AFTER)

    async def _relay_from(self, scope: trio.CancelScope, p: int, i: int) -> None:
        if await self._fetch(p, i, RELAY_RESULT):
            scope.cancel()

    async def _fetch(self, p: int, frm: int, method: object) -> bool:
        """Fetch partition ``p`` from member ``frm`` (its reducer, or a relay); True once held."""
        relay = method is RELAY_RESULT
        mode = Compression.NONE if relay else self.mode
        target = self._slice(p)
        spans = list(chunks(self.sizes[p], mode))
        try:
            with trio.fail_after(max(0.0, self.deadline["gather"] - trio.current_time())):
                conn = await self.host.connect(self.manifest.members[frm].addr)
                async with conn.open_stream(
                    RELAY_RESULT if relay else FETCH,
                    FetchReq(self.digest, p),
                    timeout=time_left(self.deadline["gather"]),
                ) as stream:
                    hasher = new_hasher() if self.audit and not relay else None
                    for a, b in spans:
                        data = await stream.receive_some()
                        if not data:
                            ack = await stream.response()
                            raise RemoteProtocolError(ack.reason or "the stream ended early")
                        if p in self.held:  # another relay was faster; its bits are the same
                            return True
                        _store(target[a:b], data, mode, 0 if relay else self.n)
                        self.progress[p] = trio.current_time()
                        if hasher is not None:
                            hasher.update(data)
                    if hasher is not None:  # held only once the reducer's signed attestation checks out
                        ack = await stream.response()
                        self._check_attestation(p, frm, ack.attestation, hasher.digest())
                        self.held.add(p)
                        self.changed.fire()
                        return True
                    self.held.add(p)  # every byte is here: ours, whatever happens to the call now
                    self.meter.flow_done("download")
                    self.changed.fire()
                    await stream.response()  # let the server finish (it counts who fetched)
        except (P2PError, trio.TooSlowError) as e:
            if p in self.held:
                return True
            if not relay:
                log.info("could not fetch partition %d from %s: %s", p, self.name(frm), e)
            return False
        self.changed.fire()
        return True

    async def _fetch_early(self, p: int) -> None:
        """Fetch partition ``p``'s mean from its reducer chunk by chunk while the scatter runs, into
        ``flat``; held once the reducer confirms the chunks are the round's result (else the gather
        fetches it again)."""
        target, spans = self._slice(p), list(chunks(self.sizes[p], self.mode))
        got = 0
        try:
            with (
                self.early_scopes[p],
                trio.fail_after(max(0.0, self.deadline["gather"] - trio.current_time())),
            ):
                conn = await self.host.connect(self.manifest.members[p].addr)
                async with conn.open_stream(
                    FETCH_EARLY, FetchReq(self.digest, p), timeout=time_left(self.deadline["gather"])
                ) as stream:
                    if self.backup is not None and p not in self.saved and not await self._save(p):
                        return  # no backup, no early averages: the gather fetches them after the decision
                    if self.source is self.flat:
                        self.overwritten.add(p)
                    if self.mode is Compression.NONE:  # decrypted straight into place: no copy
                        stream.land_in(target[a:b].numpy().data for a, b in spans)
                    for a, b in spans:
                        data = await stream.receive_some()
                        if not data:
                            break
                        _store(target[a:b], data, self.mode, self.n)
                        self.progress[p] = trio.current_time()
                        got += 1
                    if got == len(spans):
                        self.meter.flow_done("download")
                    ack = await stream.response()
                if ack.ok and got == len(spans):
                    self.held.add(p)
                    self.changed.fire()
        except (P2PError, trio.TooSlowError) as e:
            log.debug("no early result of partition %d from %s: %s", p, self.name(p), e)
        finally:
            self.early_done[p].set()

    async def _save(self, p: int) -> bool:
        """In place: this member's values of partition ``p`` to the backup, before results overwrite them
        (in a worker thread when large; nothing writes into the partition meanwhile). False if the
        backup cannot be written (a full disk)."""
        assert self.backup is not None
        data = encoded_chunk(self._slice(p), Compression.NONE)
        try:
            saved = await spill.put(self.backup, data)
        except OSError as e:
            log.warning("cannot back partition %d up (%s): fetching its average after the decision", p, e)
            return False
        self.saved[p] = saved
        return True


def _store(target: torch.Tensor, data: memoryview, mode: Compression, members: int) -> None:
    """Decode a fetched chunk (a reduced sum of ``members``: see ``compression.encode``) into its
    place; RemoteProtocolError if it is malformed or not finite."""
    if mode is not Compression.NONE:
        target.copy_(decode(data, mode, target.numel(), members))
        return
    if len(data) != 4 * target.numel():
        raise RemoteProtocolError(f"a chunk of {len(data)} bytes where {4 * target.numel()} were expected")
    place, values = target.numpy(), np.frombuffer(data, dtype=np.float32)
    if values.ctypes.data != place.ctypes.data:  # not decrypted in place (RpcStream.land_in): copy
        place[:] = values
    if not all_finite(target):
        raise RemoteProtocolError("a reduced partition holds NaN or infinite values")
