"""The run's pipeline directory in the DHT: who serves which stage, how fast, how busy.

Theory of operation: every stage peer publishes, under :func:`pipeline_key`, an owner-signed subkey
(only it can write its entry: ``dht.records``) holding a :class:`~.protocol.StageRecord`: its stage,
addresses, measured throughput (samples per second through its stage), queue and step. Readers verify
every signature (the DHT does), decode each value against the schema and skip anything malformed.

A record is a peer's *claim* about itself. Callers use it only to choose among a stage's peers (a
liar that claims a high throughput gets more micro-batches, each still checked: see ``router``), and a
joiner uses the totals to choose its stage (:func:`choose_stage`, pure): the stage whose summed
throughput is lowest limits a pipeline, so it needs the newcomer most; a stage nobody serves comes
first. Ties go to the stage with fewer peers, then the lower index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..dht.records import owned_subkey, subkey_owner
from ..dht.service import DHT
from ..errors import RemoteProtocolError
from ..identity import PeerID
from ..tasks.gpt import GPTConfig
from ..wire.codec import pack, unpack
from .protocol import StageRecord
from .settings import PipelineSection


def pipeline_key(run_id: str) -> bytes:
    return f"p2ptrain/{run_id}/pipeline".encode()


@dataclass(frozen=True)
class StagePeer:
    peer: PeerID
    record: StageRecord


async def announce_stage(dht: DHT, run_id: str, record: StageRecord, *, ttl: float) -> int:
    """Publish this peer's entry (replacing its last one); returns the replicas reached."""
    return await dht.store(
        pipeline_key(run_id), pack(record.to_obj()), ttl=ttl, subkey=owned_subkey(dht.peer_id), sign=True
    )


async def read_directory(dht: DHT, run_id: str, num_stages: int, *, quorum: int = 3) -> list[StagePeer]:
    """The stage peers of the run (signatures verified, malformed or foreign-shaped entries skipped),
    those still joining included (``record.joining``: they serve nothing yet)."""
    entries = await dht.get(pipeline_key(run_id), quorum=quorum)
    peers = []
    for subkey, entry in entries.items():
        owner = subkey_owner(subkey)
        if owner is None:
            continue
        try:
            record = StageRecord.from_obj(unpack(entry.value))
        except RemoteProtocolError:
            continue
        if not record.left and record.stages == num_stages and record.stage < num_stages:
            peers.append(StagePeer(owner, record))
    peers.sort(key=lambda p: p.peer)
    return peers


def link_bytes_per_sample(model: GPTConfig, pipeline: PipelineSection) -> list[float]:
    """Per stage: the bytes one sample moves over a stage peer's link, its boundary activations and
    their gradients (in and out) as the pipeline's compression encodes them, and stage 0's tokens."""
    seq, width = model.block_size, model.n_embd
    # the activation and its gradient, per sample of a micro-batch (a low-rank code is per micro-batch)
    b = pipeline.micro_batch
    boundary = 2 * pipeline.wire.size((b, seq, width)) / b
    out = []
    for s in range(pipeline.num_stages):
        n = 4 * seq if s == 0 else boundary  # stage 0: the tokens in; else the input and its gradient
        n += boundary if s < pipeline.num_stages - 1 else 4 * seq  # the output and its gradient; targets
        out.append(float(n))
    return out


def effective(throughput: float, bandwidth: float, link_bytes: float) -> float:
    """A peer's throughput as its stage's callers get it: its compute speed, or the samples per second
    its link carries (``bandwidth`` over ``link_bytes`` per sample) if that is lower. An unknown
    bandwidth or size (0) leaves the speed as measured."""
    if bandwidth > 0 and link_bytes > 0:
        return min(throughput, bandwidth / link_bytes)
    return throughput


def _speed(p: StagePeer, link_bytes: Sequence[float]) -> float:
    r = p.record
    return effective(r.throughput, r.bandwidth, link_bytes[r.stage] if link_bytes else 0.0)


def stage_totals(
    peers: list[StagePeer], num_stages: int, link_bytes: Sequence[float] = ()
) -> list[tuple[float, int]]:
    """Per stage: (summed effective throughput, serving peers). ``link_bytes``: per stage, the bytes
    one sample moves over a peer's link (:func:`link_bytes_per_sample`; empty: links are not counted)."""
    totals = [(0.0, 0)] * num_stages
    for p in peers:
        if p.record.joining:
            continue
        t, n = totals[p.record.stage]
        totals[p.record.stage] = (t + _speed(p, link_bytes), n + 1)
    return totals


def choose_stage(
    peers: list[StagePeer],
    num_stages: int,
    *,
    me: PeerID | None = None,
    link_bytes: Sequence[float] = (),
) -> tuple[int, str]:
    """The stage a joiner should serve, and why (see the module docstring). ``me``: this peer's own
    entry, if the directory holds one, is left out (it asks where it would help most, as a newcomer);
    ``link_bytes``: see :func:`stage_totals`."""
    others = [p for p in peers if p.peer != me]
    totals = stage_totals(others, num_stages, link_bytes)
    empty = [s for s, (_, n) in enumerate(totals) if n == 0]
    if empty:
        return empty[0], f"stage {empty[0]} has no peer"
    best = min(range(num_stages), key=lambda s: (totals[s][0], totals[s][1], s))
    t, n = totals[best]
    return best, f"stage {best} has the lowest throughput ({t:.1f} samples/s over {n} peers)"


def bottleneck(
    peers: list[StagePeer], num_stages: int, link_bytes: Sequence[float] = ()
) -> tuple[int, float]:
    """The stage that limits the pipeline and its throughput (0 when a stage has no peer)."""
    totals = stage_totals(peers, num_stages, link_bytes)
    best = min(range(num_stages), key=lambda s: (totals[s][0], s))
    return best, totals[best][0]


MOVE_GAIN = 1.2  # a move for throughput must raise the swarm's (the slowest stage's) by 20%


def plan_move(
    peers: list[StagePeer], me: PeerID, num_stages: int, link_bytes: Sequence[float] = ()
) -> tuple[int, str] | None:
    """The stage this peer should move to now, and why; None to stay. Pure: every peer that read the
    same directory plans the same moves, and at most one peer moves into a stage at a time.

    - A stage no peer serves is refilled first: the peers of stages with two or more peers, by id, are
      paired with the empty stages in order (never a stage's last peer).
    - Otherwise, once every peer has measured its throughput, the one peer whose move from a stage of
      two or more raises the slowest stage's throughput most moves there, if by :data:`MOVE_GAIN` at
      least (a peer's speed on another stage is its speed here scaled by the two stages' median per-peer
      throughputs: stages differ in cost). Ties go to the lower id.

    Throughputs are effective ones (:func:`effective`, with ``link_bytes``): a peer whose link cannot
    carry its stage's activations at its compute speed counts at its link's rate, on its stage and on
    the one it would move to (whose activations may be heavier or lighter).
    """
    serving = sorted((p for p in peers if not p.record.joining), key=lambda p: p.peer)
    if not any(p.peer == me for p in serving):
        return None
    by_stage: list[list[StagePeer]] = [[] for _ in range(num_stages)]
    for p in serving:
        by_stage[p.record.stage].append(p)
    empty = [s for s in range(num_stages) if not by_stage[s]]
    if empty:
        left = [len(ps) for ps in by_stage]
        movers = []
        for p in serving:  # (by id; never the last peer of a stage)
            if left[p.record.stage] >= 2:
                left[p.record.stage] -= 1
                movers.append(p)
        for stage, p in zip(empty, movers, strict=False):
            if p.peer == me:
                return stage, f"stage {stage} has no peer"
        return None
    if any(p.record.throughput <= 0 for p in serving):
        return None  # (not every speed measured yet)
    speed = {p.peer: _speed(p, link_bytes) for p in serving}
    totals = [sum(speed[p.peer] for p in peers_) for peers_ in by_stage]
    medians = [sorted(p.record.throughput for p in ps)[len(ps) // 2] for ps in by_stage]
    low = min(range(num_stages), key=lambda s: (totals[s], s))
    options: list[tuple[float, bytes, PeerID]] = []
    for p in serving:
        a = p.record.stage
        if a == low or len(by_stage[a]) < 2:
            continue
        after = list(totals)
        after[a] -= speed[p.peer]
        there = p.record.throughput * medians[low] / medians[a]  # (its compute speed on stage ``low``)
        after[low] += effective(there, p.record.bandwidth, link_bytes[low] if link_bytes else 0.0)
        options.append((min(after), p.peer.digest, p.peer))
    if not options:
        return None
    gain, _, mover = min(options, key=lambda o: (-o[0], o[1]))
    if gain < MOVE_GAIN * totals[low] or mover != me:
        return None
    return low, (
        f"stage {low} limits the swarm ({totals[low]:.1f} samples/s): the move raises the slowest stage to"
        f" {gain:.1f}"
    )
