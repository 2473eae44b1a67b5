"""No step of a task on the event loop passes over a whole round's vector (``averaging.offload``).

A pass over a 1B-parameter vector takes about a second on a CPU; on the event loop it holds every
other task of the node (heartbeats, DHT answers, the round's own streams) that long. The invariant:
*the most work any one task step on the event loop does in a round does not grow with the vector*:
what runs there is chunk-sized (the chunks of a slice added as they arrive, a result's chunks sent),
and every pass over the vector or a partition runs in a worker thread.

Measured with a torch function mode, which is per thread (so it sees only what runs on the loop's
thread), and a trio instrument that sums the values each task step's torch calls read (views and
metadata are free): a round of 2 members over a vector of 1.5x and 3x ``LOOP_ELEMENTS`` values, copied
or averaged in place. On the code before, one step's work grew with the vector (its flatten, finiteness
checks, scales, the reducer's own slice, the reduction's Gram matrix and the commit ran on the loop: 38M
values' worth in one step at 6M values).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from torch.overrides import TorchFunctionMode

from p2ptrain.averaging import offload
from p2ptrain.averaging.allreduce import RoundResult
from tests.harness.averaging import open_group, run_round, sign_manifest

pytestmark = pytest.mark.timeout(300)

FREE = {  # views and metadata: they read no values
    "__get__",
    "__getitem__",
    "numel",
    "dim",
    "is_contiguous",
    "data_ptr",
    "detach",
    "view",
    "reshape",
    "numpy",
    "size",
    "element_size",
    "untyped_storage",
    "storage_offset",
    "stride",
    "__len__",
}


class LoopWork(TorchFunctionMode, trio.abc.Instrument):
    """The values read by torch calls in each task step on this thread; ``most``: the largest step."""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)
        self.step = 0
        self.most = 0
        self.where = ""

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.step = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.step > self.most:
            self.most, self.where = self.step, task.name

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in FREE:
            sizes = [0]
            for a in [*args, *kwargs.values()]:
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor):
                        sizes.append(t.numel())
            self.step += max(sizes)
        return func(*args, **kwargs)


async def most_in_one_step(values: int, in_place: bool) -> int:
    shapes = [(values,)] if in_place else [(values // 2,), (values - values // 2,)]
    async with open_group(2) as group:
        torch.manual_seed(0)
        inputs = [[torch.randn(*s) for s in shapes] for _ in range(2)]
        want = [(a + b) / 2 for a, b in zip(inputs[0], inputs[1], strict=True)]
        signed = sign_manifest(group.peers, inputs[0])
        work = LoopWork()
        trio.lowlevel.add_instrument(work)
        try:
            with work, trio.fail_after(240):
                outcomes = await run_round(group, signed, inputs, [1.0, 1.0], in_place=in_place)
        finally:
            trio.lowlevel.remove_instrument(work)
        assert all(isinstance(o, RoundResult) for o in outcomes), outcomes
        for got in inputs:  # (the round still averages: the same mean on both members)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)
        return work.most


@pytest.mark.parametrize("in_place", [False, True])
async def test_the_most_work_in_one_loop_step_does_not_grow_with_the_vector(in_place: bool) -> None:
    small = await most_in_one_step(offload.LOOP_ELEMENTS * 3 // 2, in_place)
    large = await most_in_one_step(offload.LOOP_ELEMENTS * 3, in_place)
    # A few chunks' work at most (a reader takes the chunks buffered by then in one step), at 6.3M
    # values and at 12.6M alike: far below one pass over either vector (38M in one step before).
    assert max(small, large) < 2 * offload.LOOP_ELEMENTS, (small, large)
