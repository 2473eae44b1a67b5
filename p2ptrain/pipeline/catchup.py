"""A stage peer catching up with its stage: :func:`download_state` fetches the stage's state from its
peers, verified per chunk, and :func:`behind` says whether this peer left its stage's lineage (the
formats and the rules are in :mod:`p2ptrain.pipeline.transfer`'s docstring). Apart from ``transfer``,
which the peer itself serves from: the download needs the peer, the peer does not need the download.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import trio

from ..errors import P2PError, RemoteCallError
from .peer import PipelinePeer
from .router import Candidate
from .transfer import CHUNK, DIGEST_BYTES, NO_STATE, STATE, Snapshot, StateReq, StateResp, StateUnavailable

log = logging.getLogger(__name__)


async def _ask(peer: PipelinePeer, cand: Candidate, req: StateReq, timeout: float) -> tuple[StateResp, bytes]:
    conn = await peer.node.host.connect(cand.address, timeout=timeout)
    reply = await conn.call_with_body(STATE, req, timeout=timeout)
    return reply.message, bytes(reply.body)


async def download_state(peer: PipelinePeer, stage: int, size: int) -> Snapshot:
    """Stage ``stage``'s state (``size`` bytes: :func:`state_size` of its parameters) from its peers,
    verified per chunk (see the module docstring)."""
    me = peer.node.peer_id
    timeout = max(peer.pipeline.timeout, 3 * peer.interval) + 2 * peer.pipeline.timeout
    banned = peer.router.stats.bans if peer.router is not None else {}
    cands = [c for c in peer.candidates(stage) if c.peer != me and c.peer not in banned]
    if not cands:
        raise StateUnavailable(f"no peer serves stage {stage}")
    step = max((p.record.step for p in peer.directory if p.record.stage == stage), default=0)
    peer.rng.shuffle(cands)
    manifests: dict[bytes, tuple[Candidate, StateResp]] = {}

    async def manifest(c: Candidate, step: int) -> None:
        try:
            resp, _ = await _ask(peer, c, StateReq(stage, step, -1), timeout)
        except (P2PError, trio.TooSlowError) as e:
            log.info("stage %d's peer %s gave no state manifest: %s", stage, c.peer.short(), e)
            return
        if resp.size != size or len(resp.digests) != -(-resp.size // CHUNK):
            log.warning("stage %d's peer %s offers a state of the wrong size", stage, c.peer.short())
            return
        manifests[c.peer.digest] = (c, resp)

    async with trio.open_nursery() as nursery:
        for c in cands[:2]:
            nursery.start_soon(manifest, c, step)
    latest = max((m.step for _, m in manifests.values()), default=step)
    for c, m in list(manifests.values()):  # a peer a step behind the other: asked for the later one
        if m.step < latest:
            del manifests[c.peer.digest]
            await manifest(c, latest)
    manifests = {k: v for k, v in manifests.items() if v[1].step == latest}
    if len(manifests) == 2 and len({m.digests for _, m in manifests.values()}) == 2:
        if cands[2:]:  # a third settles it
            await manifest(cands[2], latest)
        votes = Counter((m.step, m.digests) for _, m in manifests.values())
        best, n = votes.most_common(1)[0]
        if n < 2:
            raise StateUnavailable(f"stage {stage}'s peers disagree about its state")
    elif manifests:
        best = next((m.step, m.digests) for _, m in manifests.values())
    else:
        raise StateUnavailable(f"no peer of stage {stage} offered its state")
    sources = [c for c, m in manifests.values() if (m.step, m.digests) == best]
    head = next(m for c, m in manifests.values() if (m.step, m.digests) == best)
    chunks: list[bytes] = []
    for i, digest in enumerate(head.digests):
        for c in list(sources):
            try:
                _, body = await _ask(peer, c, StateReq(stage, head.step, i), timeout)
            except RemoteCallError as e:
                if e.code == NO_STATE:
                    raise StateUnavailable(f"step {head.step}'s state is gone (the stage moved on)") from None
                sources.remove(c)
                continue
            except (P2PError, trio.TooSlowError):
                sources.remove(c)
                continue
            if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
                sources.remove(c)
                if peer.router is not None:
                    peer.router.ban(c, f"chunk {i} of stage {stage}'s state failed its digest")
                continue
            chunks.append(body)
            break
        else:
            raise StateUnavailable(f"no peer of stage {stage} sent chunk {i} of its state intact")
    snapshot = Snapshot(head.step, head.adam_steps, b"".join(chunks), head.digests)
    if len(snapshot.body) != head.size:
        raise StateUnavailable(f"the state is {len(snapshot.body)} bytes, its manifest said {head.size}")
    peer.downloads += 1
    log.info(
        "downloaded stage %d's state of step %d (%.1f MB, %d chunks, manifest from %d peer(s))",
        stage,
        head.step,
        head.size / 1e6,
        len(head.digests),
        len(manifests),
    )
    return snapshot


def behind(peer: PipelinePeer) -> bool:
    """Whether ``peer`` left its stage's lineage (see the module docstring)."""
    if peer.server is None:
        return False
    if peer.stale:  # it sat out its stage's last average (its mates did not know it yet)
        return True
    me, stage, step = peer.node.peer_id, peer.server.index, peer.step_number
    mates = [p.record for p in peer.directory if p.peer != me and p.record.stage == stage]
    mates = [r for r in mates if not r.joining]
    if any(r.step > step for r in mates):
        return True
    same = Counter(r.digest for r in mates if r.step == step and r.digest)
    if not same:
        return False
    mine = peer.digest_bytes()
    same[mine] += 1
    top = max(same.values())
    winner = min(d for d, n in same.items() if n == top)
    return winner != mine
