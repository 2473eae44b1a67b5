"""Which members of a large group fetch the signed manifest from a fellow member (``relay_plan``).

Over random groups (sizes, client-only members, the leader's counted members): a group of at most
``RELAY_FROM`` is sent by its leader alone; in a larger one every member but the leader gets its copy
from the leader or from exactly one relay, a relay has an address and gets its own from the leader,
there are about sqrt(n) relays, each serves about as many members, and members the leader counts are
relays before those it does not.
"""

from __future__ import annotations

import math
import random

import pytest

from p2ptrain.averaging.grouping import RELAY_FROM, relay_plan
from p2ptrain.averaging.protocol import Manifest, MemberMsg, TensorSpec, mask_bytes


def manifest(rng: random.Random, n: int) -> tuple[Manifest, set[int]]:
    addressed = [i == 0 or rng.random() > 0.3 for i in range(n)]
    counted = {j for j in range(1, n) if rng.random() < rng.choice((0.0, 0.2, 0.8))}
    members = tuple(MemberMsg(rng.randbytes(32), f"n{i}:1" if addressed[i] else "", 1.0) for i in range(n))
    sizes = tuple(1 if a else 0 for a in addressed)
    return (
        Manifest(
            round_id=bytes(16),
            group_key="k",
            members=members,
            sizes=sizes,
            schema=(TensorSpec((sum(sizes),), "float32"),),
            needs=(0,) * n,
            counts=(mask_bytes(sum(1 << j for j in counted)),) + (b"",) * (n - 1),
        ),
        counted,
    )


@pytest.mark.parametrize("seed", range(40))
def test_every_member_gets_its_copy_from_the_leader_or_one_relay_with_an_address(seed):
    rng = random.Random(seed)
    n = rng.choice((2, RELAY_FROM, RELAY_FROM + 1, rng.randint(2, 256)))
    m, counted = manifest(rng, n)
    m.check()
    plan = relay_plan(m)
    if n <= RELAY_FROM:
        assert plan == {}
        return
    relays = set(plan.values())
    able = {j for j in range(1, n) if m.members[j].addr}
    assert relays <= able and 0 not in plan and not relays & set(plan)
    # every member but the leader: a relay (sent by the leader) or a dependent of one relay
    assert set(plan) | relays == set(range(1, n)) or not able
    if not able:
        assert plan == {}
        return
    assert len(relays) == min(len(able), math.isqrt(n - 1) + 1)
    served = [list(plan.values()).count(r) for r in relays]
    assert max(served) - min(served) <= 1  # (dealt out in turn)
    assert max(served) <= math.ceil((n - 1) / len(relays))
    # the leader's counted members first: no uncounted relay while a counted addressed member is not one
    if any(r not in counted for r in relays):
        assert counted & able <= relays
