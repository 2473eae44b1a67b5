"""When a peer alone on its epoch may step, and when a group may form without the peers one step behind.

A step alone is the one move that can fork a swarm: taken while the others are only late (records
slow to arrive under load, a joiner still bootstrapping, peers catching up) or while this peer is the
one cut off, it starts a second lineage under the swarm's step numbers. So a peer steps alone at once
only when it never saw another peer of the run; otherwise it waits an averaging timeout for them, and
then only if some peer still answers its pings (``_out_of_touch``). Peers that said they left are not
waited for. Likewise a group forms only once the peers on this epoch are a majority of those on it and
one behind (:meth:`StepAlone.majority_here`), or that has not happened within an averaging timeout.

:class:`StepAlone` owns what these rules remember: the partners seen (fed by the progress board after
each read, :meth:`StepAlone.observe`), since when this peer waits alone, whether it is cut off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ...config import RunConfig
from ...identity import PeerID
from ...node import Node
from .progress import PeerProgress, SwarmView

log = logging.getLogger("p2ptrain.training.collaborative")  # (the optimizer's lines, as before)

PROBE_TIMEOUT = 5.0  # seconds a peer alone waits for a ping's answer before it counts as out of touch


class StepAlone:
    """The rules for steps without a group and for groups without the laggards."""

    def __init__(self, node: Node, config: RunConfig, fingerprint: bytes, clock: Callable[[], float]) -> None:
        self.node, self.config, self.fingerprint, self.clock = node, config, fingerprint, clock
        self._nursery: trio.Nursery | None = None
        self._started = 0.0
        self._alone_since: float | None = None
        self.cut_off = False  # out of touch with every peer (see ``_out_of_touch``): said once
        self._probe: trio.Event | None = None  # set when the probe started then has an answer ...
        self.answered = False  # ... this one: did any peer answer its ping
        # Peers of the run seen live that did not say they left: while any is missing from the records,
        # stepping alone waits (once) for it. Keyed by id: a record can only say its own peer left.
        self._partners: set[PeerID] = set()
        self._lagging: tuple[int, float] | None = None  # (epoch, since when) peers here were no majority
        self._seeded = False  # _partners took in the partners a checkpoint remembers (may_step_alone)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the probes; the time this peer started counts from here."""
        self._started = self.clock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def observe(self, view: SwarmView, records: list[PeerProgress], epoch: int) -> None:
        """The progress board read the swarm (``view`` from ``records``): partners met and left."""
        if view.peers > 1 or view.behind:
            if self.cut_off:
                log.info("back in touch with the swarm on step %d", epoch)
            self.cut_off = False
        for r in records:
            if r.peer == self.node.peer_id or r.record.run != self.fingerprint:
                continue
            if r.record.leaving:
                self._partners.discard(r.peer)
            else:
                self._partners.add(r.peer)

    def stepped(self) -> None:
        """A global step was taken: the wait alone starts again."""
        self._alone_since = None

    def majority_here(self, view: SwarmView, epoch: int) -> bool:
        """Whether the peers on this epoch are a majority of those on it and one step behind (the group
        quorum, see ``progress``): until then no group forms, for at most an averaging timeout. Those
        behind then are stuck (a download that keeps failing), and a group of everyone here goes on."""
        if view.quorum <= view.peers:
            self._lagging = None
            return True
        now = self.clock()
        if self._lagging is None or self._lagging[0] != epoch:
            self._lagging = (epoch, now)
            log.info(
                "step %d: %d peer(s) here, a group needs %d: waiting for those one step behind",
                epoch,
                view.peers,
                view.quorum,
            )
        return now - self._lagging[1] >= self.config.averaging.timeout

    def may_step_alone(
        self, view: SwarmView, records: list[PeerProgress], epoch: int, met_swarm: bool
    ) -> bool:
        """Alone on this epoch: step alone if no other peer was ever seen in the run, or if the others
        (catching up, or gone from the records) have not reached this epoch within an averaging timeout
        (until then, keep accumulating: a step taken now would leave them behind, and the samples are
        not lost, only the batch grows). Records can vanish for a while when the DHT is slow under load
        (a record that arrives after its expiry is refused): a peer that stepped on alone at once would
        fork the swarm at the first such gap. ``met_swarm``: records were read once the DHT had
        bootstrapped."""
        now = self.clock()
        if now - self._started < 2 * self.config.progress.interval:
            return False  # the others' records may not have reached us yet
        if not self._seeded:
            # A peer resumed from a checkpoint waits for the peers it trained with (remembered there)
            # as for those it meets in the records: its first steps alone would fork their swarm.
            self._seeded = True
            self._partners |= self.node.averager.partners
        joining = self.node.config.join and not met_swarm
        if joining and now - self._started < self.config.averaging.timeout:
            # A joiner that has not read the swarm's records yet (its DHT still bootstraps: behind a
            # NAT that includes a dial-back that times out) would fork the swarm with a step of its own.
            return False
        if not self._partners:
            self._alone_since = None
            return True
        if self._alone_since is None:
            self._alone_since = now
            what = f"{view.others} peer(s) catch up" if view.others else "the others' records are missing"
            log.info("alone on step %d while %s: waiting for them", epoch, what)
        if now - self._alone_since >= self.config.averaging.timeout:
            if self._out_of_touch(epoch):
                return False
            log.warning("no peer joined within %.0f s: stepping alone", self.config.averaging.timeout)
            self._alone_since = None
            # Those still missing from the records are gone: later steps do not wait for them again.
            live = {r.peer for r in records if r.record.run == self.fingerprint and not r.record.leaving}
            self._partners &= live
            return True
        return False

    def _out_of_touch(self, epoch: int) -> bool:
        """Whether no peer at all answers this one: it may be the one cut off (its router's mapping
        gone, the only public peer it reached others through left), not the others gone. A step alone
        then would start a second lineage under the swarm's step numbers, so it waits: its batches keep
        accumulating and join the next round when the swarm is back on this step, or give way to the
        swarm's state if it moved on (the DHT bootstraps again meanwhile, from the join addresses and
        the remembered peers). Known by pinging every connected peer, in the background: until the
        answer, it waits; with no answer, it waits another averaging timeout (the swarm's records need
        that long to reach it once it is back in touch) and asks again. Peers that said they left are
        not waited for."""
        if self._probe is None:
            self._probe = trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._run_probe, self._probe)
            return True
        if not self._probe.is_set():
            return True
        answered, self._probe = self.answered, None
        if answered and self.cut_off:
            # Back in touch after being cut off, but the swarm's records not read yet: they say where
            # the swarm went (ahead, most likely). A step alone before them would fork it.
            self.cut_off = False
            self._alone_since = self.clock()
            return True
        if answered:
            return False
        self._alone_since = self.clock()
        if not self.cut_off:
            self.cut_off = True
            log.warning(
                "out of touch with the swarm on step %d (no peer answers): waiting for it; a step alone "
                "would fork it",
                epoch,
            )
        return True

    async def _run_probe(self, done: trio.Event) -> None:
        self.answered = await self.node.host.in_touch(PROBE_TIMEOUT)
        done.set()
