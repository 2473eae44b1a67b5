"""Whether another group of a split swarm's region took a step, asked of the peers that would know as a
round lands (``train.taken``).

Where the swarm is split into regions (``progress.regions``), each region's step is taken by one group,
and a group of it is held to a majority of the region's peers on the step as its leader sees them. At a
swarm's first step, where every peer is a newcomer that trusts only its join peers and the records of a
region's peers are still arriving, two groups of one region can form at once. A member about to apply
its round then checks that no peer it trusts, of its region and outside its group, took the step by
another round: what it could have known of. The records read last say so only once the other group's
record is read (``ProgressBoard.taken_elsewhere``): two rounds that land within one read of each other
were both applied (256 simulated peers, the first step: a member of a group that landed 1.9 s after
another trusted one of that other's members, its join peer). So the member also asks those peers
directly, one round trip, before it applies:

- each peer answers whether a round of its own committed the step (:meth:`TakenSteps.committed`, noted
  as the round's result comes in, before the peer checks or applies it, and forgotten if it is not
  applied after all);
- the asking member has noted its own round's result the same way before it asks.

So of two members of different groups of one step that trust each other, at least one hears of the
other's round, whatever the order: each noted its own before it asked. The one that hears drops its
copy (both may: the step is then taken by the others of their groups, or taken again, never twice by
one pair of peers that trust each other). A member asks every peer it trusts of its region at the step
(which a peer's id gives) and outside its group, whatever its record says or whether one was read
(``ProgressBoard.landing_witnesses``: those on the step or past it first; at most ``ASKED``); asking
only those whose records put them on the step or the one before missed a peer that had taken the step
and moved on (its new record is under its next step's keys), and a group of 2 applied its round 5 s
after a group of 14 holding the one peer of its region a member trusted (128 simulated peers, 48 slots
a node). Free ids are never asked, so none can make it drop a round. A trusted peer that lies can, as
its record could make it skip one.

Silence from a witness that is alive is not a "no". A node whose inbound slots are all in use answers a
newcomer "busy" (``net.admission``), and a landing member is often a newcomer to the peers it trusts (a
newcomer trusts its join peers, which have never trained with it). Taken as a "no", "busy" lets a member
apply its round of a step that a peer it trusts took; at 128 simulated peers with 48 slots a node, two
runs of five had a region's step with two states (in one, a member of a group of one, 2.9 s after a
group of 17 holding the peer it trusted), and none of three runs since. So an asker keeps asking a
witness that answers "busy" until ``WAIT``, and one that is still busy then makes it drop its copy, as a
"took" would: the witness is alive and on the step, and could have taken it. A witness that cannot be
reached at all, or does not answer within ``WAIT``, says nothing (it is gone, or as good as): the round
lands as it would have before. What this costs: a member drops its copy (it catches up to its region's
state) whenever a witness it trusts is busy for ``WAIT``; free ids are never asked, so none can make it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import trio

from ...errors import ConnectionClosed, P2PError, passing
from ...identity import PeerID
from ...net.address import PeerAddress
from ...net.rpc import CallContext, Method
from ...node import Node
from ...wire.schema import Message, bounded
from .board import ProgressBoard

log = logging.getLogger("p2ptrain.training.collaborative")

ASKED = 16  # trusted peers of the region a landing member asks, at most
WAIT = 2.0  # seconds a landing member waits for their answers, at most
RETRY = 0.25  # seconds between the asks of a witness that said "busy" or whose connection closed
KEPT = 16  # steps whose committed rounds a peer remembers (answers about older ones say no)


@dataclass(frozen=True)
class TakenReq(Message):
    epoch: int = bounded(ge=0, le=2**53)  # the step asked about


@dataclass(frozen=True)
class TakenResp(Message):
    took: bool = False  # a round of the answering peer committed that step, and was applied or is landing


TAKEN = Method("train.taken", TakenReq, TakenResp)


class TakenSteps:
    """The steps this peer's rounds committed, served to the peers of its region that ask as their
    rounds land, and the asking itself (see the module's docstring)."""

    def __init__(self, node: Node, board: ProgressBoard) -> None:
        self.node, self.board = node, board
        self._took: OrderedDict[int, None] = OrderedDict()
        self.asked = 0  # peers asked so far
        self.busy = 0  # copies not applied because a witness stayed busy

    def serve(self) -> None:
        """Answer ``train.taken`` (until :meth:`release`)."""
        self.node.host.registry.add_unary(TAKEN, self._on_taken)

    def release(self) -> None:
        self.node.host.registry.release(self)

    def committed(self, epoch: int) -> None:
        """A round of this peer committed step ``epoch``: noted before the round lands."""
        self._took.pop(epoch, None)
        self._took[epoch] = None
        while len(self._took) > KEPT:
            self._took.popitem(last=False)

    def dropped(self, epoch: int) -> None:
        """The committed round of ``epoch`` was not applied here after all."""
        self._took.pop(epoch, None)

    def took(self, epoch: int) -> bool:
        return epoch in self._took

    async def _on_taken(self, ctx: CallContext, req: TakenReq) -> TakenResp:
        return TakenResp(took=self.took(req.epoch))

    async def elsewhere(self, epoch: int, group: frozenset[PeerID]) -> str:
        """Why this peer must not apply its copy of a committed round of ``epoch`` (``group``'s: the
        round's contributors, never the manifest's members, some of which may have declined it and taken
        the step in another group), or "" where nothing it could know of says so: a peer it trusts, of
        its region at ``epoch`` and outside ``group``, took the step by another round, by the records
        read last (``ProgressBoard.taken_elsewhere``), else by its own answer now; or such a peer stayed
        "busy" until ``WAIT`` (see the module's docstring)."""
        taken = self.board.taken_elsewhere(epoch, group)
        if taken is not None:
            return _took(taken, epoch)
        asked = self.board.landing_witnesses(epoch, group)[:ASKED]
        if not asked:
            return ""
        self.asked += len(asked)
        said: list[PeerID] = []
        busy: dict[PeerID, None] = {}  # witnesses whose last answer was "busy"

        async def ask(peer: PeerID, addr: PeerAddress | None) -> None:
            while True:
                try:
                    if addr is not None:
                        conn = await self.node.host.connect(addr)
                    else:  # (no record names its address: a connection held with it, if any)
                        held = self.node.host.connection(peer)
                        if held is None:
                            return
                        conn = held
                    if conn.peer != peer:
                        return
                    resp = await conn.call(TAKEN, TakenReq(epoch), timeout=WAIT)
                except P2PError as e:
                    if not passing(e):
                        log.debug("could not ask %s whether it took step %d: %s", peer.short(), epoch, e)
                        busy.pop(peer, None)
                        return
                    if not isinstance(e, ConnectionClosed):  # (closed under the ask: not proof it is busy)
                        busy[peer] = None
                    await trio.sleep(RETRY)
                    continue
                except ValueError as e:
                    log.debug("could not ask %s whether it took step %d: %s", peer.short(), epoch, e)
                    busy.pop(peer, None)
                    return
                busy.pop(peer, None)
                if resp.took:
                    said.append(peer)
                    nursery.cancel_scope.cancel()  # (one is enough)
                return

        with trio.move_on_after(WAIT):
            async with trio.open_nursery() as nursery:
                for peer, addr in asked:
                    nursery.start_soon(ask, peer, addr)
        if said:
            return _took(said[0], epoch)
        if busy:
            self.busy += 1
            peer = next(iter(busy))
            return (
                f"{peer.short()}, a peer it trusts, of its region on step {epoch}, stayed busy for "
                f"{WAIT:g} s: it could have taken the step"
            )
        return ""


def _took(peer: PeerID, epoch: int) -> str:
    return f"a group of {peer.short()}, a peer it trusts, took its region's step {epoch}"
