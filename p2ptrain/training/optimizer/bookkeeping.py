"""What a CollaborativeOptimizer counts: where this peer is in the run (``Tally``: its step, the samples
it computed toward the next one, since when), its round outcomes, its samples per second, and the run's
fingerprint (what peers of one run must share).

Theory of operation: the optimizer's parts each own their state, but several of them move this peer's
position: a global step advances it, a round that takes the samples computed so far hands them over, an
aborted round gives them back, a download moves it to another step. So the position is one small object,
the :class:`Tally`, that each of them is handed at construction and changes only through its methods;
the progress records (``progress``) publish what it says.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import RunConfig
from ...identity import PeerID

RATE_HALF_LIFE = 10.0  # seconds: how fast the advertised samples/s follows changes


@dataclass
class RoundStats:
    """What the optimizer did so far (shown on the console, written to the metrics)."""

    steps: int = 0  # global steps taken (averaged or alone)
    averaged: int = 0  # global steps that averaged with others
    solo: int = 0  # global steps taken alone (no other peer on the epoch)
    aborted: int = 0  # rounds that aborted (nothing applied)
    no_group: int = 0  # matchmaking attempts that formed no group
    syncs: int = 0  # state downloads applied
    last: dict[str, Any] = field(default_factory=dict)  # the last round's outcome

    def note_step(self, last: dict[str, Any]) -> None:
        """A global step was taken; ``last`` says how (its ``outcome``: "averaged" or "alone")."""
        self.steps += 1
        if last["outcome"] == "averaged":
            self.averaged += 1
        else:
            self.solo += 1
        self.last = last

    def note_abort(self, epoch: int, reason: str) -> None:
        """A round of step ``epoch`` aborted (or was not applied): nothing changed."""
        self.aborted += 1
        self.last = {"epoch": epoch, "outcome": "aborted", "reason": reason}

    def note_no_group(self, epoch: int, reason: str) -> None:
        """Matchmaking for step ``epoch`` formed no group."""
        self.no_group += 1
        self.last = {"epoch": epoch, "outcome": "no group", "reason": reason}

    def note_sync(self, epoch: int, donor: str) -> None:
        """A downloaded state (from ``donor``) took this peer to step ``epoch``."""
        self.syncs += 1
        self.last = {"epoch": epoch, "outcome": "synced", "from": donor}


class RateMeter:
    """Samples per second, exponentially smoothed over time."""

    def __init__(self, half_life: float = RATE_HALF_LIFE) -> None:
        self.half_life = half_life
        self.rate = 0.0
        self._last: float | None = None
        self._pending = 0

    def add(self, samples: int, now: float) -> None:
        if self._last is None:  # the clock starts now: when these samples began is not known
            self._last, self._pending = now, 0
            return
        self._pending += samples
        dt = now - self._last
        if dt < 0.2:  # too short to measure; carry the samples into the next interval
            return
        alpha = 1 - 0.5 ** (dt / self.half_life)
        instant = self._pending / dt
        self.rate = instant if self.rate == 0 else self.rate + alpha * (instant - self.rate)
        self._last, self._pending = now, 0


class Tally:
    """Where this peer is: its step (``epoch``), the samples it computed toward the next one, since when
    they count (``since``: others judge from it how many it could have done), its inner steps (DiLoCo),
    its samples per second, whether the samples of this step are with a round that has not landed yet
    (``landing``: its records then count toward the next step), and the others of the round that took
    it to this step (``cohort``)."""

    def __init__(self, now: float) -> None:
        self.epoch = 0
        self.samples = 0  # toward the current epoch, on this peer
        self.inner_steps = 0
        self.since = now  # since when ``samples`` counts
        self.rate = RateMeter()
        self.landing = False
        self.ahead: int | None = None  # the step of the round ``landing`` names, if past ``epoch``
        # (epoch, members): the others of the round that took this peer to that epoch (see ``progress``)
        self.cohort: tuple[int, frozenset[PeerID]] = (-1, frozenset())
        # the step a committed round took this peer to, whatever others contributed to it (-1: none)
        self.rounded = -1

    def count(self, samples: int, now: float | None = None) -> None:
        """A batch of ``samples`` was computed (``now``: when, for the rate; None: not measured)."""
        self.samples += samples
        if now is not None:
            self.rate.add(samples, now)

    def counting_from(self, when: float) -> None:
        """``samples`` counts what was computed from ``when`` on."""
        self.since = when

    def took(self, weight: int) -> None:
        """A round (or a step alone) took ``weight`` of the samples; the rest count toward the next."""
        self.samples -= weight

    def gave_back(self, weight: int) -> None:
        """An aborted round gave back the ``weight`` samples handed to it: the next round counts them."""
        self.samples += weight

    def handed(self, flag: bool, ahead: int | None = None) -> None:
        """The samples of this step are with a round that has not landed (True), or it landed (False);
        ``ahead``: the round is of that step, past this peer's own (joined ahead while a replay lands
        it there): it lands this peer on the step after."""
        self.landing = flag
        self.ahead = ahead if flag else None

    def inner_step(self) -> None:
        self.inner_steps += 1

    def advance(self, others: frozenset[PeerID], by_round: bool) -> None:
        """A global step: the next epoch, reached with ``others`` (none: alone), by a committed round
        (``by_round``, even one whose only contributor was this peer) or a step alone."""
        self.epoch += 1
        self.cohort = (self.epoch, others)
        self.rounded = self.epoch if by_round else -1

    @property
    def averaged(self) -> bool:
        """Whether a committed round took this peer to its step (its record's ``averaged``)."""
        return self.rounded == self.epoch

    def moved_to(self, epoch: int, inner_steps: int | None = None) -> None:
        """A state of step ``epoch`` was loaded (a download, a checkpoint): nothing counted toward it yet;
        ``inner_steps``: the loaded state's, if it may raise this peer's count (a checkpoint's)."""
        if inner_steps is not None:
            self.inner_steps = max(self.inner_steps, inner_steps)
        self.epoch, self.samples, self.rounded = epoch, 0, -1

    def carry(self, samples: int, since: float) -> None:
        """After a download: the local progress made meanwhile counts toward the new step."""
        self.samples, self.since = samples, since

    def forget_cohort(self) -> None:
        """A downloaded state: no round of this peer vouches for it."""
        self.cohort = (-1, frozenset())

    def set_epoch(self, epoch: int) -> None:
        """Claim another step without a state of it (tests and adversaries forging one)."""
        self.epoch = epoch


def run_fingerprint(config: RunConfig, model: torch.nn.Module) -> bytes:
    """What all peers of a run must share: the run's identity and step rule, and the model's shape
    (records of peers that differ are ignored). Task options that leave the model as it is (how much
    text to read, say) do not split a run."""
    shared = {
        "run": config.run.id,
        "seed": config.run.seed,
        "task": config.task.name,
        "mode": config.training.mode,
        "target": config.training.target_batch_size,
        "model": [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()],
    }
    if config.training.mode == "diloco" and config.diloco.fragments > 1:  # which fragment each step averages
        shared["fragments"] = config.diloco.fragments
    if config.progress.buckets > 1:  # the keys its records go under: peers of other keys never meet
        shared["progress_buckets"] = config.progress.buckets
    if config.averaging.compression.sparse:
        # the sparse wire layout (4: Elias-Fano indices, sums of their used slots only; 2 had 16- and
        # 12-bit indices): peers of releases that encode it otherwise would fail every round together,
        # so they are not one run
        shared["sparse_layout"] = 4
    return hashlib.blake2b(json.dumps(shared, sort_keys=True).encode(), digest_size=16).digest()
