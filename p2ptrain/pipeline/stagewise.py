"""Stage-wise averaging: the peers of one stage average their gradients with the existing all-reduce.

Theory of operation: at the end of a step every peer of a stage holds the mean gradient of the samples
*it* counted and their number. The stage's peers form a group under the group key ``pipeline/<stage>/<step>``
(only peers of the same stage, with the same tensors, meet there) and run one butterfly round with
weights equal to their sample counts: the result is the mean over every sample the stage counted,
bit-identical on every member, or the round aborts on every member (commit by agreement). Each member
then applies the same optimizer step to the same weights, so a stage's peers hold identical weights
after every step; after an abort none of them steps.

The group must hold every live peer of the stage (``members``, from the directory): a smaller group
would be a second lineage of the stage's weights. A peer that counted no sample takes part with zero
gradients and a negligible weight.

**The tied embedding** (:func:`tie_ends`). GPT-2's language-model head is its token embedding, one
tensor; the split gives stage 0 the embedding and the last stage a copy of it as its head (stages hold
disjoint tensors). Trained apart, the two copies part from the first step, and the pipeline trains
another, worse model than the unsplit one (measured: 7.5% higher validation loss after 40 steps of the
``pipeline`` benchmark). So after their stage averages the peers of stage 0 and of the last stage run
one more round, under ``pipeline/tied/<step>``, on that tensor alone (uncompressed), and both ends
apply the *sum* of the two stages' agreed gradients, the tied tensor's gradient, with the same AdamW
state to the same values: the embedding and the head stay one tensor held twice, as in the unsplit
model. Under DiLoCo the same round ties the copies' averaged pseudo-gradients at every outer step
(``PipelinePeer._diloco_step``: both ends then step their copy with the sum of the two), so the copies
are equal after every outer step and apart only within an epoch of inner steps.

Every member of a stage holds the same agreed gradient ``g`` of its copy, and every member brings it,
scaled to a largest magnitude of 1 (``g / s``, ``s`` its largest magnitude), with weight ``s / n``
(``n`` its stage group's size): the weighted sum over the round is then the sum of the two stages'
gradients, and the mean times the total weight gives it back. The scaling is needed: the head's
gradient is up to ~60x larger than the embedding's (measured), and a round's reducers refuse slices
far larger than their own (``averaging.bounds``), which banned honest peers before it. A member whose
stage skips the step (its stage average aborted, or it counted nothing) brings weight
:data:`SKIP_WEIGHT`. The round's agreed weights and contributors, identical on every member, decide:
the sum is applied only if no member skips and both ends contributed (the total less the weights of
a member's own stage group is positive); otherwise, or when the round aborts (on every member),
neither copy moves this step. A member left out of a round that applied does not move its copy while
its stage mates do: its weights part from theirs, and it downloads its stage's state again
(``catchup.behind``), as any peer off its stage's lineage does; a member of an end that was in the
round only in part applies a sum short of that member's share, the same on every member.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..averaging.averager import Averager
from ..errors import GroupFormationFailed, RoundAborted
from ..identity import PeerID

log = logging.getLogger(__name__)

EMPTY_WEIGHT = 1e-6  # the weight of a member that counted no sample (weights must be positive)


def group_key(stage: int, step: int) -> str:
    """Only peers of the same stage on the same step meet: a peer a step behind (it downloaded its
    state late) never mixes its gradients, of other weights, into another step's average."""
    return f"pipeline/{stage}/{step}"


@dataclass(frozen=True)
class StageAverage:
    applied: bool  # the tensors now hold the stage's mean
    members: int  # the group's size
    samples: float  # the samples the group counted (the sum of weights)
    reason: str = ""


async def average_stage(
    averager: Averager,
    stage: int,
    step: int,
    grads: list[torch.Tensor],
    samples: int,
    *,
    members: int,
    timeout: float,
) -> StageAverage:
    """Average ``grads`` (this peer's mean over its ``samples``) in place with the stage's other peers
    (``members`` in all, this one included); see the module docstring."""
    weight = float(samples) if samples > 0 else EMPTY_WEIGHT
    if members <= 1:
        return StageAverage(True, 1, weight, "alone in the stage")
    try:
        signed = await averager.form_group(
            grads, group_key=group_key(stage, step), timeout=timeout, target_size=members, min_size=members
        )
        result = await averager.run_round(signed, grads, weight=weight)
    except (GroupFormationFailed, RoundAborted) as e:
        log.warning("stage %d skips this step: its peers could not average (%s)", stage, e)
        return StageAverage(False, 0, 0.0, str(e))
    averager.trained_with(result)
    return StageAverage(True, len(signed.manifest.members), float(result.total_weight), "")


SKIP_WEIGHT = 1e12  # a tied-round member whose stage skips the step (a gradient's largest value is far less)


def tied_key(step: int) -> str:
    return f"pipeline/tied/{step}"


async def tie_ends(
    averager: Averager,
    step: int,
    grad: torch.Tensor,
    *,
    group: set[PeerID],
    steps: bool,
    members: int,
    timeout: float,
) -> StageAverage:
    """Sum, in place, the gradients of the tied tensor's two copies (stage 0's token embedding and the
    last stage's head; see the module docstring) with the peers of both ends (``members`` in all,
    this one included). ``grad``: this peer's stage's agreed gradient of its copy; ``group``: its stage
    group (this peer included); ``steps``: its stage applies this step. Applied (the result says so)
    only if no member skips and both ends contributed; then ``grad`` holds the sum."""
    if members <= 1:
        return StageAverage(False, 1, 0.0, "no peer of the other end")
    scale = float(grad.abs().max()) if grad.numel() else 0.0
    skips = not (steps and math.isfinite(scale) and scale > 0)
    weight = SKIP_WEIGHT if skips else scale / max(1, len(group))
    contribution = [torch.zeros_like(grad) if skips or scale == 0 else grad / scale]
    try:
        signed = await averager.form_group(
            contribution,
            group_key=tied_key(step),
            timeout=timeout,
            compression="none",
            target_size=members,
            min_size=members,
        )
        result = await averager.run_round(signed, contribution, weight=weight)
    except (GroupFormationFailed, RoundAborted) as e:
        log.warning("the embedding and the head skip this step: their stages could not sum them (%s)", e)
        return StageAverage(False, 0, 0.0, str(e))
    total = float(result.total_weight)
    size = len(result.contributors)
    if total >= SKIP_WEIGHT:
        return StageAverage(False, size, total, "a member's stage skips the step")
    own = math.fsum(weight for p in result.contributors if p in group)
    if not total - own > 1e-9 * total:
        return StageAverage(False, size, total, "the other end's peers did not contribute")
    with torch.no_grad():
        grad.copy_(contribution[0].mul_(total))
    averager.trained_with(result)
    return StageAverage(True, size, total, "")
