"""The bytes-per-token benchmark's accounting (pure: no run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulations.benchmarks.bytes_per_token import (
    allgather_per_round,
    measured_payload,
    payload_per_round,
    sent_by_method,
)

PARAMS = 814_464  # a quarter of the benchmark's model: one of four streaming fragments


@pytest.mark.parametrize("peers", [4, 8, 16])
def test_an_all_gather_sends_less_than_shares_for_sparse_contributions_and_more_for_dense(peers: int) -> None:
    # Sparse contributions barely overlap: a reduced share holds about every member's entries, at wider
    # values, so fetching it back costs about what the contributions themselves would.
    assert allgather_per_round("topk0.5-q2", PARAMS, peers) < payload_per_round("topk0.5-q2", PARAMS, peers)
    # Dense ones: a share is 1/n of the model whatever the group, so reducing shares wins by n/2.
    assert allgather_per_round("int8", PARAMS, peers) > payload_per_round("int8", PARAMS, peers) * peers / 3


def test_what_the_bytes_went_to_is_the_mean_over_the_peers(tmp_path: Path) -> None:
    paths = []
    for i, methods in enumerate([{"dht.store": 100, "avg.part": 10}, {"dht.store": 300}]):
        path = tmp_path / f"status{i}.json"
        path.write_text(json.dumps({"traffic": {"sent_by_method": methods}}))
        paths.append(path)
    missing = tmp_path / "gone.json"  # (a peer that wrote no status counts as sending nothing)
    assert sent_by_method([*paths, missing]) == {"dht.store": 133, "avg.part": 3}


def test_a_top_k_round_s_payload_is_what_its_value_streams_carried() -> None:
    methods = {
        "avg.part": 400,
        "avg.fetch_early": 3000,
        "avg.fetch": 200,
        "avg.relay_result": 0,
        "dht.store": 900,
    }
    assert measured_payload(methods, 4) == 900  # (400 + 3000 + 200) / 4 rounds; the DHT is background
    assert measured_payload({"dht.store": 10}, 2) == 0
