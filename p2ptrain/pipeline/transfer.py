"""A stage's state handed to a peer that moves into the stage: weights, optimizer state and step,
downloaded from the stage's peers and verified per chunk.

Theory of operation: the state of a stage at the start of step ``k`` (after step ``k - 1``'s optimizer
step) is a :class:`Snapshot`: the stage's parameters, then AdamW's first and second moments per
parameter, as raw float32 in the stage's parameter order (a layout the receiver knows exactly from the
stage it builds itself: nothing in it is parsed), AdamW's step count, and a blake2b digest of every
1 MiB chunk. A stage peer takes one at a step boundary only while somebody asks for it (a copy of the
stage's state costs memory) and keeps the last two.

``pipeline_state`` (unary) answers either the *manifest* of a snapshot at or after a step (``chunk``
-1: its step, AdamW's step count, its size and chunk digests; it waits for the next step boundary if
it has none that recent) or one chunk of the snapshot of an exact step.

``catchup.download_state`` asks two peers of the stage for the manifest when the stage has two (one
lying peer cannot then make up the state: the manifests must agree, a third peer settles a disagreement),
fetches the chunks from the peers whose manifests agree, checks each against its digest (a chunk that
fails is fetched from another of them and its sender is dropped), and checks the whole: the exact size,
finite weights, non-negative second moments. A snapshot that went stale meanwhile (the peers moved to a
later step and dropped it) restarts the download at the newer step.

``catchup.behind`` says, from the directory's records (each peer's step and the digest of its stage's
weights at that step), whether this peer left its stage's lineage: a stage-mate is on a later step, or
the mates on this step hold other weights, most of them the same (ties: the lower digest wins, so two
forks settle on one). Such a peer downloads the state again. Records are claims: a liar can make a peer
download (a cost), never take a state it could not verify.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import P2PError
from ..net.rpc import Method
from ..wire.schema import Message, bounded

log = logging.getLogger(__name__)

CHUNK = 1 << 20
MAX_CHUNKS = 2048  # 2 GiB of stage state (about 170M parameters with AdamW's two moments)
DIGEST_BYTES = 16
NO_STATE = "pipeline_no_state"  # no snapshot of that step here (not taken, or dropped since)


class StateUnavailable(P2PError):
    """The stage's state could not be downloaded (no peer to ask, a stale snapshot, disagreement)."""


@dataclass(frozen=True)
class StateReq(Message):
    stage: int = bounded(ge=0, le=63)
    step: int = bounded(ge=0, le=2**62)  # the manifest: at or after this step; a chunk: exactly it
    chunk: int = bounded(-1, ge=-1, le=MAX_CHUNKS)  # -1: the manifest


@dataclass(frozen=True)
class StateResp(Message):
    step: int = bounded(ge=0, le=2**62)
    adam_steps: int = bounded(ge=0, le=2**62)
    size: int = bounded(ge=0, le=MAX_CHUNKS * CHUNK)
    digests: tuple[bytes, ...] = bounded((), max_len=MAX_CHUNKS)


STATE = Method("pipeline_state", StateReq, StateResp)


@dataclass(frozen=True)
class Snapshot:
    step: int  # the state at the start of this step
    adam_steps: int
    body: bytes
    digests: tuple[bytes, ...]

    def manifest(self) -> StateResp:
        return StateResp(self.step, self.adam_steps, len(self.body), self.digests)

    def chunk(self, i: int) -> bytes:
        return self.body[i * CHUNK : (i + 1) * CHUNK]


def chunk_digests(body: bytes) -> tuple[bytes, ...]:
    return tuple(
        hashlib.blake2b(body[i : i + CHUNK], digest_size=DIGEST_BYTES).digest()
        for i in range(0, len(body), CHUNK)
    )


def state_size(params: Sequence[torch.Tensor]) -> int:
    return 3 * 4 * sum(p.numel() for p in params)


def take_snapshot(step: int, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> Snapshot:
    """The stage's state now, as the start of ``step`` (see the module docstring)."""
    parts = [p.detach().to(torch.float32).reshape(-1) for p in params]
    adam_steps = 0
    for key in ("exp_avg", "exp_avg_sq"):
        for p in params:
            st = optimizer.state.get(p, {})
            if key in st:
                parts.append(st[key].detach().to(torch.float32).reshape(-1))
                adam_steps = int(float(st["step"]))
            else:
                parts.append(torch.zeros(p.numel(), dtype=torch.float32))
    body = torch.cat(parts).numpy().astype("<f4", copy=False).tobytes()
    if len(body) > MAX_CHUNKS * CHUNK:
        raise ValueError(f"a stage's state of {len(body)} bytes is beyond what pipeline_state carries")
    return Snapshot(step, adam_steps, body, chunk_digests(body))


def apply_snapshot(
    snapshot: Snapshot, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Load ``snapshot`` into ``params`` and ``optimizer`` (checked first: nothing is applied when a check
    fails, StateUnavailable says why)."""
    if len(snapshot.body) != state_size(params):
        raise StateUnavailable(f"a state of {len(snapshot.body)} bytes, expected {state_size(params)}")
    import numpy as np

    flat = torch.from_numpy(np.frombuffer(snapshot.body, dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(flat).all()):
        raise StateUnavailable("the state holds values that are not finite")
    n = sum(p.numel() for p in params)
    weights, m1, m2 = flat[:n], flat[n : 2 * n], flat[2 * n :]
    if snapshot.adam_steps and float(m2.min()) < 0:
        raise StateUnavailable("the state holds negative second moments")
    at = 0
    with torch.no_grad():
        for p in params:
            k = p.numel()
            p.copy_(weights[at : at + k].view_as(p))
            if snapshot.adam_steps:
                optimizer.state[p] = {
                    "step": torch.tensor(float(snapshot.adam_steps)),
                    "exp_avg": m1[at : at + k].view_as(p).clone(),
                    "exp_avg_sq": m2[at : at + k].view_as(p).clone(),
                }
            else:
                optimizer.state.pop(p, None)
            at += k


CHECKPOINT_MAGIC = b"p2ptrain-stage-1\n"


def save_checkpoint(path: Path, stage: int, snapshot: Snapshot) -> None:
    """This peer's stage state on its own disk (a header line, then the snapshot's body): what it
    restores a stage from when it restarts and the stage has no peer left to download from."""
    header = json.dumps({"stage": stage, "step": snapshot.step, "adam_steps": snapshot.adam_steps})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(CHECKPOINT_MAGIC + header.encode() + b"\n" + snapshot.body)
    tmp.replace(path)


def load_checkpoint(path: Path) -> tuple[int, Snapshot] | None:
    """(stage, snapshot) of :func:`save_checkpoint`'s file, or None when there is none or it is not one
    (it is checked again, against the stage's size and values, when applied)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data.startswith(CHECKPOINT_MAGIC):
        return None
    head, _, body = data[len(CHECKPOINT_MAGIC) :].partition(b"\n")
    try:
        meta = json.loads(head)
        stage, step, adam = int(meta["stage"]), int(meta["step"]), int(meta["adam_steps"])
    except (ValueError, KeyError, TypeError):
        return None
    return stage, Snapshot(step, adam, body, chunk_digests(body))
