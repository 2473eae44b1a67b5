"""What a person watching a run sees: one node's panel, and the table of a local swarm.

Both render the ``training`` section of a node's status (see ``Trainer.status``), so a node's own
console and ``p2ptrain simulate`` (which reads the nodes' status files) show the same figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table


def _num(value: Any, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _mb(n: Any) -> str:
    return f"{(n or 0) / 1e6:.1f} MB"


def _bandwidth(bps: Any) -> str:
    return f"{bps / 1e6:.1f} MB/s" if bps else "not measured (no round long enough yet)"


def outcome(last: Mapping[str, Any]) -> str:
    """The last round in a few words."""
    what = last.get("outcome")
    if what == "averaged":
        return (
            f"averaged, {last.get('contributors')}/{last.get('group')} peers, {last.get('seconds', 0):.2f} s"
        )
    if what == "alone":
        return "alone"
    if what == "synced":
        return f"synced from {last.get('from')}"
    if what in ("aborted", "no group"):
        return str(what)
    return "-"


def rounds(r: Mapping[str, Any]) -> str:
    return f"{r.get('averaged', 0)} ok, {r.get('aborted', 0)} aborted, {r.get('synced', 0)} synced"


def node_table(peer: str, training: Mapping[str, Any], title: str = "") -> Table:
    """One node, as a two-column table."""
    t = Table(title=title or f"p2ptrain node {peer}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    r = training.get("rounds", {})
    rows = [
        ("task", f"{training.get('task')} ({training.get('mode')} mode)"),
        ("global step", str(training.get("step", 0))),
        (
            "loss / validation",
            f"{_num(training.get('loss'), '.4f')} / {_num(training.get('val_loss'), '.4f')}",
        ),
        (
            "samples/s here / swarm",
            f"{training.get('samples_per_s', 0):.1f} / {training.get('swarm_samples_per_s', 0):.1f}",
        ),
        (
            "peers on this step",
            f"{training.get('swarm_peers', 1)} ({training.get('epoch_samples', 0):.0f} of "
            f"{training.get('target', 0)} samples)",
        ),
        ("rounds", rounds(r)),
        ("last round", outcome(r.get("last", {}))),
        ("sent / received", f"{_mb(training.get('bytes_sent'))} / {_mb(training.get('bytes_received'))}"),
        ("bandwidth announced", _bandwidth(training.get("bandwidth"))),
        ("compute utilization", f"{100 * training.get('compute_utilization', 0):.0f}%"),
    ]
    banned = training.get("banned") or {}
    if banned:
        rows.append(("banned peers", "; ".join(f"{p}: {why[:60]}" for p, why in banned.items())))
    for k, v in rows:
        t.add_row(k, v)
    return t


SWARM_COLUMNS = (
    "node",
    "peer id",
    "step",
    "loss",
    "val loss",
    "samples/s",
    "swarm/s",
    "peers",
    "rounds",
    "last round",
    "sent",
    "received",
)


def swarm_table(statuses: Sequence[Mapping[str, Any]], title: str) -> Table:
    """One row per node of a local swarm, from each node's status file."""
    t = Table(title=title)
    for col in SWARM_COLUMNS:
        t.add_column(col)
    for i, s in enumerate(statuses):
        tr = s.get("training") or {}
        r = tr.get("rounds", {})
        t.add_row(
            str(i),
            str(s.get("peer_id", "?"))[:10],
            str(tr.get("step", "-")),
            _num(tr.get("loss"), ".3f"),
            _num(tr.get("val_loss"), ".3f"),
            _num(tr.get("samples_per_s"), ".1f"),
            _num(tr.get("swarm_samples_per_s"), ".1f"),
            str(tr.get("swarm_peers", "-")),
            rounds(r) if r else s.get("state", "starting"),
            outcome(r.get("last", {})) if r else "-",
            _mb(tr.get("bytes_sent")),
            _mb(tr.get("bytes_received")),
        )
    return t
