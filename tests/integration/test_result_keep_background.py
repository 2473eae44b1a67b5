"""A large DiLoCo step's result is kept for peers behind in the background, not on the step's path.

Keeping a result packs it into the round's form (an int8 round's: 4.8 s at 124M, about 45 min at 70B),
and the outer step waited for it. The invariant now (``SharedState.keep_result(buffered=True)``): *the
step lands whatever the keeping takes; what is kept is the result the step applied, bit for bit, even
when the next step's pseudo-gradient is computed meanwhile (it goes into a new buffer); one keeping runs
at a time, in step order, and a step waits for the last one before its own (one buffer in waiting).*
Here the keeping is held at a gate the test opens: on the code before, the step returned only once the
keeping ended (after the gate's timeout). A real node and optimizer on the in-memory network, on trio's
real clock (the keeping runs in a worker thread)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import trio
import trio.testing

from p2ptrain import Node, NodeConfig
from p2ptrain.net import MemoryNetwork
from p2ptrain.training import CollaborativeOptimizer
from p2ptrain.training.state import serve
from tests.harness.identities import identity
from tests.harness.training import BATCH, run_config

pytestmark = pytest.mark.timeout(120)
WIDTH = 1024  # 2.1M parameters, 8.4 MB: past serve.THREAD_BYTES
GATE = 20.0  # seconds a held keeping waits for the test at most (the code before waits it out)


def batch(model: torch.nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(BATCH, WIDTH, generator=g)
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()


async def test_a_large_step_lands_while_its_result_is_kept_and_the_kept_bytes_are_the_applied_result() -> (
    None
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, 1)
    )
    assert sum(p.numel() * 4 for p in model.parameters()) >= serve.THREAD_BYTES
    cfg = run_config("diloco")
    net = MemoryNetwork(seed=0)
    node = Node(
        identity("keeper"),
        NodeConfig(run_id="keep", listen=(("keeper", 4000),)),
        transport=net.transport("keeper"),
    )
    opt = CollaborativeOptimizer(node, model, torch.optim.AdamW(model.parameters(), lr=0.01), cfg)
    gate = threading.Event()
    order: list[tuple[str, int]] = []
    keep = opt.shared.results.keep

    def held(epoch: int, *args: Any, **kwargs: Any) -> None:
        order.append(("held", epoch))
        gate.wait(GATE)
        keep(epoch, *args, **kwargs)
        order.append(("kept", epoch))

    opt.shared.results.keep = held  # type: ignore[method-assign]
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            await nursery.start(opt.run)
            applied: list[torch.Tensor] = []

            def compute(step: int) -> None:
                batch(model, step)
                opt.local.inner_step()
                opt.tally.inner_step()
                opt.tally.count(BATCH)
                # the pseudo-gradient this step applies: the global parameters minus the local ones
                outer = opt.outer_step
                assert outer is not None
                pairs = zip(outer.global_params, opt.params, strict=True)
                applied.append(torch.cat([(g - p.detach()).flatten() for g, p in pairs]))

            # step 0 lands while its keeping is held at the gate
            compute(0)
            await opt.solo_step()
            first = opt.contribution.buffer
            assert opt.epoch == 1 and ("kept", 0) not in order, order
            assert opt.shared.results.get(0) is None  # (not yet kept)

            # step 1: its pseudo-gradient goes into a new buffer (the first is still being kept), and it
            # waits for the first keeping before its own starts (one buffer in waiting at most)
            landed = trio.Event()

            async def second() -> None:
                await opt.solo_step()
                order.append(("landed", 1))
                landed.set()

            compute(1)
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert opt.contribution.buffer is not first
            gate.set()
            await landed.wait()
            await opt.shared.kept()
            assert order.index(("kept", 0)) < order.index(("landed", 1)), order
            keepings = [e for e in order if e[0] != "landed"]
            assert keepings == [("held", 0), ("kept", 0), ("held", 1), ("kept", 1)], order
            for step in range(2):
                kept = opt.shared.results.get(step)
                assert kept is not None and kept.kind == "float32"
                got = torch.frombuffer(bytearray(kept.read()), dtype=torch.float32)
                assert torch.equal(got, applied[step]), f"step {step}'s kept result is not what it applied"
            nursery.cancel_scope.cancel()
