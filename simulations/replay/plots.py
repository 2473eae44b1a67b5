"""The plots of a scenario's report folder (matplotlib, headless): loss against wall time with the
events marked, swarm throughput, bytes on the wire, round outcomes, membership, and memory."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulations.replay.report import MARKERS, OUTCOMES, incarnation_rows


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(data: dict[str, Any], out: Path) -> list[str]:
    plt = _pyplot()
    made = []
    for name, fn in (
        ("loss.png", plot_loss),
        ("throughput.png", plot_throughput),
        ("bytes.png", plot_bytes),
        ("rounds.png", plot_rounds),
        ("membership.png", plot_membership),
        ("rss.png", plot_rss),
    ):
        fig = fn(plt, data)
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        made.append(name)
    return made


def _mark_events(ax: Any, timeline: Sequence[dict[str, Any]]) -> None:
    seen = set()
    for ev in timeline:
        if "skipped" in ev:
            continue
        color, label = MARKERS.get(ev["action"], ("black", ev["action"]))
        ax.axvline(
            ev["t"],
            color=color,
            alpha=0.35,
            linewidth=0.8,
            linestyle="--",
            label=None if label in seen else label,
        )
        seen.add(label)


def _segments(rows: Sequence[dict[str, Any]], key: str) -> list[tuple[list[float], list[float]]]:
    """Runs of consecutive samples of one process (a gap where the peer was down)."""
    segs: list[tuple[list[float], list[float]]] = []
    pid = None
    for r in rows:
        v = r.get(key)
        if v is None:
            pid = None
            continue
        if r.get("pid") != pid or not segs:
            segs.append(([], []))
            pid = r.get("pid")
        segs[-1][0].append(r["t"])
        segs[-1][1].append(v)
    return segs


def _colors(n: int) -> list[Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def plot_loss(plt: Any, data: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    colors = _colors(len(data["peers"]))
    for p, color in zip(data["peers"], colors, strict=True):
        pts: dict[int, list[tuple[float, float]]] = defaultdict(list)
        pid_of = {i["number"]: i for i in p["incarnations"]}
        for m in p["metrics"]:
            if m.get("loss") is None or m.get("event"):
                continue
            n = next(
                (
                    k
                    for k, i in pid_of.items()
                    if i["wall_started"] <= m["time"] <= (i["wall_ended"] or math.inf)
                ),
                0,
            )
            pts[n].append((m["t"], m["loss"]))
        for k, (_, seg) in enumerate(sorted(pts.items())):
            ax.plot(
                *zip(*seg, strict=True),
                color=color,
                linewidth=1.1,
                label=f"peer {p['index']}" if k == 0 else None,
            )
        val = [
            (m["t"], m["val_loss"])
            for m in p["metrics"]
            if m.get("val_loss") is not None and not m.get("event")
        ]
        seen, dots = None, []
        for t, v in val:
            if v != seen:
                dots.append((t, v))
                seen = v
        if dots:
            ax.plot(*zip(*dots, strict=True), "o", color=color, markersize=2.5)
    _mark_events(ax, data["timeline"])
    ax.set_xlabel("seconds since the scenario started")
    ax.set_ylabel("loss (lines: training, dots: validation)")
    ax.set_title(f"{data['scenario'].name}: loss of every peer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def _by_tick(peers: Sequence[dict[str, Any]]) -> list[tuple[float, list[tuple[int, dict[str, Any]]]]]:
    ticks: dict[float, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for p in peers:
        for r in p["series"]:
            ticks[r["t"]].append((p["index"], r))
    return sorted(ticks.items())


def plot_throughput(plt: Any, data: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    prev: dict[int, tuple[float, int, Any]] = {}
    measured: list[tuple[float, float]] = []
    estimate: list[tuple[float, float]] = []
    for t, rows in _by_tick(data["peers"]):
        total, any_rate = 0.0, False
        ests = []
        for i, r in rows:
            if r.get("samples_here") is None:
                continue
            if i in prev and prev[i][2] == r.get("pid") and t > prev[i][0]:
                total += max(0, r["samples_here"] - prev[i][1]) / (t - prev[i][0])
                any_rate = True
            prev[i] = (t, r["samples_here"], r.get("pid"))
            if r.get("swarm_samples_per_s"):
                ests.append(r["swarm_samples_per_s"])
        if any_rate:
            measured.append((t, total))
        if ests:
            estimate.append((t, statistics.median(ests)))
    if measured:
        xs, ys = zip(*measured, strict=True)
        ax.plot(xs, ys, color="0.7", linewidth=0.6, label="sum of peers' samples/s (1 s)")
        ax.plot(xs, _smooth(ys, 10), color="black", linewidth=1.4, label="same, 10 s mean")
    if estimate:
        ax.plot(
            *zip(*estimate, strict=True),
            color="tab:blue",
            linewidth=1.2,
            label="swarm estimate (median of peers)",
        )
    _mark_events(ax, data["timeline"])
    ax.set_xlabel("seconds since the scenario started")
    ax.set_ylabel("samples / s")
    ax.set_title(f"{data['scenario'].name}: swarm throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _smooth(ys: Sequence[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_bytes(plt: Any, data: dict[str, Any]) -> Any:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), dpi=100, sharex=True)
    colors = _colors(len(data["peers"]))
    for p, color in zip(data["peers"], colors, strict=True):
        carried = {"bytes_sent": 0.0, "bytes_received": 0.0}
        for inc in p["incarnations"]:
            rows = [r for r in incarnation_rows(p, inc) if r.get("bytes_sent") is not None]
            if not rows:
                continue
            xs = [r["t"] for r in rows]
            first = inc["number"] == 1
            top.plot(
                xs,
                [(carried["bytes_sent"] + r["bytes_sent"]) / 1e6 for r in rows],
                color=color,
                label=f"peer {p['index']}" if first else None,
            )
            top.plot(
                xs,
                [(carried["bytes_received"] + r["bytes_received"]) / 1e6 for r in rows],
                color=color,
                linestyle=":",
            )
            carried = {k: carried[k] + rows[-1][k] for k in carried}
        link = [(r["t"], r["link_sent"]) for r in p["series"] if r.get("link_sent") is not None]
        rates = [
            (b[0], 8 * (b[1] - a[1]) / (b[0] - a[0]) / 1e6)
            for a, b in itertools.pairwise(link)
            if b[0] > a[0]
        ]
        if rates:
            bottom.plot([x for x, _ in rates], _smooth([y for _, y in rates], 5), color=color, linewidth=0.9)
    top.set_ylabel("MB (solid: sent, dotted: received)")
    top.set_title(
        f"{data['scenario'].name}: bytes each peer sent and received (its own counters, over restarts)"
    )
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    bottom.set_ylabel("upload at the emulator, Mbit/s (5 s mean)")
    bottom.set_xlabel("seconds since the scenario started")
    bottom.grid(alpha=0.3)
    _mark_events(bottom, data["timeline"])
    return fig


def plot_rounds(plt: Any, data: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    width = max(5.0, data["scenario"].duration / 60)
    bins: dict[int, Counter[str]] = defaultdict(Counter)
    for p in data["peers"]:
        prev: dict[str, int] = {}
        pid = None
        for r in p["series"]:
            if r.get("rounds_averaged") is None:
                continue
            if r.get("pid") != pid:
                prev, pid = {}, r.get("pid")
            for k in OUTCOMES:
                v = int(r.get(f"rounds_{k}", 0))
                if v > prev.get(k, 0):
                    bins[int(r["t"] // width)][k] += v - prev.get(k, 0)
                prev[k] = v
    colors = {
        "averaged": "tab:green",
        "alone": "tab:blue",
        "aborted": "tab:red",
        "no_group": "tab:orange",
        "synced": "tab:purple",
    }
    keys = sorted(bins)
    bottom = [0] * len(keys)
    for k in OUTCOMES:
        ys = [bins[b][k] for b in keys]
        ax.bar(
            [b * width + width / 2 for b in keys],
            ys,
            width=width * 0.9,
            bottom=bottom,
            color=colors[k],
            label=k,
        )
        bottom = [a + b for a, b in zip(bottom, ys, strict=True)]
    _mark_events(ax, data["timeline"])
    ax.set_xlabel("seconds since the scenario started")
    ax.set_ylabel(f"round outcomes per {width:g} s, summed over peers")
    ax.set_title(f"{data['scenario'].name}: round outcomes")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=3)
    return fig


def plot_membership(plt: Any, data: dict[str, Any]) -> Any:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), dpi=100, sharex=True)
    xs, alive, newest, members = [], [], [], []
    recent: list[int] = []  # the newest step of the last few samples: status files lag by up to 1 s
    for t, rows in _by_tick(data["peers"]):
        up = [r for _, r in rows if r.get("alive")]
        steps = [r["step"] for r in up if r.get("step") is not None]
        recent = [*recent[-2:], max(steps, default=0)]
        xs.append(t)
        alive.append(len(up))
        newest.append(sum(1 for s in steps if s >= recent[0]))
        seen = [r["members"] for r in up if r.get("members") is not None]
        members.append(statistics.median(seen) if seen else 0)
    top.step(xs, alive, where="post", label="processes alive", color="black")
    top.step(xs, newest, where="post", label="peers on the newest step (of 2 s ago)", color="tab:green")
    top.plot(xs, members, label="run members a peer sees (median)", color="tab:blue", linewidth=0.9)
    top.set_ylabel("peers")
    top.set_title(f"{data['scenario'].name}: membership")
    top.grid(alpha=0.3)
    top.legend(fontsize=7)
    colors = _colors(len(data["peers"]))
    for p, color in zip(data["peers"], colors, strict=True):
        for k, (x, y) in enumerate(_segments(p["series"], "step")):
            bottom.plot(x, y, color=color, linewidth=1.0, label=f"peer {p['index']}" if k == 0 else None)
    _mark_events(bottom, data["timeline"])
    bottom.set_ylabel("global step")
    bottom.set_xlabel("seconds since the scenario started")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=7, ncol=3)
    return fig


def plot_rss(plt: Any, data: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    colors = _colors(len(data["peers"]))
    for p, color in zip(data["peers"], colors, strict=True):
        for k, (x, y) in enumerate(_segments(p["series"], "rss_mb")):
            ax.plot(x, y, color=color, linewidth=1.0, label=f"peer {p['index']}" if k == 0 else None)
    ax.axvline(data["scenario"].checks.warmup_s, color="black", alpha=0.4, linestyle=":", label="warm-up")
    ax.set_xlabel("seconds since the scenario started")
    ax.set_ylabel("RSS, MB")
    ax.set_title(f"{data['scenario'].name}: memory of every process")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    return fig
