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
model.

Every member of a stage holds the same agreed gradient, and every member brings it, with weight
``1 / its stage group's size``: the weights of each end add up to 1, the round's total weight is 2 and
its mean times 2 is the sum. (Every member brings values of the same size, its own gradient: a round's
reducers refuse slices far larger than their own, ``averaging.bounds``.) A member whose stage skips
the step (its stage average aborted) brings its own gradient with :data:`SKIP_WEIGHT`. The round's
agreed weights, identical on every member, then say whether it is whole: their total is 2 exactly
when each end's group is in the round entire and no member skips. Only then does any member apply it;
otherwise, or when the round aborts (on every member), neither copy moves this step. A member left out
of the round that applied does not move its copy while its stage mates do: its weights part from
theirs, and it downloads its stage's state again (``catchup.behind``), as any peer off its stage's
lineage does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..averaging.averager import Averager
from ..errors import GroupFormationFailed, RoundAborted

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


SKIP_WEIGHT = 4.0  # a tied-round member whose stage skips the step: the total is not 2, nobody applies
WHOLE = 2.0  # the total weight of a whole tied round: each end's group brings 1


def tied_key(step: int) -> str:
    return f"pipeline/tied/{step}"


async def tie_ends(
    averager: Averager,
    step: int,
    grad: torch.Tensor,
    *,
    share: float,
    steps: bool,
    members: int,
    timeout: float,
) -> StageAverage:
    """Sum, in place, the gradients of the tied tensor's two copies (stage 0's token embedding and the
    last stage's head; see the module docstring) with the peers of both ends (``members`` in all,
    this one included). ``grad``: this peer's stage's agreed gradient of its copy; ``share``: 1 / its
    stage group's size; ``steps``: its stage applies this step. Applied (the result says so) only if
    the round is whole; then ``grad`` holds the sum."""
    if members <= 1:
        return StageAverage(False, 1, 0.0, "no peer of the other end")
    weight = share if steps else SKIP_WEIGHT
    contribution = [grad]
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
    if abs(total - WHOLE) > 1e-9:
        why = "a member's stage skips the step" if total >= SKIP_WEIGHT else "an end's group is not whole"
        return StageAverage(False, size, total, why)
    with torch.no_grad():
        grad.mul_(WHOLE)
    averager.trained_with(result)
    return StageAverage(True, size, total, "")
