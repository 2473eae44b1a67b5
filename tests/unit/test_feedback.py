"""DiLoCo's error feedback for top-k rounds (``training.optimizer.feedback``): what a round sends plus
what the peer keeps is exactly its progress; an aborted round gives the residual back;
nothing is ever lost."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging import sparse
from p2ptrain.averaging.compression import Compression, roundtrip
from p2ptrain.training.optimizer.buffers import ParamBuffer
from p2ptrain.training.optimizer.feedback import ErrorFeedback
from p2ptrain.training.state.codec import StateError

MODE = Compression.TOPK1_Q2


def params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(s, dtype=dtype) for s in shapes]


def pseudo_gradient(buf: ParamBuffer, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    for v in buf.views:
        v.copy_(torch.randn(v.shape, generator=g))
    return torch.cat([v.reshape(-1).float() for v in buf.views])


def test_what_is_sent_plus_what_is_kept_is_every_round_of_progress() -> None:
    ps = params((300, 40), (2 * sparse.BLOCK + 17,))
    fb = ErrorFeedback(ps, MODE)
    total_progress = torch.zeros(fb.residual.numel(), dtype=torch.float64)
    total_sent = torch.zeros_like(total_progress)
    for seed in range(6):
        buf = ParamBuffer(ps)
        delta = pseudo_gradient(buf, seed)
        before = fb.fold(buf)
        sent = buf.flat.clone()  # type: ignore[union-attr]
        assert torch.equal(roundtrip(sent, MODE), sent)  # exactly what the round sends, nothing more lost
        assert (sent != 0).float().mean() < 0.02
        fb.forget(before)
        total_progress += delta.double()
        total_sent += sent.double()
    torch.testing.assert_close(total_sent + fb.residual.double(), total_progress, rtol=0, atol=1e-4)
    # coordinates that a single round would never send still go, late: far more than one round's 1%
    assert (total_sent != 0).float().mean() > 0.04


def test_an_aborted_round_leaves_the_residual_as_it_was_and_a_lone_step_takes_it_all() -> None:
    ps = params((5000,))
    fb = ErrorFeedback(ps, MODE)
    buf = ParamBuffer(ps)
    pseudo_gradient(buf, 1)
    fb.forget(fb.fold(buf))
    kept = fb.residual.clone()
    assert kept.abs().sum() > 0
    buf = ParamBuffer(ps)
    pseudo_gradient(buf, 2)
    before = fb.fold(buf)
    assert not torch.equal(fb.residual, kept)
    fb.unfold(before)
    assert torch.equal(fb.residual, kept)
    lone = ParamBuffer(ps)
    fb.flush_into(lone)
    assert torch.equal(lone.flat, kept) and not fb.residual.any()  # type: ignore[arg-type]


def test_parameters_of_other_dtypes_keep_the_difference_to_what_their_dtype_sends() -> None:
    ps = params((3000,), dtype=torch.bfloat16) + params((2000,))
    fb = ErrorFeedback(ps, MODE)
    buf = ParamBuffer(ps)  # mixed dtypes: separate views, no flat buffer
    assert buf.flat is None
    delta = pseudo_gradient(buf, 3)
    fb.forget(fb.fold(buf))
    sent = torch.cat([v.reshape(-1).float() for v in buf.views])
    torch.testing.assert_close(sent + fb.residual, delta, rtol=0, atol=1e-6)


def test_a_residual_of_another_shape_is_refused() -> None:
    fb = ErrorFeedback(params((10,)), MODE)
    with pytest.raises(StateError, match="expected float32"):
        fb.load(torch.zeros(11))
    with pytest.raises(ValueError, match="top-k"):
        ErrorFeedback(params((10,)), Compression.INT8)
