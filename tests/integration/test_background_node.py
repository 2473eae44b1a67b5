"""The synchronous facade: two nodes in background threads average from plain (non-async) code."""

from __future__ import annotations

import threading

import pytest
import torch

from p2ptrain import BackgroundNode, GroupTooSmall, NodeConfig
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.identity import Identity

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


def test_plain_training_loops_in_threads_train_one_model_with_the_sync_optimizer() -> None:
    from p2ptrain.config import RunConfig
    from p2ptrain.training.optimizer import SyncCollaborativeOptimizer

    run = (
        RunConfig()
        .replace("training", target_batch_size=32, warmup_steps=0)
        .replace("progress", interval=0.2, ttl=2.0)
        .replace("averaging", matchmaking_time=1.0, timeout=10.0)
    )
    steps = 3

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 1)

    avg = AveragerConfig(target_size=64, min_size=1, matchmaking_time=1.0)
    node_config = NodeConfig(run_id="sync", listen=(("127.0.0.1", 0),), averaging=avg)
    with BackgroundNode(Identity.generate(), node_config) as a:  # noqa: SIM117 (b joins a's address)
        with BackgroundNode(
            Identity.generate(), NodeConfig(**{**node_config.__dict__, "join": (a.addresses[0],)})
        ) as b:
            models = {a: model(), b: model()}
            opts = {
                n: SyncCollaborativeOptimizer(n, m, torch.optim.SGD(m.parameters(), lr=0.1), run)
                for n, m in models.items()
            }
            errors: list[BaseException] = []

            def loop(n: BackgroundNode, seed: int) -> None:
                g = torch.Generator().manual_seed(seed)
                try:
                    while opts[n].epoch < steps:
                        x = torch.randn(8, 4, generator=g)
                        torch.nn.functional.mse_loss(models[n](x), x.sum(1, keepdim=True)).backward()
                        opts[n].step(8)
                except BaseException as e:  # reported to the test below
                    errors.append(e)

            # As a trainer does (--wait-peers): a peer that sees nobody yet would step alone, and two
            # peers that each stepped alone before seeing the other repair the fork a step later.
            for n in (a, b):
                assert n.call(lambda n=n: opts[n].optimizer.wait_for_peers(2, timeout=60)) == 2
            threads = [threading.Thread(target=loop, args=(n, i)) for i, n in enumerate((a, b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(100)
            assert not any(t.is_alive() for t in threads) and not errors, errors
            # Both loops reached the step count together, averaging, and hold the same weights.
            assert opts[a].epoch == opts[b].epoch == steps
            assert opts[a].stats.averaged + opts[b].stats.averaged >= 2
            pairs = zip(models[a].parameters(), models[b].parameters(), strict=True)
            assert all(torch.equal(p, q) for p, q in pairs), [opts[n].stats for n in (a, b)]
