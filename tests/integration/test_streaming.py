"""Streaming DiLoCo on the in-memory network: with ``diloco.fragments = F`` step t averages and steps
fragment t mod F alone, every peer holds the same bits after each step, a joiner's download lands on
the same state, and top-k rounds keep one residual slice per fragment."""

from __future__ import annotations

import pytest
import torch
import trio

from p2ptrain.authority import authority_key_text
from p2ptrain.config import RunConfig
from p2ptrain.errors import ConfigError
from p2ptrain.training.optimizer.bookkeeping import run_fingerprint
from p2ptrain.training.optimizer.fragments import split
from tests.harness.training import (
    TARGET,
    check_identical_per_epoch,
    mid_model,
    run_config,
    swarm,
    validation_loss,
)

pytestmark = pytest.mark.timeout(300)
FRAGMENTS = 3
PRIVATE = authority_key_text(
    bytes(range(32))
)  # top-k is for private swarms: a run file refuses it in an open one


def streaming(overlap: bool = False, fragments: int = FRAGMENTS, compression: str = "none") -> RunConfig:
    return (
        run_config("diloco", overlap)
        .replace("run", authority=PRIVATE if compression.startswith("topk") else "")
        .replace("diloco", fragments=fragments)
        .replace("averaging", compression=compression)
    )


def watch_outer_steps(opt) -> list[tuple[int, set[int]]]:  # type: ignore[no-untyped-def]
    """(step, indices of the global parameters that step changed) for every step ``opt`` takes."""
    seen: list[tuple[int, set[int]]] = []
    before = [g.clone() for g in opt.global_params]
    advance = opt.tally.advance

    def spy(others, by_round):  # type: ignore[no-untyped-def]
        changed = {
            i for i, (a, b) in enumerate(zip(before, opt.global_params, strict=True)) if not torch.equal(a, b)
        }
        seen.append((opt.epoch, changed))
        for a, b in zip(before, opt.global_params, strict=True):
            a.copy_(b)
        advance(others, by_round)

    opt.tally.advance = spy
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["streaming", "streaming-overlap"])
async def test_each_step_averages_one_fragment_and_peers_stay_identical(
    autojump_clock: object, overlap: bool
) -> None:
    async with swarm(streaming(overlap)) as s:
        s.make_model = mid_model
        peers = [await s.start(compute=c) for c in (0.1, 0.15, 0.2)]
        seen = watch_outer_steps(peers[0].opt)
        start = validation_loss(peers[0].model)
        await s.until(lambda: all(p.opt.epoch >= 2 * FRAGMENTS + 1 for p in peers), timeout=200)
        check_identical_per_epoch(peers)
        assert min(p.opt.stats.averaged for p in peers) >= FRAGMENTS
        fragments = peers[0].opt.fragments
        assert len(fragments) == FRAGMENTS
        assert len(seen) >= 2 * FRAGMENTS
        for epoch, changed in seen:
            # the step's own fragment moved, and nothing else did
            assert changed == set(fragments[epoch % FRAGMENTS]), (epoch, changed)
        at = min(p.opt.epoch for p in peers)
        assert min(validation_loss(p.model) for p in peers if p.opt.epoch == at) < 0.9 * start


async def test_a_joiner_lands_on_the_streamed_state_and_stays_identical(autojump_clock: object) -> None:
    # steps of a few progress intervals, as in the plain joiner test: a joiner can then make a group
    config = streaming().replace("training", target_batch_size=4 * TARGET)
    async with swarm(config) as s:
        s.make_model = mid_model
        peers = [await s.start(compute=0.1), await s.start(compute=0.1)]
        await s.until(lambda: all(p.opt.epoch >= FRAGMENTS + 1 for p in peers), timeout=120)
        late = await s.start(compute=0.1)
        await s.until(lambda: late.opt.stats.syncs >= 1, timeout=60)
        assert late.opt.epoch >= FRAGMENTS + 1
        # the download put the joiner on the fragment of the step it landed on
        assert late.opt.contribution.slots == late.opt.fragments[late.opt.epoch % FRAGMENTS]
        await s.until(lambda: late.opt.stats.averaged >= FRAGMENTS, timeout=120)
        check_identical_per_epoch([*peers, late])
        assert late.steps[0][2] == "synced"


async def test_topk_rounds_keep_a_residual_slice_per_fragment(autojump_clock: object) -> None:
    async with swarm(streaming(compression="topk3-q4")) as s:
        s.make_model = mid_model
        peers = [await s.start(compute=c) for c in (0.1, 0.15)]
        await s.until(lambda: all(p.opt.epoch >= FRAGMENTS + 1 for p in peers), timeout=200)
        check_identical_per_epoch(peers)
        opt = peers[0].opt
        assert opt.feedback is not None
        sizes = [p.numel() for p in opt.params]
        # every fragment's round folded its own slice (the biases' blocks are small: the weights' have
        # values top-k left out)
        for fragment, start in zip(opt.fragments, opt.contribution.starts, strict=True):
            n = sum(sizes[i] for i in fragment)
            assert start == sum(sizes[: fragment.start])
            assert opt.feedback.residual[start : start + n].abs().sum() > 0, fragment


def test_the_parameters_split_into_contiguous_fragments_of_about_equal_size() -> None:
    for sizes, count in [([10] * 4, 2), ([100, 1, 1, 1], 2), ([1, 1, 1, 100], 2), ([5] * 7, 3), ([3], 1)]:
        parts = split(sizes, count)
        assert len(parts) == count and all(len(p) > 0 for p in parts)
        assert [i for p in parts for i in p] == list(range(len(sizes)))  # contiguous, each once, in order
    assert [5 * len(p) for p in split([5] * 7, 3)] == [10, 15, 10]  # cuts at the nearest boundary
    with pytest.raises(ValueError, match="cannot cut"):
        split([1, 2], 3)


async def test_fragments_need_diloco_parameters_enough_and_are_part_of_the_run() -> None:
    with pytest.raises(ConfigError, match=r"training\.mode = 'diloco'"):
        RunConfig().replace("diloco", fragments=2)
    with pytest.raises(ConfigError, match=r"diloco\.fragments"):
        RunConfig().replace("diloco", fragments=0)
    model = mid_model()
    # peers that cut the model differently average different tensors each step: not one run
    assert run_fingerprint(streaming(), model) != run_fingerprint(streaming(fragments=1), model)
    assert run_fingerprint(streaming(fragments=1), model) == run_fingerprint(run_config("diloco"), model)
    # top-k runs: releases whose reduced sums differ on the wire are not one run either
    topk = run_config("diloco").replace("run", authority=PRIVATE).replace("averaging", compression="topk1-q2")
    assert run_fingerprint(topk, model) != run_fingerprint(run_config("diloco"), model)
    with trio.fail_after(30):
        async with swarm(streaming(fragments=7)) as s:
            s.make_model = mid_model  # 6 parameter tensors
            with pytest.raises(ConfigError, match="only 6 trainable parameters"):
                await s.start(train=False)
