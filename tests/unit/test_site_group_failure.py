"""Which errors a live site takes for its group's failure (``SiteGroup.failure``: then it restarts the
group and goes on), and which it raises on as rank 0's own; and the RPC methods a site's state releases
when its next generation takes its place (``RpcRegistry.release``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from p2ptrain.net.rpc import RpcRegistry
from p2ptrain.training.site.group import GroupRestarted, SiteGroup
from p2ptrain.training.state.serve import StateServer


def worker(*args: object) -> None:  # (never started here)
    raise AssertionError("not spawned")


def group() -> SiteGroup:
    return SiteGroup(2, worker)  # (not started: no rank process, so none is gone)


@pytest.mark.parametrize(
    "error",
    [
        dist.DistError("gloo: connection reset by peer"),
        dist.DistBackendError("timed out"),
        ExceptionGroup("round", [ValueError("x"), dist.DistNetworkError("closed")]),
        RuntimeError("a batch failed"),  # (with a DistError as its cause)
        # gloo's own, as torch 2.13 raises them (a plain RuntimeError): a rank's process gone, a hung one
        RuntimeError(
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"
            " [127.0.0.1]:34216: Connection reset by peer."
        ),
        RuntimeError(
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
            " waiting 3000ms for recv operation to complete"
        ),
    ],
)
def test_a_collective_that_failed_is_the_groups(error: Exception) -> None:
    if str(error) == "a batch failed":
        error.__cause__ = dist.DistBackendError("the connection dropped")
    assert group().failure(error) is not None


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("start CollaborativeOptimizer.run in a nursery first"),
        FloatingPointError("the loss is nan: training diverged"),
        ExceptionGroup("both", [ValueError("x"), KeyError("y")]),
        # the group stays down (too many failures): never restarted again, whatever the last one was
        GroupRestarted("4 failures within 600 s (the last: RuntimeError: [third_party/gloo/...]): down"),
    ],
)
def test_rank_0s_own_errors_are_not_the_groups(error: Exception) -> None:
    assert group().failure(error) is None


async def prepare() -> None:
    return None


def test_a_released_owner_no_longer_serves_and_another_can_take_its_methods() -> None:
    registry = RpcRegistry()
    old = StateServer(registry, prepare)
    served = registry.names()
    assert served
    with pytest.raises(Exception, match="already registered"):
        StateServer(registry, prepare)
    assert sorted(registry.release(old)) == served
    assert registry.names() == []
    StateServer(registry, prepare)
    assert registry.names() == served
    assert registry.release(old) == []
