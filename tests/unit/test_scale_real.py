"""The real-against-simulated comparison counts what the simulator counts: control bytes per peer per
global step, the methods that carry model values left out, steps from the furthest peer."""

from collections import Counter

from simulations.benchmarks.scale_real import compare, control_per_step
from simulations.scale.swarm import DATA_METHODS


def test_control_bytes_per_step_leave_out_the_model_values_and_take_the_median_peer() -> None:
    data = sorted(DATA_METHODS)[0]
    before = {
        0: (Counter({"dht.store": 100, data: 10_000}), 3, 10.0),
        1: (Counter({"dht.store": 0}), 2, 10.0),
        2: (Counter(), 3, 10.0),
    }
    after = {
        0: (Counter({"dht.store": 700, "avg.join": 300, data: 90_000}), 7, 10.0),
        1: (Counter({"dht.store": 1_600, "avg.join": 400}), 6, 10.0),
        2: (Counter({"dht.store": 200}), 7, 10.0),
        3: (Counter({"dht.store": 5_000}), 7, 10.0),  # not there at the window's start: not counted
    }
    out = control_per_step(before, after)
    assert out["global_steps"] == 4  # the furthest peer went from step 3 to step 7
    # per peer: (600 + 300) / 4, (1600 + 400) / 4, 200 / 4 -> median 225
    assert out["control_bytes_sent_per_peer_per_step"] == 225
    assert data not in out["control_by_method_per_peer_per_step"]
    assert out["control_by_method_per_peer_per_step"] == {
        "dht.store": round(2_400 / 3 / 4),
        "avg.join": round(700 / 3 / 4),
    }


def test_the_comparison_says_whether_the_simulator_is_within_a_fifth_of_the_real_swarm() -> None:
    real = {
        "control_bytes_sent_per_peer_per_step": 1000,
        "control_bytes_sent_per_peer_per_s": 100,
        "control_by_method_per_peer_per_step": {"dht.store": 800, "avg.join": 200},
    }
    close = {
        "control_bytes_sent_per_peer_per_step": 1150,
        "control_bytes_sent_per_peer_per_s": 120,
        "control_by_method_per_peer_per_step": {"dht.store": 900, "dht.find_node": 250},
    }
    far = dict(close, control_bytes_sent_per_peer_per_step=1300)
    out = compare(real, close)
    assert out["within_target"] and out["sim_over_real_per_step"] == 1.15
    assert [r["method"] for r in out["by_method"]] == ["dht.store", "avg.join", "dht.find_node"]
    assert out["by_method"][2] == {"method": "dht.find_node", "real": 0, "sim": 250}
    assert not compare(real, far)["within_target"]
