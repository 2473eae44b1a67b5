"""The simulation's report names every step on which two nodes held different parameters (pure)."""

from __future__ import annotations

from p2ptrain import simulate
from p2ptrain.simulate import _diverged_steps


def line(step: int, digest: str, **digests: str) -> dict[str, object]:
    return {"step": step, "digest": digest, "digests": {k.lstrip("s"): v for k, v in digests.items()}}


def test_a_fork_shows_on_the_steps_it_held_even_when_the_last_step_agrees() -> None:
    """The 8-peer bytes-per-token run: 3 nodes committed step 1 a second time and trained on; the
    report compared the last step only, where they were not, and said "identical"."""
    five = [line(1, "a1"), line(2, "a2", s1="a1"), line(3, "a3", s1="a1", s2="a2")]
    three = [line(1, "b1"), line(2, "b2", s1="b1")]
    assert _diverged_steps([five, three]) == [1, 2]
    assert _diverged_steps([five, five[:2]]) == []
    # a digest not known yet (a large state being hashed) and cut lines are no disagreement
    assert _diverged_steps([five, [line(3, ""), {"event": "stopped"}, line(2, "a2", s1="")]]) == []


def test_digests_named_by_later_lines_count_too() -> None:
    """A node's line names the digests of its last steps; one that downloaded a state names the
    donors' from then on, and its own lines before still show the step it held apart."""
    repaired = [line(1, "b1"), line(2, "a2", s1="a1")]
    assert _diverged_steps([[line(1, "a1"), line(2, "a2")], repaired]) == [1]


def test_each_simulated_node_has_its_own_loopback_address_where_the_machine_allows_it() -> None:
    hosts = [simulate.node_host(i) for i in range(64)]
    if simulate._own_addresses():  # (Linux: all of 127.0.0.0/8 is the loopback interface's)
        assert len(set(hosts)) == 64 and all(h.startswith("127.0.0.") and h != "127.0.0.1" for h in hosts)
    else:
        assert set(hosts) == {"127.0.0.1"}
