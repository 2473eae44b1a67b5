"""Streaming DiLoCo: the model's parameters in fragments, each averaged on its own staggered schedule.

Theory of operation
-------------------
With ``diloco.fragments = F`` the trainable parameters are cut into F contiguous runs of about equal
size (:func:`split`), and outer round ``t`` (the swarm's step ``t``) averages and steps fragment
``t mod F`` alone: its pseudo-gradient, its outer Nesterov step, its local parameters reset. Each
fragment is still synchronized once every F rounds, so with ``training.target_batch_size`` set to
1/F of a plain DiLoCo run's every fragment sees the same number of inner steps between its syncs
(Streaming DiLoCo), while each round carries 1/F of the bytes: the link's peak load drops by F, and
with ``diloco.overlap`` each of those smaller rounds runs while the next inner steps compute.

Every member of a round knows which fragment it averages from the round's step alone (the group key
names the step), and the global parameters of every fragment are the same bits on every peer after
each step: the state a joiner downloads at step ``t`` is consistent (each fragment as of its last
sync), and the digests peers compare cover all of it. Contiguous runs keep the error feedback of top-k
rounds one slice of its flat residual per fragment.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def split(sizes: Sequence[int], count: int) -> list[range]:
    """``count`` contiguous runs of parameter indices, none empty, whose element counts are as even
    as whole parameters allow (each cut at the parameter boundary nearest the next even share)."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} parameters into {count} fragments")
    total = sum(sizes)
    cuts = [0]
    running = 0  # elements before parameter i
    for i, n in enumerate(sizes):
        wanted = count - len(cuts)  # cuts still to make
        if wanted <= 0:
            break
        share = len(cuts) * total / count  # where the next cut should fall
        # cut before parameter i if that is nearer the share than after it, or if every remaining
        # fragment needs one of the remaining parameters
        if i > cuts[-1] and (share - running <= running + n - share or len(sizes) - i == wanted):
            cuts.append(i)
        running += n
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]
