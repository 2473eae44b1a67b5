"""The synchronous facade: two nodes in background threads average from plain (non-async) code."""

from __future__ import annotations

import threading

import pytest
import torch

from p2ptrain import AveragerConfig, BackgroundNode, GroupTooSmall, Identity, NodeConfig, RoundResult

pytestmark = pytest.mark.timeout(120)


def config(join: tuple = ()) -> NodeConfig:
    avg = AveragerConfig(target_size=2, min_size=2, matchmaking_time=1.0)
    return NodeConfig(run_id="sync", listen=(("127.0.0.1", 0),), join=join, averaging=avg)


def test_two_background_nodes_average_from_plain_threads() -> None:
    with BackgroundNode(Identity.generate(), config()) as a:  # noqa: SIM117 (b joins a's address)
        with BackgroundNode(Identity.generate(), config(join=(a.addresses[0],))) as b:
            inputs = {a: [torch.full((1000,), 1.0)], b: [torch.full((1000,), 4.0)]}
            weights = {a: 1.0, b: 2.0}
            results: dict[BackgroundNode, RoundResult | BaseException] = {}

            def one(node: BackgroundNode) -> None:
                for _ in range(30):  # the DHT may not list the other peer yet: try the next round
                    try:
                        results[node] = node.average(inputs[node], weight=weights[node], timeout=20)
                        return
                    except GroupTooSmall as e:
                        results[node] = e

            threads = [threading.Thread(target=one, args=(n,)) for n in (a, b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(100)
            assert not any(t.is_alive() for t in threads)
    for node in (a, b):
        res = results[node]
        assert isinstance(res, RoundResult), res
        assert res.total_weight == 3.0 and len(res.contributors) == 2
        assert torch.equal(inputs[node][0], torch.full((1000,), 3.0))  # (1 * 1 + 2 * 4) / 3, in place
    assert not a._thread.is_alive() and not b._thread.is_alive()


def test_a_node_that_cannot_start_says_why_and_a_stopped_one_refuses_to_average() -> None:
    first = BackgroundNode(Identity.generate(), config()).start()
    try:
        port = int(str(first.addresses[0]).split("/tcp/")[1].split("/")[0])
        taken = NodeConfig(run_id="sync", listen=(("127.0.0.1", port),))
        with pytest.raises(OSError):
            BackgroundNode(Identity.generate(), taken).start()
    finally:
        first.close()
    with pytest.raises(RuntimeError, match="not running"):
        first.average([torch.zeros(3)])
