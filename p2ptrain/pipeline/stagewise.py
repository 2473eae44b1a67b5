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
