"""A stage peer's link in the pipeline's choices: a peer whose link cannot carry its stage's activations at
its compute speed counts at the link's rate (``directory.effective``) when a joiner chooses its stage,
when the move planner looks for the stage that limits the swarm, and when a caller weighs a stage's
peers; its directory record carries the bandwidth it measured (an older record without one decodes to 0:
unknown, the compute speed counts)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from p2ptrain.averaging.compression import Compression
from p2ptrain.identity import Identity
from p2ptrain.pipeline.directory import (
    StagePeer,
    choose_stage,
    effective,
    link_bytes_per_sample,
    plan_move,
    stage_totals,
)
from p2ptrain.pipeline.protocol import StageRecord
from p2ptrain.pipeline.router import Candidate, pick
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.tasks.gpt import GPTConfig
from p2ptrain.wire.codec import pack, unpack

MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=2, n_embd=128)


def test_a_samples_link_bytes_follow_the_boundaries_and_the_compression() -> None:
    dense = link_bytes_per_sample(MODEL, PipelineSection(stages=(0, 1, 2), compression=Compression.NONE))
    int8 = link_bytes_per_sample(MODEL, PipelineSection(stages=(0, 1, 2), compression=Compression.INT8))
    act = 64 * 128 * 4  # one boundary's activation, float32
    assert dense == [4 * 64 + 2 * act, 4 * act, 2 * act + 4 * 64]  # the middle stage has two boundaries
    assert all(i < d / 3 for i, d in zip(int8, dense, strict=True))


def test_the_effective_throughput_is_the_lower_of_compute_and_link() -> None:
    assert effective(100.0, 0.0, 1000.0) == 100.0  # bandwidth unknown
    assert effective(100.0, 50_000.0, 0.0) == 100.0  # size unknown
    assert effective(100.0, 50_000.0, 1000.0) == 50.0  # the link carries 50 samples/s
    assert effective(10.0, 50_000.0, 1000.0) == 10.0


def _entry(who: Identity, stage: int, speed: float, bandwidth: float = 0.0, stages: int = 2) -> StagePeer:
    return StagePeer(who.peer_id, StageRecord(stage, stages, ("x",), speed, bandwidth=bandwidth))


def test_a_joiner_counts_a_stage_peer_at_its_links_rate() -> None:
    ids = [Identity.generate() for _ in range(3)]
    lb = [1000.0, 1000.0]
    # stage 1's peer computes 150 samples/s, but its link carries 50 of them
    peers = [_entry(ids[0], 0, 100.0), _entry(ids[1], 1, 150.0, bandwidth=50_000.0)]
    assert choose_stage(peers, 2)[0] == 0  # compute speeds alone: stage 0 (100) limits
    stage, why = choose_stage(peers, 2, link_bytes=lb)
    assert stage == 1 and "50.0 samples/s" in why
    assert stage_totals(peers, 2, lb) == [(100.0, 1), (50.0, 1)]


def test_the_move_planner_sees_a_stage_limited_by_its_peers_links() -> None:
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
    a, b, c = ids
    peers = [_entry(a, 0, 100.0), _entry(b, 0, 100.0), _entry(c, 1, 150.0, bandwidth=50_000.0)]
    lb = [1000.0, 1000.0]
    assert all(plan_move(peers, i.peer_id, 2) is None for i in ids)  # 200 against 150: no gain worth it
    plans = {i.peer_id: plan_move(peers, i.peer_id, 2, lb) for i in ids}
    movers = [p for p, plan in plans.items() if plan is not None]
    assert movers == [a.peer_id] and plans[a.peer_id][0] == 1  # type: ignore[index]
    # peers whose links are narrow count at their links' rate on their own stage too
    slow_links = [_entry(a, 0, 100.0, 20_000.0), _entry(b, 0, 100.0, 20_000.0), peers[2]]
    # stage 0 now limits (2 x 20 samples/s on its links) and stage 1's only peer cannot leave it
    assert all(plan_move(slow_links, i.peer_id, 2, lb) is None for i in ids)


def test_the_router_weighs_a_peer_at_its_links_rate() -> None:
    ids = [Identity.generate() for _ in range(2)]
    cands = [
        Candidate(ids[0].peer_id, "a", throughput=30.0, bandwidth=10_000.0),  # 10 samples/s on its link
        Candidate(ids[1].peer_id, "b", throughput=30.0),
    ]
    rng = random.Random(3)
    seen = Counter(pick(cands, rng, set(), 1000.0).address for _ in range(4000))  # type: ignore[union-attr]
    assert 0.2 < seen["a"] / 4000 < 0.3  # 10 : 30
    seen = Counter(pick(cands, rng, set()).address for _ in range(4000))  # type: ignore[union-attr]
    assert 0.45 < seen["a"] / 4000 < 0.55  # links not counted: 30 : 30


@pytest.mark.parametrize("bandwidth", [0.0, 12_500_000.0])
def test_a_stage_record_carries_its_bandwidth_and_an_old_one_decodes(bandwidth: float) -> None:
    record = StageRecord(1, 4, ("x",), 12.0, 2, 7, 1.0, False, False, b"d" * 8, bandwidth)
    assert StageRecord.from_obj(unpack(pack(record.to_obj()))) == record
    old = list(record.to_obj())[:10]  # a record written before the field existed
    assert StageRecord.from_obj(unpack(pack(old))).bandwidth == 0.0
