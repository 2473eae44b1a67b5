"""What ``p2ptrain simulate`` shows of a pipeline run: a row per peer with its stage, queue and
throughput, and the report's per-peer and per-stage figures (read from the nodes' status files)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

COLUMNS = (
    "node",
    "peer id",
    "stage",
    "step",
    "loss",
    "samples/s",
    "swarm/s",
    "queue",
    "stage thr.",
    "given up",
    "retries",
    "rounds",
    "sent",
    "received",
)


def is_pipeline(statuses: Sequence[Mapping[str, Any]]) -> bool:
    return any(s.get("pipeline") for s in statuses)


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(n: Any) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def _rounds(r: Mapping[str, Any]) -> str:
    if not r:
        return "-"
    return f"{r.get('averaged', 0)} ok, {r.get('aborted', 0)} aborted, {r.get('synced', 0)} synced"


def pipeline_table(statuses: Sequence[Mapping[str, Any]], title: str) -> Table:
    """One row per node of a local pipeline swarm; the caption names stages no peer serves."""
    t = Table(title=title)
    for col in COLUMNS:
        t.add_column(col)
    empty: set[int] = set()
    for i, s in enumerate(statuses):
        tr = s.get("training") or {}
        pl = s.get("pipeline") or {}
        r = tr.get("rounds") or {}
        empty.update(pl.get("empty_stages") or ())
        stage = pl.get("stage")
        t.add_row(
            str(i),
            str(s.get("peer_id", "?"))[:10],
            "joining" if stage is None and s else str(stage if stage is not None else "-"),
            str(tr.get("step", "-")),
            _num(tr.get("loss"), ".3f"),
            _num(tr.get("samples_per_s"), ".1f"),
            _num(tr.get("swarm_samples_per_s"), ".1f"),
            str(tr.get("queue", "-")),
            _num(tr.get("throughput"), ".1f"),
            str(pl.get("given_up", "-")),
            str(pl.get("retries", "-")),
            f"{r.get('averaged', 0)} ok, {r.get('aborted', 0)} aborted, {r.get('synced', 0)} synced"
            if r
            else "-",
            _mb(tr.get("bytes_sent")),
            _mb(tr.get("bytes_received")),
        )
    if empty:
        t.caption = f"no peer serves stage {', '.join(map(str, sorted(empty)))}: its micro-batches wait"
    return t


def pipeline_summary(statuses: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report's pipeline figures: each peer's stage, queue and throughput, and per stage whether
    its peers on the last step hold the same weights."""
    peers = []
    digests: dict[int, set[str]] = {}
    steps = [(s.get("training") or {}).get("step", 0) for s in statuses]
    last = max(steps, default=0)
    for s in statuses:
        tr = s.get("training") or {}
        pl = s.get("pipeline") or {}
        peers.append(
            {
                "stage": pl.get("stage"),
                "queue": tr.get("queue"),
                "throughput": round(float(tr.get("throughput") or 0.0), 2),
                "samples_per_s": round(float(tr.get("samples_per_s") or 0.0), 2),
                "micro_batches": pl.get("micro_batches"),
                "given_up": pl.get("given_up"),
                "retries": pl.get("retries"),
                "dropped_peers": pl.get("dropped_peers"),
                "bytes_per_micro_batch": pl.get("bytes_per_micro_batch"),
                "downloads": pl.get("downloads"),
                "resyncs": pl.get("resyncs"),
            }
        )
        if tr.get("step") == last and pl.get("stage") is not None and tr.get("digest"):
            digests.setdefault(int(pl["stage"]), set()).add(str(tr["digest"]))
    stages = int(next((s["pipeline"]["stages"] for s in statuses if s.get("pipeline")), 0))
    return {
        "peers": peers,
        "peers_per_stage": [sum(1 for p in peers if p["stage"] == k) for k in range(stages)],
        "stage_weights_identical": {str(k): len(v) == 1 for k, v in sorted(digests.items())},
    }
