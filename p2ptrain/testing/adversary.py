"""Hostile peers on purpose: what a broken or malicious member does, for tests and adversarial scenarios.

``install(kind, averager)`` turns an honest node's averager into one that attacks every round it takes
part in, through the round's fault hook (it changes what this member sends or serves, never how the
others behave):

- ``nan``: its slices are NaN (the reducers refuse them: it is left out of every round);
- ``scale``: its slices are multiplied by 100;
- ``random``: its slices are noise a hundred times larger than its values;
- ``inflate``: it claims a hundred times the samples it did (far above what its progress records make
  plausible: every reducer refuses its slices, so it is left out of the rounds);
- ``garbage-reducer``: it adds noise to every partition it reduces, and serves that (an audit catches it).

Attacks on the swarm's state and bans (they need the node's trainer, ``install(..., trainer=)``):

- ``sybil-epoch``: after its first batch it flips the sign of every parameter, claims step 1,000,000
  for that state, publishes it in its progress records and serves it to anyone who asks, and stops
  training (its forged state stays what it serves);
- ``false-accusation``: after each audited round it takes part in, it accuses that round's reducer of
  partition 0 (honest or not) and serves a proof with made-up slices: the run's real manifest and
  attestation, the slices zeros;
- ``manifest-downgrade``: every group it leads gets a manifest with a plain mean, no audit and every
  partition to itself, and it announces with a short deadline so that it leads often.

Attacks on leadership, trust and what a round serves (issue "open swarms, part 2"):

- ``silent-leader``: it trains nothing; under each step's group key it announces itself ready to lead,
  with the shortest deadline it may (``LEAD_TIME``), again and again; it admits every joiner and holds
  the call until the joiner gives up, and never signs a manifest;
- ``partial-leader``: it trains honestly, but in every group it leads it admits one victim (held, as
  above) and tells every other joiner that the group is full; it announces with ``LEAD_TIME`` too;
- ``trusted-liar``: it trains honestly for ``LIAR_AFTER`` seconds (long enough to be trusted), then its
  progress records say its view reached the target (``ready``) at 10^9 samples per second, and it
  claims ``LIAR_WEIGHT`` samples in every round;
- ``flaky-reducer``: it serves NaN for the partitions it reduces in two rounds of every three, and
  behaves in the third (a fault that a strike count wiped by every good round never bans);
- ``mixed``: ``partial-leader``, ``garbage-reducer`` and ``trusted-liar`` at once.

Attacks by many free identities from one host (``sybil-majority``, ``fake-progress``, ``dht-flood``,
``conn-flood``): see :mod:`p2ptrain.testing.sybils`.

Start a node with ``p2ptrain node ... --adversary KIND`` (a hidden flag, for simulations only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import trio

from ..averaging.allreduce import AllReduceRound, RoundEvidence
from ..averaging.audit import Proof, open_attestation
from ..averaging.auditor import Accusation
from ..averaging.averager import Averager
from ..averaging.compression import Compression, encode
from ..averaging.grouping import JOIN_GRACE
from ..averaging.matchmaking import Announcement
from ..averaging.partition import chunks
from ..averaging.protocol import JOIN, JoinReq, JoinResp, Manifest, SignedManifest
from ..errors import GroupFormationFailed
from ..identity import Identity, PeerID
from ..net.rpc import CallContext, Reply
from ..training.optimizer.progress import ProgressRecord
from . import sybils

if TYPE_CHECKING:
    from ..training.loop.trainer import Trainer
    from ..training.optimizer import CollaborativeOptimizer

ADVERSARIES = (
    "nan",
    "scale",
    "random",
    "inflate",
    "garbage-reducer",
    "sybil-epoch",
    "false-accusation",
    "manifest-downgrade",
    "silent-leader",
    "partial-leader",
    "trusted-liar",
    "flaky-reducer",
    "mixed",
    *sybils.KINDS,
)
LEAD_TIME = 0.5  # the matchmaking time a manifest-downgrade attacker announces with (honest: seconds)
FACTOR = 100.0
FAR = 1_000_000  # the step a sybil-epoch adversary claims
HOLD = 3600.0  # seconds a hostile leader holds a joiner's call (the joiner gives up long before)
LIAR_AFTER = 30.0  # seconds a trusted-liar trains honestly before it lies
LIAR_RATE = 1e9  # the samples per second its records claim then (the most a record may say)
LIAR_WEIGHT = 1e6  # the samples it claims in every round then
FLAKY_EVERY = 3  # a flaky-reducer behaves in one round of this many


def install(kind: str, averager: Averager, *, seed: int = 0, trainer: Trainer | None = None) -> None:
    """Make ``averager`` attack every round it takes part in, or its node's trainer attack the swarm's
    state and bans (see the module docstring)."""
    if kind not in ADVERSARIES:
        raise ValueError(f"unknown adversary {kind!r}; known: {', '.join(ADVERSARIES)}")
    if kind == "sybil-epoch":
        _far_epoch(_needs(kind, trainer))
        return
    if kind == "false-accusation":
        _accuse_falsely(_needs(kind, trainer).opt.node.averager)
        return
    if kind in sybils.KINDS:
        sybils.install(kind, _needs(kind, trainer).opt)
        return
    if kind == "manifest-downgrade":
        _downgrade(averager)
        return
    if kind == "silent-leader":
        hold_joiners(averager, admit_one=False)
        announce_only(averager)
        return
    if kind in ("partial-leader", "mixed"):
        hold_joiners(averager, admit_one=True)
        averager.config = dataclasses.replace(averager.config, matchmaking_time=LEAD_TIME)
        if kind == "partial-leader":
            return
    if kind in ("trusted-liar", "mixed"):
        lie_once_trusted(_needs(kind, trainer).opt)
        if kind == "trusted-liar":
            return
    generator = torch.Generator().manual_seed(seed)
    if kind == "inflate":
        honest = averager.run_round

        async def run_round(signed: Any, tensors: Any, *, weight: float = 1.0, in_place: bool = False) -> Any:
            return await honest(signed, tensors, weight=weight * FACTOR, in_place=in_place)

        averager.run_round = run_round  # type: ignore[method-assign]
        return

    rounds = 0

    async def fault(rnd: AllReduceRound, point: str) -> None:
        nonlocal rounds
        if point == "before_send" and kind in ("nan", "scale", "random"):
            _spoil(rnd, kind, generator)
        elif point == "after_reduce" and kind in ("garbage-reducer", "mixed"):
            _garble(rnd, generator)
        elif point == "after_reduce" and kind == "flaky-reducer":
            rounds += 1
            if rounds % FLAKY_EVERY:
                _garble(rnd, generator, fill=math.nan)

    averager.fault = fault


def _spoil(rnd: AllReduceRound, kind: str, generator: torch.Generator) -> None:
    """Change what this member sends to the others (the partition it reduces itself keeps its honest
    values: the attack is on the contribution, not a refusal to serve)."""
    for red in rnd.reducers.values():
        red.keep_own_copy(rnd.me)
    values = rnd.source
    with torch.no_grad():
        if kind == "nan":
            values.fill_(math.nan)
        elif kind == "scale":
            values.mul_(FACTOR)
        else:
            scale = FACTOR * float(values.abs().mean().clamp_min(1e-3))
            values.copy_(torch.randn(values.shape, generator=generator) * scale)


def _garble(rnd: AllReduceRound, generator: torch.Generator, fill: float | None = None) -> None:
    """Add noise to every partition this member reduced (or ``fill`` it with one value), and serve that
    instead (encoded as the round says, so that only the values are wrong)."""
    for red in rnd.reducers.values():
        if red.result is None:
            continue
        if fill is not None:
            red.result.fill_(fill)
        else:
            scale = FACTOR * float(red.result.abs().mean().clamp_min(1e-3))
            red.result.add_(torch.randn(red.result.shape, generator=generator) * scale)
        if red.mode is not Compression.NONE:
            red.encoded = [
                bytes(encode(red.result[a:b].contiguous(), red.mode, red.members))
                for a, b in chunks(red.size, red.mode)
            ]


def _needs(kind: str, trainer: Trainer | None) -> Trainer:
    if trainer is None:
        raise ValueError(f"{kind} attacks the swarm's state: it needs the node's trainer")
    return trainer


def _far_epoch(trainer: Trainer) -> None:
    opt = trainer.opt
    trainer.max_steps = 0  # it would stop at once at step 1,000,000

    async def step(samples: int) -> bool:
        if opt.epoch == FAR:
            await trio.sleep(0.05)  # trains no more: the forged state stays the one it serves
            return False
        sybils.flip(opt)
        opt.tally.set_epoch(FAR)
        opt.state_changed()  # hashed, served and published as the state of step FAR
        return True

    opt.step = step  # type: ignore[method-assign]


def _accuse_falsely(averager: Averager) -> None:
    auditor = averager.auditor
    keep = auditor.keep

    def accuse(evidence: RoundEvidence) -> None:
        keep(evidence)
        accused = evidence.peers[evidence.holders.get(0, 0)]
        if 0 not in evidence.attestations or accused == auditor.host.peer_id:
            return
        holder = evidence.peers.index(accused)
        att = open_attestation(evidence.attestations[0], accused, evidence.digest, 0, len(evidence.peers))
        made_up = tuple(bytes(4 * evidence.sizes[0]) for _ in att.contributors)
        auditor.proofs[(evidence.digest, 0)] = Proof(
            evidence.manifest, holder, 0, evidence.attestations[0], made_up
        )
        auditor.banned.pop(accused, None)  # ban() again: this time with the (false) accusation published
        auditor.ban(
            accused,
            "reducer of partition 0: made up",
            accusation=Accusation(accused, "made up", evidence.digest, 0),
        )

    auditor.keep = accuse  # type: ignore[method-assign]


def _downgrade(averager: Averager) -> None:
    """Sign a downgraded manifest for every group this node leads (this process's signer is patched)."""
    me = averager.host.identity.peer_id
    real = SignedManifest.sign.__func__  # type: ignore[attr-defined]

    def sign(cls: type[SignedManifest], who: Identity, manifest: Manifest) -> SignedManifest:
        if who.peer_id == me:
            rest = (0,) * (len(manifest.sizes) - 1)
            manifest = dataclasses.replace(
                manifest, aggregation="mean", audit=False, sizes=(manifest.total, *rest)
            )
        signed: SignedManifest = real(cls, who, manifest)
        return signed

    SignedManifest.sign = classmethod(sign)  # type: ignore[assignment,method-assign]
    averager.config = dataclasses.replace(averager.config, matchmaking_time=LEAD_TIME)


def hold_joiners(averager: Averager, *, admit_one: bool) -> None:
    """Answer every request for a place in a group this node leads by holding the call (the joiner waits
    until it gives up); with ``admit_one``, only the first asker of each group key is held, the others
    are told the group is full."""
    victims: dict[str, PeerID] = {}

    async def on_join(ctx: CallContext, req: JoinReq) -> Reply[JoinResp]:
        if admit_one and victims.setdefault(req.group_key, ctx.peer) != ctx.peer:
            return Reply(JoinResp(False, "the group is full"))
        await trio.sleep(HOLD)
        return Reply(JoinResp(False, "the group did not form"))

    averager.host.registry.replace(JOIN, on_join)


def announce_only(averager: Averager) -> None:
    """Instead of looking for a group, announce readiness to lead under the key, again and again with
    the shortest deadline, for as long as an honest peer would look (then give up: it trains nothing)."""
    groups = averager.groups
    me = averager.host.peer_id

    async def form(group_key: str, schema: Any, digest: bytes, *args: Any, **kwargs: Any) -> Any:
        key = groups.keys(group_key).key_of(me)  # (the one key its announcement counts under)
        clock = groups.clock
        end = clock() + averager.config.matchmaking_time
        while clock() < end:
            deadline = clock() + LEAD_TIME
            announcement = Announcement(
                me,
                groups.address(reducer=True),
                deadline,
                groups.bandwidth,
                digest,
                group=groups.tag(group_key),
            )
            await groups.announce(key, announcement, deadline + JOIN_GRACE)
            await trio.sleep(LEAD_TIME / 2)
        raise GroupFormationFailed("a silent leader forms no group")

    groups.form = form  # type: ignore[method-assign]


def lie_once_trusted(opt: CollaborativeOptimizer, after: float = LIAR_AFTER) -> None:
    """Train honestly for ``after`` seconds from the first step, then lie in every record and round."""
    board, averager = opt.board, opt.node.averager
    honest_record, honest_round, honest_step = board.record, averager.run_round, opt.step
    began: float | None = None

    def lying() -> bool:
        return began is not None and opt.clock() - began >= after

    def record() -> ProgressRecord:
        r = honest_record()
        if not lying():
            return r
        return dataclasses.replace(r, ready=True, rate=LIAR_RATE, samples=max(r.samples, int(LIAR_WEIGHT)))

    async def run_round(signed: Any, tensors: Any, *, weight: float = 1.0, in_place: bool = False) -> Any:
        claimed = LIAR_WEIGHT if lying() else weight
        return await honest_round(signed, tensors, weight=claimed, in_place=in_place)

    async def step(samples: int) -> bool:
        nonlocal began
        began = opt.clock() if began is None else began
        return await honest_step(samples)

    board.record = record  # type: ignore[method-assign]
    averager.run_round = run_round  # type: ignore[method-assign]
    opt.step = step  # type: ignore[method-assign]
