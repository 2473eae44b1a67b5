"""An echo earns no trust (issue: open swarms, part 2, "what is left"). Real all-reduce rounds of four
averagers on the in-memory network (virtual clock): three honest members send the next step's
gradient-like values (a part along the last averaged result, a direction new to the step they share,
and noise of their own), the fourth sends back the last result it received (scaled and with noise).

Before a slice had to carry work beyond its reducer's last result, the echo passed the alignment
check from the second round on (it points the way the honest slices do) and every honest member
trusted the echoing key after one round of it: a partner that never computed anything.
"""

from __future__ import annotations

import pytest
import torch
import trio

from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.protocol import SignedManifest
from tests.harness.averaging import open_group, sign_manifest

pytestmark = pytest.mark.timeout(120)

D = 8_192  # elements: partitions of 2,048, past the size from which the check runs
ROUNDS = 4


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_key_that_echoes_the_last_result_is_never_trusted(autojump_clock: object, seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    async with open_group(4) as group:
        honest, echo = group.peers[:3], group.peers[3]
        last: torch.Tensor | None = None  # the echo's last accepted result
        previous = torch.randn(D, generator=rng)
        for r in range(ROUNDS):
            new = torch.randn(D, generator=rng)  # what this step's gradients have in common that is new
            inputs = []
            for _ in honest:
                noise = torch.randn(D, generator=rng)
                inputs.append(
                    [(0.8 * previous + new + 0.7 * noise) * float(torch.rand(1, generator=rng) + 0.5)]
                )
            if last is None:
                inputs.append([torch.zeros(D)])  # nothing to echo yet (zeros earn nothing either)
            else:
                inputs.append([last * 3.0 + 0.2 * last.norm() / D**0.5 * torch.randn(D, generator=rng)])
            signed = sign_manifest(group.peers, inputs[0], round_id=bytes([seed, r]) * 8)
            outcomes: list[object] = [None] * 4

            async def one(
                i: int, signed: SignedManifest, inputs: list[list[torch.Tensor]], outcomes: list[object]
            ) -> None:
                outcomes[i] = await group.peers[i].averager.run_round(signed, inputs[i], weight=1.0)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i, signed, inputs, outcomes)
            assert all(isinstance(o, RoundResult) for o in outcomes), outcomes
            for peer, o in zip(group.peers, outcomes, strict=True):
                assert isinstance(o, RoundResult)
                peer.averager.trained_with(o)
                if r > 0:
                    assert echo.host.peer_id not in o.verified or peer is echo
            result = outcomes[3]
            assert isinstance(result, RoundResult)
            last = result.tensors[0].clone()
            previous = outcomes[0].tensors[0].clone()  # type: ignore[union-attr]
            await trio.sleep(1.0)
        for peer in honest:
            partners = peer.averager.partners
            assert echo.host.peer_id not in partners, f"{peer.name} trusts the echo"
            assert {p.host.peer_id for p in honest if p is not peer} <= partners, peer.name
