"""What a training peer sends between rounds: progress records go out when something changed that the
others cannot extrapolate (and on a heartbeat), reads slow down while the target is far off, and a read
carries only the records that changed since the last one. The swarm still steps together."""

from __future__ import annotations

import pytest
import trio
from test_training import TARGET, check_identical_per_epoch, run_config, swarm

pytestmark = pytest.mark.timeout(300)
WINDOW = 30.0  # virtual seconds of steady training measured


async def test_between_rounds_a_peer_sends_little_and_the_swarm_still_steps_together(
    autojump_clock: object,
) -> None:
    # Outer rounds of about a minute (4 peers at 16 samples/s each): the background is all there is
    # between them. The run's defaults: a read per second, records valid for 10 s.
    config = (
        run_config("diloco")
        .replace("progress", interval=1.0, ttl=10.0)
        .replace("training", target_batch_size=80 * TARGET)
    )
    async with swarm(config) as s:
        peers = [await s.start(compute=0.5) for _ in range(4)]
        await s.until(lambda: all(p.opt.epoch >= 1 for p in peers), timeout=600)
        epoch = max(p.opt.epoch for p in peers)
        stores = {id(p): 0 for p in peers}
        for p in peers:
            store = p.node.dht.store

            async def counted(*args, _p=p, _store=store, **kwargs):  # type: ignore[no-untyped-def]
                stores[id(_p)] += kwargs.get("subkey") is not None and args[0] == _p.opt.key
                return await _store(*args, **kwargs)

            p.node.dht.store = counted  # type: ignore[method-assign]
        await trio.sleep(1.0)
        before = [p.node.host.traffic()[0] for p in peers]
        await trio.sleep(WINDOW)
        sent = [p.node.host.traffic()[0] - b for p, b in zip(peers, before, strict=True)]
        assert max(p.opt.epoch for p in peers) == epoch, "a round fell into the window: make rounds longer"
        per_second = [b / (WINDOW + 1.0) for b in sent]
        # Every record from three replicas and one's own stored, every second, came to about 12 KB/s.
        assert max(per_second) < 4000, per_second
        # A steady peer's record goes out on its heartbeat (ttl / 3), not every second.
        assert max(stores.values()) <= (WINDOW + 1.0) / (10.0 / 3) + 2, stores
        await s.until(lambda: all(p.opt.epoch >= epoch + 2 for p in peers), timeout=600)
        check_identical_per_epoch(peers)
