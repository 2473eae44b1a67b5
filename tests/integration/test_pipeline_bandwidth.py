"""A stage peer measures its link: the rate its stage server receives request bodies at, announced in its
directory record (Nodes over the in-memory network on the virtual clock, one link narrowed)."""

from __future__ import annotations

import trio

from p2ptrain.averaging.compression import Compression
from p2ptrain.net import LinkProfile
from p2ptrain.pipeline.settings import PipelineSection
from tests.integration.test_pipeline import one_thread, pipeline_swarm, run_steps

__all__ = ["one_thread"]  # (the fixture: tiny matrices on one thread)

RATE = 200_000.0  # bytes per second into the narrowed peer


async def test_a_stage_peer_measures_and_announces_its_links_bandwidth(autojump_clock):
    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.NONE)
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        for i in (0, 2, 3):  # every path into p1 (stage 1) carries RATE bytes per second
            swarm.net.set_link(f"p{i}", "p1", LinkProfile(latency=0.01, bandwidth=RATE), both_ways=False)
        with trio.fail_after(600):
            reports = await run_steps(swarm, 2, 2, 4)
            assert all(r.given_up == 0 for step in reports for r in step)
            for p in swarm.peers:
                await p.refresh()
        narrow, wide = swarm.peers[1], swarm.peers[3]
        assert 0.3 * RATE < narrow.bandwidth() <= 1.05 * RATE, narrow.bandwidth()
        assert wide.bandwidth() == 0 or wide.bandwidth() > 5 * narrow.bandwidth()
        seen = {p.peer: p.record.bandwidth for p in swarm.peers[0].directory}
        assert seen[narrow.node.peer_id] > 0
        cands = {c.peer: c.bandwidth for c in swarm.peers[0].candidates(1)}
        assert cands[narrow.node.peer_id] == seen[narrow.node.peer_id]
