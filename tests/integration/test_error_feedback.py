"""DiLoCo with top-k rounds on the in-memory network: peers that send 3% of each block, at 4 bits,
still hold the same global parameters after every outer step and still learn; the residual a peer keeps
goes into its checkpoints and never into the state it serves."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.authority import authority_key_text
from p2ptrain.training.state import checkpoint
from p2ptrain.training.state.codec import StateError
from tests.harness.training import check_identical_per_epoch, mid_model, run_config, swarm, validation_loss

pytestmark = pytest.mark.timeout(300)
PRIVATE = authority_key_text(
    bytes(range(32))
)  # top-k is for private swarms: a run file refuses it in an open one


def topk_config(overlap: bool = False):
    return (
        run_config("diloco", overlap)
        .replace("run", authority=PRIVATE)
        .replace("averaging", compression="topk3-q4")
    )


@pytest.mark.parametrize("overlap", [False, True], ids=["diloco", "diloco-overlap"])
async def test_topk_diloco_peers_stay_identical_and_learn(autojump_clock: object, overlap: bool) -> None:
    async with swarm(topk_config(overlap)) as s:
        s.make_model = mid_model
        peers = [await s.start(compute=c) for c in (0.1, 0.15, 0.2)]
        start = validation_loss(peers[0].model)
        await s.until(lambda: all(p.opt.epoch >= 6 for p in peers), timeout=200)
        check_identical_per_epoch(peers)
        assert min(p.opt.stats.averaged for p in peers) >= 3
        for p in peers:
            assert p.opt.feedback is not None and p.opt.feedback.residual.abs().sum() > 0
        at = min(p.opt.epoch for p in peers)
        assert min(validation_loss(p.model) for p in peers if p.opt.epoch == at) < 0.8 * start


async def test_the_residual_travels_in_checkpoints_only(tmp_path) -> None:
    async with swarm(topk_config()) as s:
        s.make_model = mid_model
        a = await s.start(train=False)
        b = await s.start(train=False)
        assert a.opt.feedback is not None and b.opt.feedback is not None
        a.opt.feedback.residual.normal_()
        served, meta = a.opt.capture()
        assert not any(name.startswith("extra.") for name in served)  # a joiner must not send it twice
        tensors, meta = a.opt.capture(own=True)
        checkpoint.save(tmp_path, a.opt.epoch, tensors, meta, {"peer": "a"})
        found = checkpoint.latest(tmp_path)
        assert found is not None
        b.opt.restore(found[1], found[2])
        assert torch.equal(b.opt.feedback.residual, a.opt.feedback.residual)
        b.opt.restore(served, meta)  # a state without one: this peer's own residual is void
        assert not b.opt.feedback.residual.any()
        # a download (checked against its digest) that brings a residual is refused, nothing applied
        b.opt.feedback.residual.fill_(1.0)
        with pytest.raises(StateError, match="unexpected extra tensor"):
            b.opt.restore(tensors, meta, epoch=a.opt.epoch)
        assert torch.equal(b.opt.feedback.residual, torch.ones_like(b.opt.feedback.residual))
