"""Low-rank activations on the wire (``pipeline.rank``): the code's sizes, its checks and its error, and a
pipeline that trains with it.

What is proved here: a rank-r code's size follows from the shape alone and is r*(n + C) values instead
of n*C; decoding gives the rank-r truncation (to the compression's error); bytes of the wrong size, a
non-finite or too large value in either factor, or factors whose product exceeds ``max_abs`` are
refused; two honest answers agree and a subtly wrong one does not; and a 2-stage pipeline over the
in-memory network with rank 4 trains (its loss falls on repeated data), every stage's peers hold the
same weights, and its callers send fewer bytes per micro-batch than with int8 alone.
"""

from __future__ import annotations

import pytest
import torch
import trio

from p2ptrain.averaging.compression import Compression, encoded_size
from p2ptrain.errors import ConfigError, RemoteProtocolError
from p2ptrain.pipeline.codec import Wire
from p2ptrain.pipeline.settings import PipelineSection
from tests.integration.test_pipeline import (
    assert_stage_weights_identical,
    one_thread,  # noqa: F401 (its autouse fixture: one torch thread here too)
    pipeline_swarm,
    run_steps,
)


def low_rank(n: int, c: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, c, generator=g)


@pytest.mark.parametrize("mode", [Compression.NONE, Compression.INT8])
def test_a_rank_r_code_is_the_truncation_at_its_size(mode):
    wire = Wire(mode, 4)
    shape = (2, 8, 16)
    exact = low_rank(16, 16, 4, 0).view(shape)  # rank 4: the code loses only the compression's error
    body = wire.encode(exact)
    size = encoded_size(mode, 16 * 4) + encoded_size(mode, 4 * 16)
    assert len(memoryview(body)) == wire.size(shape) == size
    back = wire.decode(body, shape, 1e4, "x")
    tol = 1e-4 if mode is Compression.NONE else 0.05 * float(exact.abs().max())
    assert float((back - exact).abs().max()) <= tol
    noisy = exact + 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    m = noisy.reshape(16, 16)
    u, s, vh = torch.linalg.svd(m)
    truncation = (u[:, :4] * s[:4]) @ vh[:4]
    got = wire.decode(wire.encode(noisy), shape, 1e4, "x").reshape(16, 16)
    assert float((got - truncation).abs().max()) <= (1e-4 if mode is Compression.NONE else tol + 0.05)
    # whole: int8 with one scale per row (per token), the other modes as the all-reduce codes them
    rows = 4 * 2 * 8 if mode is Compression.INT8 else 0
    assert Wire(mode, 0).size(shape) == rows + (2 * 8 * 16 if rows else encoded_size(mode, 2 * 8 * 16))
    assert wire.name == f"{mode.value}+r4" and Wire(mode).name == mode.value


def test_a_rank_r_code_refuses_what_is_not_its_shape_finite_and_in_bounds():
    wire = Wire(Compression.NONE, 2)
    shape = (1, 4, 8)
    good = bytes(wire.encode(low_rank(4, 8, 2, 3).view(shape)))
    with pytest.raises(RemoteProtocolError):
        wire.decode(good[:-4], shape, 1e4, "x")
    with pytest.raises(RemoteProtocolError):
        wire.decode(good + b"\0\0\0\0", shape, 1e4, "x")
    for at in (0, len(good) - 4):  # a NaN in the left factor, then in the right one
        bad = bytearray(good)
        bad[at : at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
        with pytest.raises(RemoteProtocolError):
            wire.decode(bytes(bad), shape, 1e4, "x")
    big = torch.full((4, 2), 300.0)  # each factor within 1e4, their product (2 * 300 * 300) not
    body = big.numpy().tobytes() + torch.full((2, 8), 300.0).numpy().tobytes()
    with pytest.raises(RemoteProtocolError, match="magnitude"):
        wire.decode(body, shape, 1e4, "x")


def test_honest_low_rank_answers_agree_and_a_subtly_wrong_one_does_not():
    wire = Wire(Compression.INT8, 8)
    shape = (4, 16, 32)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    a = wire.decode(wire.encode(x), shape, 1e4, "a")
    b = wire.decode(wire.encode(x + 1e-6 * torch.randn(shape)), shape, 1e4, "b")
    assert wire.agree(a, b)
    wrong = wire.decode(wire.encode(x + 0.5 * x.std() * torch.randn(shape)), shape, 1e4, "c")
    assert not wire.agree(a, wrong)


def test_a_run_files_rank_is_checked():
    wire = PipelineSection(stages=(0, 1), rank=8).wire
    assert (wire.mode, wire.rank) == (Compression.INT8, 8)
    for bad in (-1, 5000, 2.5, True):
        with pytest.raises(ConfigError, match="rank"):
            PipelineSection(stages=(0, 1), rank=bad)  # type: ignore[arg-type]


async def test_a_pipeline_trains_with_low_rank_activations(autojump_clock):
    sent = {}
    for rank in (0, 4):
        pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8, rank=rank)
        async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
            with trio.fail_after(600):
                reports = await run_steps(swarm, 3, 2, 4, data=lambda step, k: k)
            assert all(r.average.applied and r.given_up == 0 for step in reports for r in step)
            assert_stage_weights_identical(swarm)
            losses = [sum(sum(r.losses) for r in s) / sum(len(r.losses) for r in s) for s in reports]
            assert losses[-1] < losses[0] - 0.05, (rank, losses)
            sent[rank] = sum(r.bytes_sent + r.bytes_received for s in reports for r in s)
    assert sent[4] < 0.6 * sent[0], sent
