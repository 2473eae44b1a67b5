"""A site in the swarm: rank 0 runs the node and the real ``CollaborativeOptimizer``; every rank holds its
shards and follows rank 0's commands.

Theory of operation. The collaborative optimizer decides everything a peer does in the swarm (progress
records, when to look for a group, the round, when to step alone) and builds the parts that hold its
model-sized state from ``collaborative.Parts``. On a site's rank 0 those parts hold no model-sized
tensor on the heap:

- the **contribution's buffer** is a :class:`WireParams`: the wire vector in rank 0's mapped file
  (``wire``), which the round averages in place as it does an unsharded peer's flat buffer;
- the **outer step** is a :class:`SiteOuter`: where an unsharded ``OuterStep`` computes the
  pseudo-gradient, folds top-k's error feedback, steps the global parameters or puts the residual back,
  it sends the matching command (``commands``) to the other ranks and runs the same collective
  (``outer.ShardedOuter``) on its own shards;
- the **shared state** is a :class:`SiteState`: the site's digest and the snapshot file it serves are
  made from the ranks' shards, each chunk hashed and written by the rank that holds it (on rank 0 where
  a chunk is split between ranks; ``ShardedState``: the root and the chunks an unsharded peer with the
  same state has), and a download's verified chunks go straight into the
  ranks' staging shards (``SiteSink``), adopted by every rank between two batches.

Every other rank runs :meth:`SiteRank.follow`: a batch and an inner step for each TRAIN, the pieces of
a contribution, the landing of a round. Their FSDP2 collectives (a batch's all-gathers and
reduce-scatters, the gradient clip's norm) are entered in the same order as rank 0's: rank 0 sends TRAIN
before computing its batch, and its ``LocalSteps.inner_step`` clips and steps its own shards inside
``CollaborativeOptimizer.step``. The lr of inner step k is :func:`local_steps.inner_lr`, computed on
every rank from the k that TRAIN carries.

What a site refuses at start (:func:`check_run`): sync mode (it averages gradients every step, which is
what a site over a WAN is meant to avoid; its gradients would be full tensors on rank 0). DiLoCo with
``overlap`` works as on any peer, but for the handoff: the pseudo-gradient is a collective of the ranks,
which the batches are too, so the training loop hands it over between two batches
(``RoundRunner.hand_over``), each rank keeping its shard of it aside for the landing.

It keeps its last steps' results and serves them to peers that replay, as any peer does
(``SharedState.keep_result``: read in place from rank 0's wire buffer, a window at a time), and a site at
most ``statesync.replay_steps`` behind replays the missed steps' results as any peer does
(``SiteState._replay``: each fetched into a mapped buffer, landed shard by shard, hashed and checked
against the trusted digest); one further behind downloads the whole state, and carries no local progress
over it. What it does not do yet: checkpoint through the node's checkpoint files (``site.checkpoint`` is
the per-rank format).

State sync and the site's collectives. The ranks enter collectives in the order rank 0's commands name
them, one command at a time; so on rank 0 every collective of the site's group is issued by one owner
at a time, in the order the commands were sent (``turn``). TRAIN's collectives (a batch's all-gathers
and reduce-scatters in a worker thread, the clip's norm in the inner step inside
``CollaborativeOptimizer.step``) are one turn of the training loop, from :meth:`SiteRank.start_batch`
to :meth:`SiteRank.end_batch` (``SiteState.land_download``, after the inner step); an evaluation, a
checkpoint and each outer step's command are turns of its own. A downloaded chunk (PLACE) waits for
its turn (``SiteSink.place``), and so does the state's hash (HASH, after every change), which then
runs in a worker thread on rank 0 while the event loop keeps serving: a batch, an evaluation or
an ADOPT requested meanwhile waits for the hash to end, and the state is held
(``SharedState.holds``) so that no round lands on it meanwhile. A site that is behind waits for its
download between two batches (no local progress to carry), so its chunks are placed as they arrive.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import trio

from ...averaging.compression import Compression
from ...averaging.spill import Spilled
from ...config import DilocoSection, RunConfig, TrainingSection
from ...errors import ConfigError, RemoteProtocolError
from ..optimizer.buffers import Contribution, ParamBuffer
from ..optimizer.collaborative import Parts
from ..optimizer.feedback import PIECE
from ..optimizer.local_steps import inner_lr
from ..optimizer.outer import OuterStep
from ..optimizer.progress import PeerProgress, SwarmView
from ..optimizer.shared_state import RETRY_SYNC, Download, SharedState
from ..state import capture, chunks, serve
from ..state.chunks import Layout
from ..state.codec import TIED_KEY
from ..state.download import Downloaded, Partial, Sink
from ..state.replay import Replay
from ..state.serve import Snapshot
from .bounded import set_timeout
from .commands import LAND_CARRY, Command, Commands, Deadlines, Op
from .layout import WireLayout
from .outer import ShardedOuter, local_of
from .pieces import PieceChannel
from .state import ShardedState
from .turn import Owner, Turn
from .wire import WireBuffer

SNAPSHOT_PREFIX = "p2ptrain-site-snapshot-"
"""The name of a site's snapshot files begins so (in ``SiteRank.snapshots``)."""

log = logging.getLogger(__name__)


def check_run(config: RunConfig) -> None:
    """ConfigError unless a site can train this run (see the module's docstring)."""
    if config.training.mode != "diloco":
        raise ConfigError(
            f"training.mode = {config.training.mode!r}: a sharded site trains with DiLoCo only (sync mode"
            " averages full gradients every step, which is what a site over a WAN is meant to avoid);"
            " set training.mode = 'diloco' or run the node without --shard"
        )


class SiteRank:
    """One rank of a site: its FSDP2 model's trainable parameters, its inner optimizer and its shards
    of DiLoCo's outer state, and the commands it follows (ranks 1..N-1) or sends (rank 0)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: RunConfig,
        commands: Commands,
        *,
        world: int,
        device: torch.device | str = "cpu",
        group: Any = None,
        piece: int = PIECE,
        snapshots: str | None = None,
    ) -> None:
        """``model``: sharded with ``fully_shard`` over the site's ``world`` ranks (its trainable
        parameters DTensors, float32); ``commands``: this rank's end of rank 0's commands;
        ``snapshots``: rank 0's folder for its snapshot files (the site's data folder, which the hosts
        of a site share for its checkpoints: every rank that can open them writes its own chunks
        there); None: the system's temporary folder (one machine)."""
        check_run(config)
        self.model, self.optimizer, self.config, self.commands = model, optimizer, config, commands
        self.rank, self.world = commands.rank, world
        self.device = torch.device(device)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.layout = WireLayout(self.names, [p.shape for p in self.params], world)
        self.channel = PieceChannel(self.layout, self.rank, device=device, group=group)
        self.outer = ShardedOuter(
            self.params, self.layout, self.channel, config.diloco, config.averaging.compression, piece=piece
        )
        self.inner_steps = 0
        self.group = group
        self._staging: ShardedState | None = None  # a download's verified chunks, until adopted
        self.turn = Turn()  # rank 0: who enters the site's collectives now (see ``turn``)
        self._batch = False  # rank 0: the training loop holds a batch's turn (TRAIN to the inner step)
        self.snapshots = snapshots  # rank 0: where its snapshot files are made
        self.deadlines: Deadlines | None = None  # rank 0: its collectives' timeouts by command (ready())
        self._timeout: float | None = None  # rank 0: the timeout its collectives have now

    def ready(self, local_timeout: float | None) -> None:
        """Every rank, once it built its shards: wait for the others (under the group's own, long
        timeout: a spawned rank on a busy host builds slowly). From then on rank 0 bounds each command's
        collectives by ``local_timeout`` and what the command waits on (:class:`Deadlines`), so that a
        hung rank is found that soon; None: the group's own timeout for everything."""
        if self.world > 1:
            dist.barrier(group=self.group)
        if self.rank == 0 and local_timeout is not None and self.world > 1:
            largest = max(self.layout.shard_numel(r) for r in range(self.world))
            self.deadlines = Deadlines(local_timeout, largest)

    # ---- the site's state in the swarm's format (state sync) ----

    def state_shards(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """This rank's shards of the state an unsharded DiLoCo peer shares (``SharedState.capture``):
        ``model.<name>``, the global parameters, and ``optim.outer.<k>.momentum_buffer``, the outer
        momentum; with the full shapes. A tied entry (GPT's LM head, the token embedding) is stored
        once, under its first name, as ``capture`` does."""
        first = self._first_names()
        shards: dict[str, torch.Tensor] = {}
        shapes: dict[str, list[int]] = {}
        outer = self.outer
        for k, g in enumerate(outer.global_params):
            n = first.get(k, self.names[k])
            shards[f"model.{n}"], shapes[f"model.{n}"] = local_of(g), list(g.shape)
            if outer.momentum:
                m = outer.momentum[k]
                key = f"optim.outer.{k}.momentum_buffer"
                shards[key], shapes[key] = local_of(m), list(m.shape)
        return shards, shapes

    def _first_names(self) -> dict[int, str]:
        """Each trainable parameter's first name in the model's state (ConfigError for other state)."""
        index = {id(p): k for k, p in enumerate(self.params)}
        first: dict[int, str] = {}
        named = list(self.model.named_parameters(remove_duplicate=False))
        for name, p in named:
            k = index.get(id(p))
            if k is None:
                raise ConfigError(f"a site syncs trainable parameters only ({name} is frozen)")
            first.setdefault(k, name)
        if set(self.model.state_dict()) != {n for n, _ in named}:
            raise ConfigError("a site syncs the state of models without buffers (this one has some)")
        return first

    def tied(self) -> dict[str, str]:
        """The model's tied entries: each later name to the first (``capture``'s metadata)."""
        index = {id(p): k for k, p in enumerate(self.params)}
        first = self._first_names()
        return {
            n: first[index[id(p)]]
            for n, p in self.model.named_parameters(remove_duplicate=False)
            if first[index[id(p)]] != n
        }

    def live_state(self) -> ShardedState:
        """The site's state as it is now, read in place from this rank's shards."""
        shards, shapes = self.state_shards()
        return ShardedState(shards, shapes, self.rank, self.world, group=self.group)

    def staging(self) -> ShardedState:
        """Where a download's chunks go on this rank (its shards' size, kept until :meth:`adopt`)."""
        if self._staging is None:
            shards, shapes = self.state_shards()
            staged = {n: torch.zeros_like(t) for n, t in shards.items()}
            self._staging = ShardedState(staged, shapes, self.rank, self.world, group=self.group)
        return self._staging

    def adopt(self) -> None:
        """The staged state becomes this rank's: global parameters and momentum, the local parameters
        restart from the global ones, top-k's residual is zero (as an unsharded peer's download)."""
        staged = self.staging()
        live = self.live_state()
        with torch.no_grad():
            for dst, src in zip(live.local, staged.local, strict=True):
                dst.copy_(src)
            for p, g in zip(self.outer.locals(), self.outer.global_params, strict=True):
                p.copy_(local_of(g))
            for e in self.outer.residual:
                local_of(e).zero_()
        self._staging = None

    # ---- rank 0: turns ----

    def send(self, cmd: Command) -> None:
        """Rank 0: send ``cmd`` to the other ranks, in a turn (whose holder then runs rank 0's part)."""
        if self.turn.owner is None:
            raise RuntimeError(f"{cmd.op.name} sent outside a turn: the ranks could see it interleaved")
        if self.deadlines is not None:
            timeout = self.deadlines.timeout(cmd.op)
            if timeout != self._timeout and set_timeout(timeout, self.group):
                self._timeout = timeout
        self.commands.send(cmd)

    def section(self) -> contextlib.AbstractContextManager[None]:
        """``with site.section():`` one of the training loop's turns (an evaluation, a checkpoint, the
        outer step's commands): from a worker thread it waits for the turn (a hash in progress), on the
        event loop it cannot (see ``Turn.take``)."""
        return self.turn.held(Owner.TRAINING)

    def start_batch(self, step: int) -> None:
        """Rank 0: a batch's turn (every rank computes its own, then takes inner step ``step``): TRAIN,
        held until :meth:`end_batch`, since the inner step's clip is a collective of the site too."""
        if not self._batch:
            self.turn.take(Owner.TRAINING)
            self._batch = True
        self.send(Command(Op.TRAIN, step))

    def end_batch(self) -> None:
        """Rank 0, between two batches (after the inner step): the batch's turn ends."""
        if self._batch:
            self._batch = False
            self.turn.give_back(Owner.TRAINING)

    # ---- every rank ----

    def inner_step(self, step: int) -> None:
        """Inner step ``step`` on this rank's shards, as ``LocalSteps.inner_step`` takes it on rank 0
        (the clip's norm is a collective of the site)."""
        t: TrainingSection = self.config.training
        for g in self.optimizer.param_groups:
            g["lr"] = inner_lr(t, step)
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.inner_steps = step + 1

    def handle(self, cmd: Command, compute: Callable[[], object]) -> None:
        """Ranks 1..N-1: do what ``cmd`` says (``compute``: forward and backward of this rank's next
        batch)."""
        fragment = range(cmd.a, cmd.b)
        if cmd.op is Op.TRAIN:
            compute()
            self.inner_step(cmd.a)
        elif cmd.op is Op.CONTRIBUTE:
            self.outer.contribute(fragment, None, keep=bool(cmd.c))
        elif cmd.op is Op.ALONE:
            self.outer.contribute(fragment, None, alone=True)
        elif cmd.op is Op.LAND:
            self.outer.land(fragment, None, committed=bool(cmd.c), carry=cmd.c == LAND_CARRY)
        elif cmd.op is Op.STEP_ALONE:
            self.outer.step_alone(fragment)
        elif cmd.op is Op.HASH:
            self.live_state().hash_into()
        elif cmd.op is Op.PLACE:
            self.staging().place(cmd.a, None)
        elif cmd.op is Op.ADOPT:
            self.adopt()
        else:
            raise RuntimeError(f"rank {self.rank} cannot do {cmd.op.name} here")

    def follow(self, compute: Callable[[], object]) -> None:
        """Ranks 1..N-1: follow rank 0's commands until it says STOP."""
        while (cmd := self.commands.receive()).op is not Op.STOP:
            self.handle(cmd, compute)

    # ---- rank 0 ----

    def train(self, compute: Callable[[], object], step: int) -> None:
        """Rank 0: the site's batch (every rank computes its own) before ``CollaborativeOptimizer.step``
        takes inner step ``step`` on rank 0's shards (``opt.inner_steps``); in a worker thread it waits
        for a hash in progress (see :meth:`start_batch`)."""
        self.start_batch(step)
        compute()

    def stop(self) -> None:
        """Rank 0: the other ranks end :meth:`follow`."""
        with self.section():
            self.send(Command(Op.STOP))

    def parts(self) -> Parts:
        """Rank 0: what ``CollaborativeOptimizer(parts=...)`` builds its model-sized state from."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 runs the collaborative optimizer")

        def outer(
            params: list[torch.Tensor], contribution: Contribution, d: DilocoSection, compression: Compression
        ) -> OuterStep:
            return SiteOuter(self, params, contribution)

        state = type("SiteStateOf", (SiteState,), {"site": self})
        return Parts(buffer=WireParams, outer=outer, state=state)

    def global_shards(self) -> list[torch.Tensor]:
        """This rank's shards of the global parameters (tests and checks read them)."""
        return [local_of(g) for g in self.outer.global_params]


class WireParams(ParamBuffer):
    """A contribution buffer whose flat vector is a wire buffer (``wire``: a mapped file, not the
    heap): the shapes of ``params``, no copy of their values."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("a site's wire vector is float32")
        self.wire = WireBuffer(sum(p.numel() for p in params))
        self.flat: torch.Tensor | None = self.wire.flat
        self.views: list[torch.Tensor] = []
        off = 0
        for p in params:
            self.views.append(self.wire.flat[off : off + p.numel()].view(p.shape))
            off += p.numel()


class SiteOuter(OuterStep):
    """Rank 0's outer step of a site: each of ``OuterStep``'s moves is a command to the other ranks and
    the same collective on rank 0's shards (``ShardedOuter``)."""

    # (handing over to a group of the step a replay lands on, before it landed, is not built for a site:
    # a site joined ahead hands over once the replay landed)
    hands_over_ahead = False
    # (its pseudo-gradient is a collective of the ranks, which the training loop's batches are too: with
    # overlap, the loop hands it over between two batches, ``RoundRunner.hand_over``)
    hands_over_between_batches = True

    def __init__(self, site: SiteRank, params: list[torch.Tensor], contribution: Contribution) -> None:
        # (OuterStep's own __init__ would copy the global parameters whole: a site's are sharded)
        self.site, self.params, self.contribution = site, params, contribution
        self.param_bytes = sum(p.numel() * p.element_size() for p in params)
        self.file = None
        self.global_params = site.outer.global_params
        self.momentum = site.outer.momentum
        self.sgd = site.outer.sgd
        self.feedback = None  # (folded shard by shard: see ``fold``)
        self._handed = False
        self._keep = False  # overlap: the next fold's ranks keep their shards of it aside (``keep_aside``)
        self._round = contextlib.ExitStack()  # while a round runs: its wire pages kept released

    def _wire(self) -> WireBuffer:
        buffer = self.contribution.buffer
        if not isinstance(buffer, WireParams):
            raise TypeError("a site's contribution buffer is a WireParams (parts.buffer)")
        return buffer.wire

    def _send(self, op: Op, c: int = 0) -> range:
        slots = self.contribution.slots
        self.site.send(Command(op, slots.start, slots.stop, c))
        return slots

    def pseudo_gradients(self) -> None:
        """The round's buffer (a new one if the last round may still relay from it); what goes into
        it is computed by :meth:`fold` (a round) or :meth:`flush_feedback` (a step alone), which
        follow."""
        self.contribution.unrelayed()
        self._handed = True

    async def keep_aside(self, buffer: ParamBuffer) -> list[Spilled | torch.Tensor]:
        """DiLoCo with overlap: the next :meth:`fold` has every rank keep its shard of the
        pseudo-gradient aside (``ShardedOuter.contribute``'s ``keep``), where :meth:`land_on_top` finds
        it; nothing of it is on rank 0's heap or disk beyond its own shard."""
        self._keep = True
        return []

    async def fold(self, buffer: ParamBuffer) -> None:
        """Collective: the pseudo-gradient, top-k's error feedback folded in, into the wire buffer."""
        if buffer is not self.contribution.buffer:
            raise RuntimeError("a site folds the buffer its pseudo-gradients went into")
        wire = self._wire()
        keep, self._keep = self._keep, False
        async with self.site.turn.taken(Owner.TRAINING):  # (after a hash in progress)
            slots = self._send(Op.CONTRIBUTE, int(keep))
            if self.param_bytes < serve.THREAD_BYTES:
                self.site.outer.contribute(slots, wire, keep=keep)
            else:  # (the ranks' pieces into the wire buffer: as long as the slowest rank takes)
                await trio.to_thread.run_sync(
                    functools.partial(self.site.outer.contribute, slots, wire, keep=keep)
                )
        self._handed = False
        self._round.close()
        self._round.enter_context(wire.keep_released())  # (the round touches every page of it)
        return None

    def unfold(self, before: object, *, committed: bool) -> None:
        """An aborted round: every rank's residual goes back (a committed one lands in :meth:`step`)."""
        self._round.close()
        if not committed:
            with self.site.section():
                slots = self._send(Op.LAND, 0)
                self.site.outer.land(slots, self._wire(), committed=False)

    def flush_feedback(self) -> None:
        """A step alone: the pseudo-gradient with all of the residual, uncompressed."""
        with self.site.section():
            slots = self._send(Op.ALONE)
            self.site.outer.contribute(slots, self._wire(), alone=True)
        self._handed = False

    def step(
        self,
        before: Callable[[int], None] | None = None,
        after: Callable[[int], None] | None = None,
    ) -> None:
        """Collective: the average in the wire buffer steps every rank's shards of the global
        parameters, and the local ones restart from them (``after`` is ``reset_local``: the ranks do
        it; nothing else is passed here)."""
        self._round.close()
        if self._handed:  # (a step alone with nothing flushed: no top-k, so no residual)
            self.flush_feedback()
        with self.site.section():  # (its callers wait for a hash in progress: ``SharedState.unheld``)
            slots = self._send(Op.LAND, 1)
            self.site.outer.land(slots, self._wire(), committed=True)

    def land_on_top(self, own: list[Spilled | torch.Tensor]) -> None:
        """Collective, DiLoCo with overlap: :meth:`step`; every rank's local shards restart from the new
        global ones with the progress since the handoff on top, from the shards it kept aside (``own``
        is empty: see :meth:`keep_aside`)."""
        self.step()

    def reset_local(self, i: int) -> None:
        """(Done by :meth:`step` on every rank.)"""

    def release(self) -> None:
        """(A site's outer state is not file-backed.)"""

    def rehome_momentum(self) -> None:
        """(A site does not load a state through the outer optimizer.)"""


class SiteSink(Sink):
    """A download's verified chunks go straight into the ranks' staging shards (``ShardedState.place``),
    each in a turn of its own (between the training loop's turns and the state's hashes)."""

    def __init__(self, state: SiteState) -> None:
        self.state = state

    def allocate(self, layout: Layout) -> list[torch.Tensor]:
        # (the layout of the site's last hash: the model's parameters are not read here, where a batch
        # may be running in a worker thread with FSDP2's unsharded parameters registered)
        mine = self.state.layout
        if layout.header != mine.header:
            raise RemoteProtocolError(
                f"its state is laid out as {layout.describe()}, this site's as {mine.describe()}"
            )
        return []

    async def place(self, layout: Layout, tensors: list[torch.Tensor], i: int, data: memoryview) -> None:
        site = self.state.site
        async with site.turn.taken(Owner.DOWNLOAD):
            site.send(Command(Op.PLACE, i))
            site.staging().place(i, data)

    def finish(self, layout: Layout, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}  # (the state is in the ranks' staging shards: ``SiteState.land_download`` adopts it)


class SiteState(SharedState):
    """A site's shared state: its digest and snapshot made from the ranks' shards (``ShardedState``: the
    root an unsharded peer with this state publishes; each chunk hashed and written by the rank that
    holds it), and a download placed chunk by chunk into the ranks' staging shards, adopted between two
    batches. Rank 0 holds a few chunks at a time; the snapshot served to joiners is a file. Its steps'
    results are kept and served as any peer's (read in place from the wire buffer); a site a few steps
    behind replays the missed ones (:meth:`_replay`, each result in a mapped buffer, never whole on the
    heap), and one further behind downloads the state, carrying no local progress over it.

    The hash after a change waits for its turn (``Turn``: after the batch, the evaluation or the chunk
    in progress) and keeps it for the whole assembly, in a worker thread for a large state, holding the
    state meanwhile (``read_in_thread``). So the other ranks see HASH's collectives whole, and nothing
    changes the state under them: what changes it is a command, which needs the turn (ADOPT waits for
    it), and the callers of an outer step (LAND) wait for ``unheld`` first, as for an unsharded peer's
    hash. Its (epoch, digest, snapshot) are published together, and only if the state is still the
    version it hashed (a change said meanwhile has its own hash next); ``digest`` is b"" meanwhile."""

    site: SiteRank  # (set by ``SiteRank.parts``)
    layout: Layout  # the state's chunk layout (set by every hash)
    carries_downloads = False

    def __init__(self, node: Any, *args: Any, **kwargs: Any) -> None:
        self._registry = node.host.registry  # (what it serves there is released by ``close``)
        # the snapshot served to joiners: its file, epoch, root, layout, chunk hashes, metadata
        self._snap: tuple[int, int, bytes, Layout, list[bytes], bytes] | None = None
        # the state a replay just hashed (epoch, layout, snapshot file, hashes), for ``changed``
        self._ready: tuple[int, Layout, int, list[bytes]] | None = None
        super().__init__(node, *args, **kwargs)
        self.fetcher.sink = SiteSink(self)
        self.replayer.allocate = self._mapped

    def state_bytes(self) -> int:
        return self.layout.size  # (the last hash's layout: the site's state is not captured whole)

    def _mapped(self, numel: int) -> WireBuffer:
        """A replayed result's buffer: a mapped file beside the site's snapshot files."""
        folder = self.site.snapshots
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        return WireBuffer(numel, folder)

    def close(self) -> None:
        """This state's life ended (the site's group broke: the state of its next generation takes its
        place on the same node): the methods it served are released, its snapshot file closed."""
        for owner in (self.server, self.results):
            if owner is not None:
                self._registry.release(owner)
        if self._snap is not None:
            os.close(self._snap[0])
            self._snap = None
        if self._ready is not None:
            os.close(self._ready[2])
            self._ready = None

    def _rehash(self) -> None:
        """The state changed: its digest is unknown until every chunk is hashed (see the class's
        docstring). Inline when the state is small and the turn is free (a few
        milliseconds: tests on a virtual clock stay deterministic), or while the state's tasks do not
        run yet (its construction, a resume before training)."""
        self.digest = b""  # published as unknown meanwhile: nobody takes us for diverged
        if self._digest_set.is_set():
            self._digest_set = trio.Event()
        version, site = self._version, self.site
        ready, self._ready = self._ready, None
        if ready is not None:  # (hashed already, in the turn that changed it: a replay's last step)
            self._publish(version, *ready)
            return
        # (the layout of the last hash, the first one inline: the model is read only in a turn, never
        # while a batch runs in a worker thread with FSDP2's unsharded parameters registered)
        if self._nursery is None or (
            self.layout.size < serve.THREAD_BYTES and site.turn.free_for(Owner.HASH)
        ):
            with site.turn.held(Owner.HASH):
                state, epoch = site.live_state(), self.tally.epoch
                self._publish(version, epoch, state.layout, *self._assemble(state))
            return
        self._nursery.start_soon(self._hash_in_turn, version)

    async def _hash_in_turn(self, version: int) -> None:
        """The hash of state ``version``, once it is the hash's turn (none if the state changed again
        meanwhile: that change's own hash follows)."""
        async with self.site.turn.taken(Owner.HASH):
            if version != self._version:
                return
            state, epoch = self.site.live_state(), self.tally.epoch
            if state.layout.size < serve.THREAD_BYTES:
                fd, hashes = self._assemble(state)
            else:  # (the state is held meanwhile: no round lands on it)
                fd, hashes = await self.read_in_thread(self._assemble, state)
            self._publish(version, epoch, state.layout, fd, hashes)

    def _assemble(self, state: ShardedState) -> tuple[int, list[bytes]]:
        """Collective (in the hash's turn, on any thread): every chunk hashed and written to a new snapshot
        file (``ShardedState.hash_into``: by the rank whose shards hold it, or on rank 0 where it is split
        between ranks); that file, open, and the chunks' hashes."""
        self.site.send(Command(Op.HASH))
        folder = self.site.snapshots
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
        made, path = tempfile.mkstemp(prefix=SNAPSHOT_PREFIX, dir=folder)
        os.close(made)
        try:
            hashes = state.hash_into(path)
            # (opened again once every rank closed it: a folder the machines share shows a file as it was
            # when last closed, on one that opens it after that)
            fd = os.open(path, os.O_RDONLY)
        finally:
            os.unlink(path)
        assert hashes is not None  # (rank 0)
        return fd, hashes

    def _publish(self, version: int, epoch: int, layout: Layout, fd: int, hashes: list[bytes]) -> None:
        """State ``version``'s digest (at ``epoch``) and its snapshot become the current ones, unless
        the state changed since (its own hash follows)."""
        if version != self._version:
            os.close(fd)
            return
        site = self.site
        root = chunks.root(epoch, layout, hashes)
        _, meta = capture.capture(torch.nn.Module(), {"outer": site.outer.sgd}, copy=False)
        tied = site.tied()
        if tied:
            meta[TIED_KEY] = json.dumps(tied, separators=(",", ":"), sort_keys=True)
        meta["p2ptrain.epoch"] = str(epoch)
        meta["p2ptrain.inner_steps"] = str(self.tally.inner_steps)
        encoded = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
        if self._snap is not None:
            os.close(self._snap[0])
        self._snap = (fd, epoch, root, layout, hashes, encoded)
        self.layout = layout
        self._hashes = (self._version, hashes)
        self.digest = root
        self.hashed[epoch] = root
        self._digest_set.set()
        for old in sorted(self.hashed)[: -max(4, self.replay_steps + 2)]:
            del self.hashed[old]
        self.wake.set()

    def capture(self, copy: bool = True, own: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        raise ConfigError("a sharded site's state is not captured whole (its checkpoints are per rank)")

    def restore(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, str],
        *,
        epoch: int | None = None,
        owned: bool = False,
    ) -> None:
        raise ConfigError("a sharded site does not load a whole state (its checkpoints are per rank)")

    async def prepare_snapshot(self) -> Snapshot | None:
        if self._snap is None:
            return None
        fd, epoch, root, layout, hashes, meta = self._snap
        return Snapshot(epoch, root, layout, list(hashes), meta, os.dup(fd), last_used=0.0)

    def start_download(
        self,
        view: SwarmView,
        expected: Callable[[int], bytes],
        donors: Callable[[int], Sequence[PeerProgress]] | None = None,
        roots: Callable[[int], frozenset[bytes]] | None = None,
    ) -> None:
        """Catch up as any peer does (``SharedState.start_download``): a site at most ``replay_steps``
        behind on the trusted lineage fetches the missed steps' results into mapped buffers (its
        fetcher's ``allocate``) while it trains on; otherwise the state downloads into the ranks'
        staging shards (its chunks placed while the training loop waits between two batches)."""
        self.site.end_batch()  # (called between two batches)
        super().start_download(view, expected, donors, roots)

    async def reuse(self, partial: Partial) -> None:
        """(A site copies none of its own chunks into a download: each is placed as it arrives.)"""

    async def land_download(self) -> bool:
        """Between two batches: the batch's turn ends (chunks may be placed); a replay that is in is
        applied step by step (:meth:`_replay`), a download that is in and confirmed is adopted by
        every rank (after a hash in progress)."""
        self.site.end_batch()
        flight = self.download
        if flight is None or not flight.done.is_set():
            return False
        got = flight.outcome
        if isinstance(got, Replay):
            async with self.site.turn.taken(Owner.TRAINING):  # (after a hash in progress)
                self.download = None
                return await self._replay(flight, got)
        if not isinstance(got, Downloaded):
            self.download = None
            log.warning("could not catch up (%s); retrying in %.0f s", got, RETRY_SYNC)
            self.sync_retry_at = self.clock() + RETRY_SYNC
            return False
        async with self.site.turn.taken(Owner.TRAINING):
            self.download = None
            self.site.send(Command(Op.ADOPT))
            await self.off_loop(self.site.adopt)  # (copies of every shard: in a thread when large)
        self.tally.moved_to(got.epoch)
        self.contribution.fit(self.tally.epoch)
        self.tally.counting_from(self.clock())
        self.tally.forget_cohort()
        self.downloads += 1
        donor = got.donors[0].short() if got.donors else "this site's own chunks"
        self.stats.note_sync(self.tally.epoch, donor)
        log.info("now on step %d (state from %s, placed into the ranks' shards)", self.tally.epoch, donor)
        return True

    async def _replay(self, flight: Download, replay: Replay) -> bool:
        """In the training loop's turn: apply ``replay``'s results in order, as the steps' members
        applied them, each checked against the trusted digest of the step it leads to (the unsharded
        ``SharedState._replay``'s invariant, shard by shard). Each result lands from its own mapped
        buffer (LAND: rank 0 scatters it piece by piece, every rank steps its shards; one result that
        is the only one carries the local progress, ``LAND_CARRY``), then HASH gives the state's digest
        and snapshot. A digest the trusted records do not name blames the result's reference and stops
        the replay: the state is off the lineage, and the next catch-up downloads it. True (the state
        changed: its digest, just computed, is published by ``changed`` without hashing again)."""
        first = self.tally.epoch
        if replay.first != first:
            return False  # (the state moved meanwhile: not expected, nothing to apply)
        carried = len(replay.results) == 1 and flight.carry_from is not None
        samples, since = self.tally.samples, self.tally.since
        applied = 0
        before = self.digest  # the chain so far (the replay began on this, vouched, digest)
        for got in replay.results:
            wire = got.buffer
            if not isinstance(wire, WireBuffer) or wire.numel != got.values.numel():
                raise TypeError("a site's replayed result lands from a wire buffer of its size (allocate)")
            self.tally.moved_to(got.epoch)
            self.contribution.fit(got.epoch)
            slots = got.slots
            self.site.send(Command(Op.LAND, slots.start, slots.stop, LAND_CARRY if carried else 1))
            await self.off_loop(
                functools.partial(self.site.outer.land, slots, wire, committed=True, carry=carried)
            )
            self.tally.moved_to(got.epoch + 1)
            digest = await self._hash_now()
            if not await self._replayed(flight, got, before, digest):
                break
            applied += 1
            before = digest
        self.tally.forget_cohort()  # no round of ours vouches for these steps
        if carried and applied:
            self.tally.carry(samples, since)
        else:
            self.tally.counting_from(self.clock())
        if applied:
            self.stats.note_sync(self.tally.epoch, replay.results[0].peer.short())
            peers = sorted({p.short() for r in replay.results[:applied] for p in r.senders or (r.peer,)})
            log.info(
                "now on step %d: replayed %d step(s) from step %d into the ranks' shards (%.1f MB from %s"
                " in %.1f s)%s",
                self.tally.epoch,
                applied,
                first,
                sum(r.size for r in replay.results[:applied]) / 1e6,
                ", ".join(peers),
                replay.seconds,
                f"; {samples} samples of local progress carried into it" if carried and applied else "",
            )
        return True

    async def _hash_now(self) -> bytes:
        """In a turn held already: HASH the state as it is now (in a worker thread when large, the state
        held meanwhile), and keep what it made for ``changed`` to publish (:meth:`_rehash`); its root."""
        state, epoch = self.site.live_state(), self.tally.epoch
        if state.layout.size < serve.THREAD_BYTES:
            fd, hashes = self._assemble(state)
        else:
            fd, hashes = await self.read_in_thread(self._assemble, state)
        if self._ready is not None:
            os.close(self._ready[2])
        self._ready = (epoch, state.layout, fd, hashes)
        return chunks.root(epoch, state.layout, hashes)
