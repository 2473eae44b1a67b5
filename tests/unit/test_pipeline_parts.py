"""The pipeline's pure parts: the [pipeline] section, the split of the GPT, the activation codec and its
checks, the router's choice of peer and a joiner's choice of stage."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from p2ptrain.averaging.compression import Compression
from p2ptrain.config import parse_config
from p2ptrain.errors import ConfigError, RemoteProtocolError
from p2ptrain.identity import Identity
from p2ptrain.pipeline import codec
from p2ptrain.pipeline.directory import StagePeer, choose_stage, plan_move
from p2ptrain.pipeline.protocol import StageRecord
from p2ptrain.pipeline.router import Candidate, pick
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import build_stage, split_gpt, stage_loss
from p2ptrain.pipeline.transfer import (
    CHECKPOINT_MAGIC,
    Snapshot,
    StateUnavailable,
    apply_snapshot,
    load_checkpoint,
    save_checkpoint,
    take_snapshot,
)
from p2ptrain.tasks.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)


def test_the_section_is_checked() -> None:
    assert not PipelineSection().enabled
    p = PipelineSection(stages=(0, 1, 3), compression="none")  # type: ignore[arg-type]
    assert p.bounds(4) == [(0, 1), (1, 3), (3, 4)] and p.compression is Compression.NONE
    for bad, words in [
        ({"stages": (1, 2)}, "start with 0"),
        ({"stages": (0, 2, 2)}, "increasing"),
        ({"stages": (0,)}, "2 to"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"check_fraction": 1.5}, "check_fraction"),
        ({"compression": "topk1-q2"}, "top-k"),
        ({"compression": "zip"}, "unknown compression"),
        ({"timeout": 0.0}, "timeout"),
    ]:
        with pytest.raises(ConfigError, match=words):
            PipelineSection(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least one"):
        PipelineSection(stages=(0, 4)).bounds(4)


def test_a_run_file_takes_the_section() -> None:
    run = parse_config({"pipeline": {"stages": [0, 2], "micro_batch": 2, "compression": "int8"}})
    assert run.pipeline.stages == (0, 2) and run.pipeline.compression is Compression.INT8
    with pytest.raises(ConfigError, match=r"pipeline\.nope"):
        parse_config({"pipeline": {"nope": 1}})


def _batch(seed: int, b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (b, CFG.block_size + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def test_the_split_model_gives_the_unsplit_gradients_exactly() -> None:
    torch.manual_seed(3)
    full = GPT(CFG)
    torch.manual_seed(3)
    stages = split_gpt(GPT(CFG), PipelineSection(stages=(0, 1, 3)))
    x, y = _batch(0)
    loss = stage_loss(full(x), y)
    loss.backward()
    h = x
    for stage in stages:
        h = stage(h)
    split_loss = stage_loss(h, y)
    split_loss.backward()
    assert split_loss.item() == loss.item()
    first, last = stages[0], stages[-1]
    assert first.wte is not None and last.lm_head is not None
    tied = first.wte.weight.grad + last.lm_head.weight.grad  # type: ignore[operator]
    torch.testing.assert_close(tied, full.wte.weight.grad, rtol=0, atol=1e-7)
    for i, block in enumerate(full.blocks):
        stage = next(s for s in stages if s.first_layer <= i < s.end_layer)
        mine = stage.blocks[i - stage.first_layer]
        for (name, p), q in zip(block.named_parameters(), mine.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-7, msg=name)
    assert sum(s.num_parameters() for s in stages) == full.num_parameters() + CFG.vocab_size * CFG.n_embd


def test_every_peer_builds_the_same_stage() -> None:
    p = PipelineSection(stages=(0, 2))
    a, b = build_stage(CFG, p, 1, seed=7), build_stage(CFG, p, 1, seed=7)
    assert all(torch.equal(u, v) for u, v in zip(a.parameters(), b.parameters(), strict=True))
    with pytest.raises(ValueError, match="dropout"):
        split_gpt(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, dropout=0.1)), p)


@pytest.mark.parametrize("mode", list(Compression)[:4])
def test_activations_roundtrip_within_the_bound(mode: Compression) -> None:
    x = torch.randn(2, 16, 32)
    buf = codec.encode_tensor(x, mode)
    assert len(memoryview(buf)) == codec.wire_size(mode, (2, 16, 32))
    out = codec.decode_tensor(buf, mode, (2, 16, 32), 1e4, "test")
    assert codec.agree(x, out, mode)
    assert float((x - out).abs().max()) <= codec.tolerance(x, mode)


def test_int8_activations_keep_every_tokens_resolution() -> None:
    """One scale per token: a token with a large value does not flatten its neighbours' vectors (with a
    scale per 1024 values they quantized to nearly constant rows, which a LayerNorm then blew up)."""
    x = torch.randn(2, 16, 32) * 0.01
    x[0, 0, 0] = 100.0
    out = codec.decode_tensor(
        codec.encode_tensor(x, Compression.INT8), Compression.INT8, (2, 16, 32), 1e4, "t"
    )
    rows, got = x.reshape(-1, 32)[1:], out.reshape(-1, 32)[1:]
    assert float(((rows - got).abs().amax(dim=1) / rows.abs().amax(dim=1)).max()) <= 1 / 254 + 1e-6
    assert codec.wire_size(Compression.INT8, (2, 16, 32)) == 4 * 32 + 2 * 16 * 32


def test_hostile_activations_are_refused() -> None:
    x = torch.randn(2, 16, 32)
    good = bytes(codec.encode_tensor(x, Compression.INT8))
    shape = (2, 16, 32)
    nan_scale = bytearray(good)
    nan_scale[:4] = torch.tensor([float("nan")]).numpy().tobytes()
    raw = bytearray(bytes(codec.encode_tensor(x, Compression.NONE)))
    raw[8:12] = torch.tensor([float("inf")]).numpy().tobytes()
    cases = [
        (good[:-1], Compression.INT8, "bytes"),
        (good + b"\0", Compression.INT8, "bytes"),
        (bytes(nan_scale), Compression.INT8, "scale"),
        (bytes(raw), Compression.NONE, "NaN or infinite"),
        (bytes(codec.encode_tensor(x * 1e6, Compression.INT8)), Compression.INT8, "magnitude"),
    ]
    for buf, mode, words in cases:
        with pytest.raises(RemoteProtocolError, match=words):
            codec.decode_tensor(buf, mode, shape, 1e4, "test")
    ids = torch.tensor([[1, 2], [3, 300]])
    with pytest.raises(RemoteProtocolError, match="outside"):
        codec.decode_tokens(codec.encode_tokens(ids), (2, 2), 256, "test")
    with pytest.raises(RemoteProtocolError, match="bytes"):
        codec.decode_tokens(codec.encode_tokens(ids)[:-1], (2, 2), 256, "test")
    assert torch.equal(codec.decode_tokens(codec.encode_tokens(ids), (2, 2), 512, "t"), ids)


def test_stochastic_rounding_is_unbiased() -> None:
    """int8 rounding at random (``pipeline.rounding = "stochastic"``): each draw lands on one of the two
    grid points around a value, and the mean of many draws converges to the value itself, where rounding
    to the nearest point keeps its error however many draws are averaged."""
    codec.seed_rounding(5)
    torch.manual_seed(5)
    shape = (2, 8, 32)
    x = torch.randn(shape) * torch.logspace(-3, 1, 16).view(2, 8, 1)  # rows of very different scales
    step = (x.abs().amax(dim=-1, keepdim=True) / 127).expand(shape)
    sto = codec.Wire(Compression.INT8, rounding=codec.Rounding.STOCHASTIC)
    near = codec.Wire(Compression.INT8, rounding=codec.Rounding.NEAREST)
    draws = 4000
    many = x.expand(draws, *shape)  # every row drawn anew, with its own scale (that of its copy of x)
    outs = sto.decode(sto.encode(many), (draws, *shape), 1e4, "t")
    assert float(((outs - x).abs() / step).max()) < 1 + 1e-4  # one of the two points around x
    assert all(sto.agree(x, outs[k]) for k in range(0, draws, 97))
    mean = outs.to(torch.float64).mean(dim=0).to(torch.float32)
    # a draw's error is at most one step, so its spread at most half a step: the mean's, over 4000
    # draws, at most 0.008 steps; 0.05 steps is over six of those
    assert float(((mean - x).abs() / step).max()) < 0.05
    nearest = near.decode(near.encode(x), shape, 1e4, "t")
    assert float(((nearest - x).abs() / step).max()) > 0.4  # nearest: a bias of up to half a step
    # on average over the values: stochastic's mean error is far below nearest's
    assert float(((mean - x).abs() / step).mean()) < 0.1 * float(((nearest - x).abs() / step).mean())
    # the draws are the codec's own: torch's global generator (models, data) does not move
    state = torch.get_rng_state()
    sto.encode(x)
    assert torch.equal(state, torch.get_rng_state())


def test_stochastic_rounding_keeps_the_wire_checks() -> None:
    """Rounding is the sender's business: the decoder, and so every check on what arrives, is the same.
    An honest encoding stays within ``max_abs`` and finite; whatever bytes a hostile peer sends (seeded
    random scales, values and sizes) decode to finite values within ``max_abs`` or are refused."""
    codec.seed_rounding(6)
    shape = (2, 4, 16)
    sto = codec.Wire(Compression.INT8, rounding=codec.Rounding.STOCHASTIC)
    x = torch.randn(shape)
    x[0, 0, 0] = 9999.99  # a row's largest value right at max_abs: never rounded past it
    for _ in range(200):
        out = sto.decode(sto.encode(x), shape, 1e4, "t")
        assert bool(torch.isfinite(out).all()) and float(out.abs().max()) <= 1e4
    with pytest.raises(RemoteProtocolError, match="magnitude"):
        sto.decode(sto.encode(x * 2), shape, 1e4, "t")
    with pytest.raises(ValueError, match="NaN"):
        sto.encode(torch.full(shape, float("nan")))
    rng = np.random.default_rng(6)
    rows, cols = 8, 16
    specials = np.array([np.nan, np.inf, -np.inf, -1.0, 1e38, 3e38, 1e4 / 127, 1e4 / 126, 0.0], "<f4")
    refused = 0
    for trial in range(300):
        scales = (rng.normal(size=rows) * 10.0 ** rng.integers(-3, 2)).astype("<f4")
        scales = np.abs(scales) if trial % 3 else scales  # negative scales now and then
        hits = rng.random(rows) < 0.2
        scales[hits] = rng.choice(specials, size=int(hits.sum()))
        values = rng.integers(-127, 128, size=rows * cols, dtype=np.int8)
        if trial % 5 == 0:
            values[int(rng.integers(0, values.size))] = -128  # outside the symmetric range
        buf = scales.tobytes() + values.tobytes()
        if trial % 7 == 0:
            buf = buf[: int(rng.integers(0, len(buf)))]
        try:
            out = sto.decode(buf, shape, 1e4, "hostile")
        except RemoteProtocolError:
            refused += 1
            continue
        assert bool(torch.isfinite(out).all()) and float(out.abs().max()) <= 1e4
    assert 0 < refused < 300


def test_the_rounding_is_a_setting() -> None:
    assert PipelineSection().rounding is codec.Rounding.NEAREST
    assert PipelineSection().wire.rounding is codec.Rounding.NEAREST
    run = parse_config({"pipeline": {"stages": [0, 2], "rounding": "stochastic"}})
    assert run.pipeline.wire.rounding is codec.Rounding.STOCHASTIC
    # the wire format is the same either way: a swarm that mixes the two interoperates
    assert run.pipeline.wire.name == PipelineSection().wire.name == "int8"
    with pytest.raises(ConfigError, match="rounding"):
        PipelineSection(rounding="up")  # type: ignore[arg-type]


def _peers(n: int) -> list[Identity]:
    return [Identity.generate() for _ in range(n)]


def test_the_router_weighs_by_throughput_and_queue() -> None:
    ids = _peers(3)
    cands = [
        Candidate(ids[0].peer_id, "a", throughput=10.0),
        Candidate(ids[1].peer_id, "b", throughput=30.0),
        Candidate(ids[2].peer_id, "c", throughput=30.0, queue=2),
    ]
    rng = random.Random(1)
    seen = Counter(pick(cands, rng, set()).address for _ in range(6000))  # type: ignore[union-attr]
    # weights 10 : 30 : 10
    assert (
        0.15 < seen["a"] / 6000 < 0.25 and 0.55 < seen["b"] / 6000 < 0.65 and 0.15 < seen["c"] / 6000 < 0.25
    )
    assert pick(cands, rng, {ids[1].peer_id, ids[2].peer_id}).address == "a"  # type: ignore[union-attr]
    assert pick(cands, rng, {i.peer_id for i in ids}) is None
    fresh = [Candidate(ids[0].peer_id, "a"), Candidate(ids[1].peer_id, "b", throughput=4.0)]
    assert {pick(fresh, rng, set()).address for _ in range(100)} == {"a", "b"}  # type: ignore[union-attr]


def test_a_joiner_takes_the_stage_that_limits_the_swarm() -> None:
    ids = _peers(4)

    def peer(i: int, stage: int, speed: float) -> StagePeer:
        return StagePeer(ids[i].peer_id, StageRecord(stage, 3, ("x",), speed))

    assert choose_stage([], 3) == (0, "stage 0 has no peer")
    assert choose_stage([peer(0, 0, 5.0), peer(1, 2, 5.0)], 3)[0] == 1
    stage, why = choose_stage([peer(0, 0, 5.0), peer(1, 1, 2.0), peer(2, 2, 9.0)], 3)
    assert stage == 1 and "lowest throughput" in why
    # its own entry is left out: it asks as a newcomer
    assert (
        choose_stage(
            [peer(0, 0, 5.0), peer(1, 1, 2.0), peer(2, 2, 9.0), peer(3, 1, 100.0)], 3, me=ids[3].peer_id
        )[0]
        == 1
    )


def _entry(peer: Identity, stage: int, throughput: float, joining: bool = False) -> StagePeer:
    return StagePeer(
        peer.peer_id, StageRecord(stage, 3, ("/ip4/1.2.3.4/tcp/1",), throughput, joining=joining)
    )


def test_a_stage_with_no_peer_is_refilled_by_a_spare_peer_of_another_stage() -> None:
    rng = random.Random(5)
    for _ in range(50):
        ids = [Identity.generate() for _ in range(rng.randint(3, 7))]
        stages = [rng.choice([0, 1]) for _ in ids]  # stage 2 is empty
        entries = [_entry(i, s, rng.uniform(1, 10)) for i, s in zip(ids, stages, strict=True)]
        plans = {i.peer_id: plan_move(entries, i.peer_id, 3) for i in ids}
        movers = [p for p, plan in plans.items() if plan is not None]
        empty = [s for s in range(3) if s not in stages]
        spare = sum(max(0, stages.count(s) - 1) for s in range(3))
        assert len(movers) == min(len(empty), spare)
        assert sorted(plan[0] for plan in plans.values() if plan is not None) == empty[: len(movers)]
        after = list(stages)
        for p in movers:
            plan = plans[p]
            assert plan is not None
            after[[i.peer_id for i in ids].index(p)] = plan[0]
        assert all(after.count(s) >= 1 for s in set(stages))  # no stage emptied by the moves


def test_one_peer_moves_to_the_stage_that_limits_the_swarm_when_that_raises_it_enough() -> None:
    a, b, c, d = (Identity.generate() for _ in range(4))
    # stage 1 costs three times stage 0 per sample: 2 peers each leave stage 1 the bottleneck
    entries = [_entry(a, 0, 30.0), _entry(b, 0, 30.0), _entry(c, 1, 10.0), _entry(d, 1, 10.0)]
    plans = {i.peer_id: plan_move(entries, i.peer_id, 2) for i in (a, b, c, d)}
    movers = {p: plan for p, plan in plans.items() if plan is not None}
    assert len(movers) == 1  # one of stage 0's peers (the same one on every peer)
    (mover, plan) = next(iter(movers.items()))
    assert mover in (a.peer_id, b.peer_id) and plan is not None and plan[0] == 1
    # balanced enough: nobody moves (a move would gain less than MOVE_GAIN)
    balanced = [_entry(a, 0, 30.0), _entry(c, 1, 10.0), _entry(d, 1, 10.0), _entry(b, 1, 10.0)]
    assert all(plan_move(balanced, i.peer_id, 2) is None for i in (a, b, c, d))
    # a speed not measured yet (0): no move for throughput
    unmeasured = [*entries[:3], _entry(d, 1, 0.0)]
    assert all(plan_move(unmeasured, i.peer_id, 2) is None for i in (a, b, c, d))
    # a joining peer serves nothing and moves nowhere
    assert plan_move([*entries[:3], _entry(d, 1, 10.0, joining=True)], d.peer_id, 2) is None


def test_a_stage_checkpoint_round_trips_and_anything_else_is_no_checkpoint(tmp_path) -> None:
    pipeline = PipelineSection(stages=(0, 2))
    stage = build_stage(CFG, pipeline, 1, seed=3)
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.1)
    stage_loss(stage(torch.randn(2, 8, CFG.n_embd)), torch.randint(0, 256, (2, 8))).backward()
    opt.step()
    snap = take_snapshot(7, params, opt)
    path = tmp_path / "pipeline" / "stage.ckpt"
    save_checkpoint(path, 1, snap)
    loaded = load_checkpoint(path)
    assert loaded is not None and loaded[0] == 1
    assert (loaded[1].step, loaded[1].adam_steps, loaded[1].body) == (7, 1, snap.body)
    other = build_stage(CFG, pipeline, 1, seed=4)
    other_params = [p for p in other.parameters() if p.requires_grad]
    other_opt = torch.optim.AdamW(other_params, lr=0.1)
    apply_snapshot(loaded[1], other_params, other_opt)
    for a, b in zip(params, other_params, strict=True):
        assert torch.equal(a, b) and torch.equal(opt.state[a]["exp_avg_sq"], other_opt.state[b]["exp_avg_sq"])
    for junk in (b"", b"not a checkpoint", CHECKPOINT_MAGIC + b"{broken\n" + snap.body):
        path.write_bytes(junk)
        assert load_checkpoint(path) is None
    assert load_checkpoint(tmp_path / "missing") is None
    # a checkpoint of another stage's size, or with a NaN, is refused whole when applied
    with pytest.raises(StateUnavailable):
        apply_snapshot(Snapshot(7, 1, snap.body[:-4], ()), other_params, other_opt)
    nan = bytearray(snap.body)
    nan[0:4] = np.float32("nan").tobytes()
    with pytest.raises(StateUnavailable):
        apply_snapshot(Snapshot(7, 1, bytes(nan), ()), other_params, other_opt)
