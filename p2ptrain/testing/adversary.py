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
from ..averaging.partition import chunks
from ..averaging.protocol import Manifest, SignedManifest
from ..identity import Identity
from . import sybils

if TYPE_CHECKING:
    from ..training.loop.trainer import Trainer

ADVERSARIES = (
    "nan",
    "scale",
    "random",
    "inflate",
    "garbage-reducer",
    "sybil-epoch",
    "false-accusation",
    "manifest-downgrade",
    *sybils.KINDS,
)
LEAD_TIME = 0.5  # the matchmaking time a manifest-downgrade attacker announces with (honest: seconds)
FACTOR = 100.0
FAR = 1_000_000  # the step a sybil-epoch adversary claims


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
    generator = torch.Generator().manual_seed(seed)
    if kind == "inflate":
        honest = averager.run_round

        async def run_round(signed: Any, tensors: Any, *, weight: float = 1.0, in_place: bool = False) -> Any:
            return await honest(signed, tensors, weight=weight * FACTOR, in_place=in_place)

        averager.run_round = run_round  # type: ignore[method-assign]
        return

    async def fault(rnd: AllReduceRound, point: str) -> None:
        if point == "before_send" and kind in ("nan", "scale", "random"):
            _spoil(rnd, kind, generator)
        elif point == "after_reduce" and kind == "garbage-reducer":
            _garble(rnd, generator)

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


def _garble(rnd: AllReduceRound, generator: torch.Generator) -> None:
    """Add noise to every partition this member reduced, and serve that instead (encoded as the round
    says, so the other members accept the bytes)."""
    for red in rnd.reducers.values():
        if red.result is None:
            continue
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
