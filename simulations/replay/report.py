"""A scenario's report: what the runner collected, analysed against the scenario's checks, plotted.

The analysis functions are pure (they take the runner's collected data: per peer its processes, events,
per-second series and metrics lines, all times in seconds since the scenario started) and are reused by
the bench suite. The report folder gets:

- ``peer-N.json``: the peer's profile, processes, events, per-second series (status fields, RSS, the
  emulator's byte counters) and every metrics line; ``events.json``: the timeline as carried out;
- ``loss.png`` (training loss per peer, dots: validation loss, with the kills, restarts, starts and
  network events marked), ``throughput.png`` (swarm samples/s), ``bytes.png`` (bytes sent and received
  per peer), ``rounds.png`` (round outcomes over time), ``membership.png`` (peers alive, on the newest
  step, members seen; every peer's step), ``rss.png`` (memory per process);
- ``summary.json`` (every number below and the checks) and ``report.md``.

Hostile peers. A scenario's adversaries (peers with an ``adversary`` profile key) are left out of the
divergence and loss checks, which judge the honest peers. The runner scans every peer's ``node.log`` for
the lines that name another peer by its short id (``ASFBru..ENrJ``, as the node logs print it) and
counts the *accusations* among them (:func:`scan_log`): a line of one of the node's known accusing forms
(``banned X``, ``adopted the swarm's ban of X``, ``slice of partition P from X failed``, ``report from X
ignored``, ``bad manifest from X``, ``closing connection to X: protocol violation``, ``peer X makes more
than N calls``, ``refused N record(s) from X``), a weight cap (``X claimed weight C, more than its
records make plausible: counted as A``) with C at least ``IMPLAUSIBLE_RATIO`` times A (smaller caps hit
honest peers too), or any WARNING or ERROR line naming X with an accusing word (banned, excluded, left
out, outlier, clipped, refused, rejected, invalid, NaN, not finite, implausible, garbage, mismatch,
offender, hostile). A line that merely names X (it connected, it served state) accuses nobody. An
adversary is *named* when at least one honest peer's log accuses it; an honest peer accused by another
is listed under ``false_accusations`` (said in the check, not failed by it). The summary also counts, as
supporting evidence, the honest peers' rounds that excluded it (``rounds.last.excluded`` of the metrics
lines) and the honest peers whose final status lists it as banned. Honest peers *kept training* when none
exited by itself and each reached its last global step within the last ``max(30 s, a quarter of the
duration)``.

Divergence. Every metrics line carries the global step and the digest of the parameters every peer must
hold identically. For every step that two or more peers reached, the digests must agree. A disagreement
is a *repaired fork* when each peer off the majority later downloaded the state (a line whose round
outcome is ``synced``) or died without writing another line: it stepped alone for a while (a joiner
before it synced, a peer cut off) and threw that away. Any other disagreement is a divergence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import statistics
import tomllib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from p2ptrain.identity import PeerID
from simulations.replay.scenario import REPO_ROOT, Scenario, parse_scenario

OUTCOMES = ("averaged", "alone", "aborted", "no_group", "synced")
FAILURES = ("kill", "stop", "cut", "partition")
JOINS = ("start", "restart")
MARKERS = {
    "kill": ("tab:red", "kill"),
    "stop": ("tab:purple", "stop"),
    "restart": ("tab:green", "restart"),
    "start": ("tab:blue", "start"),
    "cut": ("tab:orange", "cut"),
    "partition": ("tab:brown", "partition"),
    "link": ("tab:gray", "link change"),
}


# ---- analysis (pure) -------------------------------------------------------------------------------


def step_lines(peers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every metrics line that says a step and a digest: {peer, t, step, digest, outcome}, by time."""
    out = []
    for p in peers:
        for m in p["metrics"]:
            if m.get("step") is None or not m.get("digest"):
                continue
            last = (m.get("rounds") or {}).get("last") or {}
            out.append(
                {
                    "peer": p["index"],
                    "t": m["t"],
                    "step": int(m["step"]),
                    "digest": m["digest"],
                    "outcome": "stopped" if m.get("event") == "stopped" else last.get("outcome"),
                }
            )
    out.sort(key=lambda x: x["t"])
    return out


def digest_lines(peers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`step_lines`, plus every step's digest the metrics list later (``digests``: a large state
    is hashed after its step's line was written, whose "digest" is then ""), each at the first line
    that says it: what :func:`divergence` compares."""
    out = step_lines(peers)
    for p in peers:
        seen = {(x["step"], x["digest"]) for x in out if x["peer"] == p["index"]}
        for m in p["metrics"]:
            for epoch, digest in (m.get("digests") or {}).items():
                if not str(epoch).isdigit() or not digest or (int(epoch), digest) in seen:
                    continue
                seen.add((int(epoch), digest))
                out.append(
                    {"peer": p["index"], "t": m["t"], "step": int(epoch), "digest": digest, "outcome": None}
                )
    out.sort(key=lambda x: x["t"])
    return out


def divergence(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Do peers on the same step hold the same parameters? (see the module docstring)"""
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        if line["step"] > 0:
            by_step[line["step"]][line["digest"]].append(line)
    compared = [s for s, d in by_step.items() if len({x["peer"] for g in d.values() for x in g}) >= 2]
    repaired, diverged = [], []
    for step in sorted(by_step):
        groups = by_step[step]
        if len(groups) < 2:
            continue
        majority = max(groups, key=lambda d: (len({x["peer"] for x in groups[d]}), -groups[d][0]["t"]))
        for digest, members in groups.items():
            if digest == majority:
                continue
            for line in members:
                later = [x for x in lines if x["peer"] == line["peer"] and x["t"] > line["t"]]
                synced = any(x["outcome"] == "synced" for x in later)
                item = {
                    "step": step,
                    "peer": line["peer"],
                    "t": line["t"],
                    "digest": digest,
                    "majority": majority,
                    "outcome": line["outcome"],
                }
                if synced or not later:
                    item["repaired_by"] = "a later state download" if synced else "its death"
                    repaired.append(item)
                else:
                    diverged.append(item)
    verdict = "diverged" if diverged else ("identical" if not repaired else "repaired forks only")
    return {
        "verdict": verdict,
        "ok": not diverged,
        "steps_compared": len(compared),
        "lines": len(lines),
        "repaired_forks": repaired,
        "divergences": diverged,
    }


def swarm_step_at(lines: Sequence[dict[str, Any]], t: float, exclude: int | None = None) -> int:
    steps = [x["step"] for x in lines if x["t"] <= t and x["peer"] != exclude]
    return max(steps, default=0)


def recoveries(
    lines: Sequence[dict[str, Any]], timeline: Sequence[dict[str, Any]], window: float, end: float
) -> list[dict[str, Any]]:
    """For every failure (kill, stop, cut, partition): how long until the swarm's next global step."""
    out = []
    for ev in timeline:
        if ev["action"] not in FAILURES or "skipped" in ev:
            continue
        t = ev["t"]
        before = swarm_step_at(lines, t)
        nxt = next((x for x in lines if x["t"] > t and x["step"] > before), None)
        delay = round(nxt["t"] - t, 1) if nxt else None
        if delay is not None and delay <= window:
            verdict = "ok"
        elif delay is None and t + window > end:
            verdict = "inconclusive"  # the run ended before the window did
        else:
            verdict = "late" if delay is not None else "none"
        out.append(
            {
                "t": t,
                "action": ev["action"],
                "peer": ev["peer"],
                "step": before,
                "next_step_s": delay,
                "verdict": verdict,
            }
        )
    return out


def catch_ups(
    lines: Sequence[dict[str, Any]], timeline: Sequence[dict[str, Any]], window: float, end: float
) -> list[dict[str, Any]]:
    """For every (re)start: when the peer reached the step the swarm was on, and first averaged with it."""
    out = []
    for ev in timeline:
        if ev["action"] not in JOINS or "skipped" in ev:
            continue
        t, peer = ev["t"], ev["peer"]
        target = swarm_step_at(lines, t, exclude=peer)
        mine = [x for x in lines if x["peer"] == peer and x["t"] > t]
        caught = next((x for x in mine if x["step"] >= max(target, 1)), None)
        averaged = next((x for x in mine if x["outcome"] == "averaged"), None)
        synced = next((x for x in mine if x["outcome"] == "synced"), None)
        delay = round(caught["t"] - t, 1) if caught else None
        if delay is not None and delay <= window:
            verdict = "ok"
        elif delay is None and t + window > end:
            verdict = "inconclusive"
        else:
            verdict = "late" if delay is not None else "never"
        out.append(
            {
                "t": t,
                "action": ev["action"],
                "peer": peer,
                "swarm_step": target,
                "caught_up_s": delay,
                "caught_up_step": caught["step"] if caught else None,
                "first_sync_s": round(synced["t"] - t, 1) if synced else None,
                "first_averaged_s": round(averaged["t"] - t, 1) if averaged else None,
                "verdict": verdict,
            }
        )
    return out


def incarnation_rows(peer: dict[str, Any], inc: dict[str, Any]) -> list[dict[str, Any]]:
    end = inc["ended"] if inc["ended"] is not None else math.inf
    return [r for r in peer["series"] if r.get("pid") == inc["pid"] and inc["started"] <= r["t"] <= end]


def rss_growth(peers: Sequence[dict[str, Any]], warmup: float, end: float) -> list[dict[str, Any]]:
    """Per process: RSS after warm-up and at the end (the last sample before the stop signal)."""
    out = []
    for p in peers:
        for inc in p["incarnations"]:
            rows = [r for r in incarnation_rows(p, inc) if r.get("rss_mb") and r["t"] < end]
            if not rows:
                continue
            base = next((r for r in rows if r["t"] >= inc["started"] + warmup), None)
            last = rows[-1]
            to_end = inc["end"].startswith(("stopped at the end", "killed at the end"))
            judged = bool(base) and to_end and last["t"] - inc["started"] >= 2 * warmup
            out.append(
                {
                    "peer": p["index"],
                    "process": inc["number"],
                    "started": inc["started"],
                    "lived_s": round(last["t"] - inc["started"], 1),
                    "rss_warm_mb": round(base["rss_mb"], 1) if base else None,
                    "rss_end_mb": round(last["rss_mb"], 1),
                    "rss_peak_mb": round(max(r["rss_mb"] for r in rows), 1),
                    "growth": round(last["rss_mb"] / base["rss_mb"] - 1, 4) if base else None,
                    "judged": judged,
                }
            )
    return out


def last_row(peer: dict[str, Any], end: float, key: str) -> dict[str, Any] | None:
    rows = [r for r in peer["series"] if r.get(key) is not None and r["t"] < end]
    return rows[-1] if rows else None


def utilization(peers: Sequence[dict[str, Any]], end: float) -> list[dict[str, Any]]:
    out = []
    for p in peers:
        row = last_row(p, end, "compute_utilization")
        incs = p["incarnations"]
        whole = len(incs) == 1 and incs[0]["end"].startswith(("stopped at the end", "killed at the end"))
        out.append(
            {
                "peer": p["index"],
                "utilization": round(row["compute_utilization"], 4) if row else None,
                "judged": whole and row is not None,
            }
        )
    return out


def loss_curve(lines_by_peer: Sequence[dict[str, Any]], eval_every: int) -> dict[str, Any]:
    """Validation loss per evaluated step (median over peers; equal on peers with equal parameters), else
    the training loss per step; and whether it fell without a jump."""
    val: dict[int, list[float]] = defaultdict(list)
    train: dict[int, list[float]] = defaultdict(list)
    for p in lines_by_peer:
        for m in p["metrics"]:
            step = m.get("step")
            if step is None or m.get("event"):
                continue
            if m.get("val_loss") is not None and eval_every and step % eval_every == 0:
                val[step].append(float(m["val_loss"]))
            if m.get("loss") is not None:
                train[step].append(float(m["loss"]))
    kind, source = ("validation", val) if len(val) >= 2 else ("training", train)
    curve = [(s, statistics.median(v)) for s, v in sorted(source.items())]
    finite = all(math.isfinite(x) for v in source.values() for x in v)
    jumps = [(b[1] - a[1]) / a[1] for a, b in itertools.pairwise(curve) if a[1] > 0]
    return {
        "kind": kind,
        "points": [[s, round(v, 5)] for s, v in curve],
        "first": round(curve[0][1], 4) if curve else None,
        "last": round(curve[-1][1], 4) if curve else None,
        "finite": finite,
        "largest_rise": round(max(jumps, default=0.0), 4),
    }


def validation_points(peers: Sequence[dict[str, Any]], eval_every: int) -> list[list[float]]:
    """[step, median validation loss over ``peers``] for every evaluated step (NaN kept: it is news)."""
    val: dict[int, list[float]] = defaultdict(list)
    for p in peers:
        for m in p["metrics"]:
            step = m.get("step")
            if step is None or m.get("event") or m.get("val_loss") is None:
                continue
            if eval_every and step % eval_every == 0:
                val[int(step)].append(float(m["val_loss"]))
    return [[s, round(statistics.median(v), 5)] for s, v in sorted(val.items())]


# ---- hostile peers ---------------------------------------------------------------------------------

ACCUSING_FORMS = (  # the node's own accusing log lines; {id}: the accused peer's short id
    r"\bbanned {id}",
    r"\bban of {id}",
    r"slice of partition \d+ from {id} failed",
    r"report from {id} ignored",
    r"bad manifest from {id}",
    r"breaks the run's rules from {id}",
    r"connection to {id}: protocol violation",
    r"peer {id} makes more than",
    r"record\(s\) from {id}",
    r"leader {id}( \(subnet [^)]*\))? failed us .*: not followed",  # excluded (averaging.leaders)
)
ACCUSING_WORDS = re.compile(
    r"\b(ban|bans|banned|exclud\w*|left out|outliers?|clipp\w*|refus\w*|reject\w*|invalid|nan|"
    r"not finite|implausible|garbage|mismatch\w*|offend\w*|hostile)\b",
    re.IGNORECASE,
)
LOUD = re.compile(r"\s(WARNING|ERROR|CRITICAL)\s")
WEIGHT_CAP = r"{id} claimed weight ([0-9.eE+-]+), .*counted as ([0-9.eE+-]+)"
# A coordinator caps honest peers too (their progress records lag their samples by a second or so: a
# claim 5-20% over is normal); a capped claim accuses its peer only when it is this many times what was
# counted (an inflating peer claims a hundred times its samples).
IMPLAUSIBLE_RATIO = 2.0
MAX_EXAMPLES = 5
KEEP_WINDOW_S = 30.0  # an honest peer kept training: a global step within the last max(this, ...)
KEEP_WINDOW_FRACTION = 0.25  # ... and this fraction of the duration


def short_id(peer_id: str) -> str:
    """A peer id as the node's log lines print it."""
    try:
        return PeerID.from_string(peer_id).short()
    except ValueError:
        return f"{peer_id[:6]}..{peer_id[-4:]}"


def accuses(line: str, short: str) -> bool:
    """Does this log line accuse the peer ``short`` (see the module docstring)?"""
    if short not in line:
        return False
    cap = re.search(WEIGHT_CAP.format(id=re.escape(short)), line)
    if cap is not None:
        try:
            claimed, counted = float(cap[1]), float(cap[2].rstrip("."))
        except ValueError:
            return False
        return claimed >= IMPLAUSIBLE_RATIO * counted
    if any(re.search(form.format(id=re.escape(short)), line) for form in ACCUSING_FORMS):
        return True
    return bool(LOUD.search(line)) and bool(ACCUSING_WORDS.search(line.replace(short, " ")))


def scan_log(lines: Iterable[str], names: dict[str, int]) -> dict[str, dict[str, Any]]:
    """One peer's log: for every other peer it names (``names``: short id -> peer index), how many lines
    name it, how many accuse it, and the first few accusing lines. Keys: the named peer's index."""
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        for short, index in names.items():
            if short not in line:
                continue
            entry = out.setdefault(
                str(index), {"peer_id": short, "mentions": 0, "accusations": 0, "examples": []}
            )
            entry["mentions"] += 1
            if accuses(line, short):
                entry["accusations"] += 1
                if len(entry["examples"]) < MAX_EXAMPLES:
                    entry["examples"].append(line.strip()[:300])
    return out


def scan_logs(peers: Sequence[dict[str, Any]]) -> None:
    """Scan every peer's ``node.log`` (in its ``folder``) for the other peers' ids: ``peer["log"]``. A peer
    whose log cannot be read keeps the scan it has (a report folder whose node folders are gone)."""
    ids = {p["index"]: short_id(str(p["peer_id"])) for p in peers if p.get("peer_id")}
    for p in peers:
        try:
            lines = (Path(p["folder"]) / "node.log").read_text(errors="replace").splitlines()
        except (OSError, KeyError, TypeError):
            continue
        p["log"] = scan_log(lines, {short: i for i, short in ids.items() if i != p["index"]})


def false_accusations(peers: Sequence[dict[str, Any]], hostile: dict[int, str]) -> list[dict[str, Any]]:
    """Honest peers that another honest peer's log accuses (a rule that fires on honest behaviour)."""
    honest = [p for p in peers if p["index"] not in hostile]
    out = []
    for p in honest:
        by = [(h["index"], e) for h in honest if (e := (h.get("log") or {}).get(str(p["index"])))]
        by = [(i, e) for i, e in by if e["accusations"]]
        if by:
            out.append(
                {
                    "peer": p["index"],
                    "peer_id": by[0][1]["peer_id"],
                    "accused_by": [i for i, _ in by],
                    "accusing_lines": sum(e["accusations"] for _, e in by),
                    "examples": [f"peer {i}: {x}" for i, e in by for x in e["examples"][:1]][:MAX_EXAMPLES],
                }
            )
    return out


def offenders(peers: Sequence[dict[str, Any]], hostile: dict[int, str]) -> list[dict[str, Any]]:
    """For every adversary: which honest peers' logs accuse it, and the supporting evidence."""
    honest = [p for p in peers if p["index"] not in hostile]
    out = []
    for i, kind in sorted(hostile.items()):
        me = next((p for p in peers if p["index"] == i), {})
        short = short_id(str(me["peer_id"])) if me.get("peer_id") else None
        named_by, mentioned_by, examples, excluded, banned_by = [], [], [], 0, []
        for h in honest:
            entry = (h.get("log") or {}).get(str(i))
            if entry:
                mentioned_by.append(h["index"])
                if entry["accusations"]:
                    named_by.append(h["index"])
                    examples += [f"peer {h['index']}: {x}" for x in entry["examples"][:2]]
                short = short or entry["peer_id"]
            if short is None:
                continue
            excluded += sum(
                1
                for m in h["metrics"]
                if short in (((m.get("rounds") or {}).get("last") or {}).get("excluded") or {})
            )
            if short in ((h.get("final_status") or {}).get("training") or {}).get("banned", {}):
                banned_by.append(h["index"])
        out.append(
            {
                "peer": i,
                "adversary": kind,
                "peer_id": short,
                "named": bool(named_by),
                "named_by": named_by,
                "mentioned_by": mentioned_by,
                "accusing_lines": sum(
                    ((h.get("log") or {}).get(str(i)) or {}).get("accusations", 0) for h in honest
                ),
                "excluded_rounds": excluded,
                "banned_by": banned_by,
                "examples": examples[:MAX_EXAMPLES],
                "scanned": any("log" in h for h in honest),  # False: no honest log could be read
            }
        )
    return out


def honest_training(
    peers: Sequence[dict[str, Any]],
    lines: Sequence[dict[str, Any]],
    hostile: dict[int, str],
    end: float,
    eval_every: int,
) -> dict[str, Any]:
    """Did every honest peer keep training to the end? And their validation loss per evaluated step."""
    honest = [p for p in peers if p["index"] not in hostile]
    window = max(KEEP_WINDOW_S, KEEP_WINDOW_FRACTION * end)
    rows = []
    for p in honest:
        mine = [x for x in lines if x["peer"] == p["index"] and x["outcome"] != "stopped"]
        final = max((x["step"] for x in mine), default=0)
        reached = min((x["t"] for x in mine if x["step"] == final), default=None)
        crashed = any(str(i.get("end", "")).startswith("exited") for i in p["incarnations"])
        kept = not crashed and final >= 1 and reached is not None and reached >= end - window
        row = {"peer": p["index"], "final_step": final, "reached_at_s": reached, "crashed": crashed}
        rows.append(row | {"kept": kept})
    return {
        "peers": [p["index"] for p in honest],
        "adversaries": {str(i): k for i, k in sorted(hostile.items())},
        "window_s": window,
        "per_peer": rows,
        "kept_training": bool(rows) and all(r["kept"] for r in rows),
        "final_step": min((r["final_step"] for r in rows), default=0),
        "val_points": validation_points(honest, eval_every),
    }


def samples_total(peers: Sequence[dict[str, Any]]) -> int:
    """Samples computed by every process of every peer (each process counts from zero)."""
    total = 0
    for p in peers:
        for inc in p["incarnations"]:
            rows = [r for r in incarnation_rows(p, inc) if r.get("samples_here") is not None]
            if rows:
                total += int(rows[-1]["samples_here"])
    return total


def counters(peer: dict[str, Any], inc: dict[str, Any]) -> dict[str, int]:
    rows = [r for r in incarnation_rows(peer, inc) if r.get("rounds_averaged") is not None]
    last = rows[-1] if rows else {}
    return {k: int(last.get(f"rounds_{k}", 0)) for k in OUTCOMES}


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Every number of the summary, and the checks."""
    sc: Scenario = data["scenario"]
    peers = data["peers"]
    end = sc.duration
    lines = step_lines(peers)
    run_cfg = data.get("run_config") or {}
    eval_every = int((run_cfg.get("eval") or {}).get("every_steps", 10))
    mode = (run_cfg.get("training") or {}).get("mode", "sync")
    hostile = sc.adversaries
    honest = [p for p in peers if p["index"] not in hostile]
    div = divergence(digest_lines(honest if hostile else peers))  # adversaries may hold other parameters
    rec = recoveries(lines, data["timeline"], sc.checks.recovery_s, end)
    cat = catch_ups(lines, data["timeline"], sc.checks.catch_up_s, end)
    rss = rss_growth(peers, sc.checks.warmup_s, end)
    util = utilization(peers, end)
    loss = loss_curve(honest, eval_every)
    last_step = max((x["step"] for x in lines), default=0)
    first_t = min((x["t"] for x in lines if x["step"] >= 1), default=None)
    last_t = max((x["t"] for x in lines if x["outcome"] != "stopped"), default=None)
    total = samples_total(peers)
    per_peer = []
    for p in peers:
        sent = received = 0
        rounds: Counter[str] = Counter()
        for inc in p["incarnations"]:
            rounds.update(counters(p, inc))
            rows = [r for r in incarnation_rows(p, inc) if r.get("bytes_sent") is not None]
            if rows:
                sent += rows[-1]["bytes_sent"]
                received += rows[-1]["bytes_received"]
        steps = [x["step"] for x in lines if x["peer"] == p["index"]]
        u = next(x for x in util if x["peer"] == p["index"])
        samples = sum(
            int(rows[-1]["samples_here"])
            for inc in p["incarnations"]
            if (rows := [r for r in incarnation_rows(p, inc) if r.get("samples_here") is not None])
        )
        per_peer.append(
            {
                "peer": p["index"],
                "name": p["name"],
                "adversary": p["spec"].get("adversary"),
                "slowdown": p["spec"]["slowdown"],
                "up_mbit": p["spec"]["up_mbit"],
                "down_mbit": p["spec"]["down_mbit"],
                "latency_ms": p["spec"]["latency_ms"],
                "processes": len(p["incarnations"]),
                "ends": [i["end"] for i in p["incarnations"]],
                "final_step": max(steps, default=0),
                "samples": samples,
                "share": round(samples / total, 4) if total else None,
                "utilization": u["utilization"],
                "rounds": dict(rounds),
                "mb_sent": round(sent / 1e6, 2),
                "mb_received": round(received / 1e6, 2),
            }
        )
    summary: dict[str, Any] = {
        "scenario": sc.name,
        "description": sc.description,
        "source": _shown(sc.source),
        "mode": mode,
        "emulation": data["emulation"],
        "not_emulated": sc.not_emulated(),
        "duration_s": sc.duration,
        "written_duration_s": sc.written_duration if sc.written_duration != sc.duration else None,
        "load": data.get("load"),
        "seconds": data["seconds"],
        "interrupted": data["interrupted"],
        "peers": len(peers),
        "events": len(data["timeline"]),
        "dropped_events": [e.describe() for e in sc.dropped_events],
        "last_step": last_step,
        "first_step_at_s": first_t,
        "steps_per_min": round(60 * (last_step - 1) / (last_t - first_t), 2)
        if first_t is not None and last_t and last_t > first_t and last_step > 1
        else None,
        "samples": total,
        "samples_per_s": round(total / data["seconds"], 1) if data["seconds"] else None,
        "loss": loss,
        "divergence": div,
        "recoveries": rec,
        "catch_ups": cat,
        "rss": rss,
        "utilization": util,
        "per_peer": per_peer,
        "honest": honest_training(peers, lines, hostile, end, eval_every),
        "offenders": offenders(peers, hostile),
        "false_accusations": false_accusations(peers, hostile),
        "problems": list(data["problems"]),
    }
    summary["checks"] = evaluate_checks(sc, summary, mode)
    summary["passed"] = all(c["passed"] is not False for c in summary["checks"]) and not data["interrupted"]
    return summary


def evaluate_checks(sc: Scenario, s: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """One row per check: name, passed (True / False / None: reported only), what was measured."""
    c = sc.checks
    out: list[dict[str, Any]] = []

    def add(name: str, passed: bool | None, measured: str, target: str) -> None:
        out.append({"check": name, "passed": passed, "measured": measured, "target": target})

    who = " (honest peers)" if sc.adversaries else ""
    if c.identical:
        d = s["divergence"]
        add(
            "identical parameters" + who,
            d["ok"] and d["steps_compared"] > 0,
            f"{d['verdict']}: {d['steps_compared']} steps compared, {len(d['repaired_forks'])} repaired "
            f"fork line(s), {len(d['divergences'])} divergent line(s)",
            "equal digests on every step reached by 2+ peers",
        )
    if c.continues:
        rec = s["recoveries"]
        bad = [r for r in rec if r["verdict"] in ("late", "none")]
        delays = [r["next_step_s"] for r in rec if r["next_step_s"] is not None]
        add(
            "training goes on after every failure",
            not bad and bool(rec),
            f"{len(rec)} failures, {len(bad)} without a step within {c.recovery_s:g} s; next step after "
            f"median {_med(delays)} s, worst {max(delays, default='-')} s",
            f"a global step within {c.recovery_s:g} s of each",
        )
    if c.rejoin:
        cat = s["catch_ups"]
        bad = [x for x in cat if x["verdict"] in ("late", "never")]
        delays = [x["caught_up_s"] for x in cat if x["caught_up_s"] is not None]
        add(
            "(re)started peers catch up",
            not bad and bool(cat),
            f"{len(cat)} (re)starts, {len(bad)} late or never; caught up after median {_med(delays)} s, "
            f"worst {max(delays, default='-')} s",
            f"the swarm's step within {c.catch_up_s:g} s",
        )
    if c.utilization_min is not None:
        judged = [u for u in s["utilization"] if u["judged"]]
        worst = min((u["utilization"] for u in judged), default=None)
        applies = mode in c.utilization_modes
        add(
            "compute utilization" + ("" if applies else f" (reported: {mode} mode)"),
            (worst is not None and worst >= c.utilization_min) if applies else None,
            f"min {_pct(worst)}, mean {_pct(_mean(u['utilization'] for u in judged))} "
            f"over {len(judged)} peers",
            f">= {_pct(c.utilization_min)}"
            + ("" if applies else f" in {'/'.join(c.utilization_modes)} mode"),
        )
    if c.rss_growth_max is not None:
        judged = [r for r in s["rss"] if r["judged"]]
        worst = max((r["growth"] for r in judged), default=None)
        add(
            "memory bounded" + ("" if judged else " (not judged: no process ran long enough)"),
            worst <= c.rss_growth_max if worst is not None else None,
            f"largest RSS growth {_pct(worst)} over {len(judged)} processes that ran {2 * c.warmup_s:g}+ s "
            "to the end",
            f"<= {_pct(c.rss_growth_max)} from {c.warmup_s:g} s after start to the end",
        )
    if (steps := sc.min_steps()) is not None:
        scaled = f" (scaled to {sc.duration:g} of {sc.written_duration:g} s)" if steps != c.min_steps else ""
        add("global steps", s["last_step"] >= steps, f"step {s['last_step']}", f">= {steps}{scaled}")
    if c.loss_decreases:
        lo = s["loss"]
        ok = lo["finite"] and lo["first"] is not None and lo["last"] < lo["first"]
        add(
            "loss curve intact" + who,
            ok and lo["largest_rise"] <= c.loss_jump_max,
            f"{lo['kind']} loss {lo['first']} -> {lo['last']}, largest rise {_pct(lo['largest_rise'])}"
            + ("" if lo["finite"] else ", NOT FINITE"),
            f"falls, never rises more than {_pct(c.loss_jump_max)} between evaluations",
        )
    if c.no_crashes:
        # an adversary that brings itself down (the NaN sender's own loss) is no failure of the swarm
        theirs = tuple(f"peer {i} " for i in sc.adversaries)
        crashes = [
            p
            for p in s["problems"]
            if ("exited by itself" in p or "did not stop" in p) and not p.startswith(theirs)
        ]
        add("no crashes" + who, not crashes, f"{len(crashes)} unexpected exits or hangs", "none")
    if c.offenders_named:
        off, wrong = s.get("offenders") or [], s.get("false_accusations") or []
        falsely = f"; honest peers accused: {', '.join(str(x['peer']) for x in wrong)}" if wrong else ""
        add(
            "offenders named" + ("" if off else " (no adversary in this run)"),
            all(o["named"] for o in off) if off else None,
            ("; ".join(_offender_words(o) for o in off) or "-") + falsely,
            "every adversary accused by name in an honest peer's log",
        )
    return out


def _offender_words(o: dict[str, Any]) -> str:
    head = f"peer {o['peer']} ({o['adversary']}, {o['peer_id'] or 'id unknown'})"
    if not o["scanned"]:
        return f"{head}: logs not scanned"
    if o["named"]:
        by = ", ".join(str(i) for i in o["named_by"])
        return f"{head}: accused by peer(s) {by} in {o['accusing_lines']} line(s)"
    extra = f"; left out of {o['excluded_rounds']} honest round record(s)" if o["excluded_rounds"] else ""
    extra += f"; banned by peer(s) {', '.join(map(str, o['banned_by']))}" if o["banned_by"] else ""
    return f"{head}: NOT accused (named without blame by {len(o['mentioned_by'])} honest peer(s){extra})"


def _mean(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


def _med(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "-"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


# ---- writing ---------------------------------------------------------------------------------------


RUN_KEYS = (
    "load",
    "run_config",
    "run_file",
    "emulation",
    "wall_started",
    "seconds",
    "timeline",
    "problems",
    "interrupted",
    "link_stats",
)


def write_report(data: dict[str, Any], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for p in data["peers"]:
        (out / f"peer-{p['index']}.json").write_text(json.dumps(p, indent=1, default=_json_default))
    (out / "events.json").write_text(json.dumps(data["timeline"], indent=1))
    sc: Scenario = data["scenario"]
    meta = {k: data.get(k) for k in RUN_KEYS}
    meta["scenario_source"] = sc.source
    meta["scenario_changes"] = {
        "duration": sc.duration,
        "mode": sc.mode,
        "emulation": sc.emulation,
        "adversaries": [p.adversary for p in sc.peers],
    }
    with contextlib.suppress(OSError):
        meta["scenario_toml"] = Path(sc.source).read_text()
    (out / "run.json").write_text(json.dumps(meta, indent=1, default=_json_default))
    return render(data, out)


def load_run(out: Path) -> dict[str, Any]:
    """What write_report saved, read back (``python -m simulations report DIR`` analyses it again)."""
    meta = json.loads((out / "run.json").read_text())
    data = tomllib.loads(meta.pop("scenario_toml"))
    changes = meta.pop("scenario_changes")
    sc = parse_scenario(
        data, default_name=Path(meta["scenario_source"]).stem, source=meta.pop("scenario_source")
    )
    sc = sc.with_changes(**changes)
    peers = sorted(
        (json.loads(f.read_text()) for f in out.glob("peer-*.json")), key=lambda p: int(p["index"])
    )
    scan_logs(peers)  # again: the accusing forms may have changed since the run
    return {"scenario": sc, "peers": peers, **meta}


def render(data: dict[str, Any], out: Path) -> dict[str, Any]:
    """Analyse, plot, and write summary.json and report.md."""
    summary = analyse(data)
    from simulations.replay.plots import plot_all  # (matplotlib is imported only where plots are drawn)

    summary["plots"] = plot_all(data, out)
    summary["scenario_file"] = asdict(data["scenario"])
    (out / "summary.json").write_text(json.dumps(_finite(summary), indent=1, default=_json_default))
    (out / "report.md").write_text(markdown(summary, data))
    return summary


def _json_default(v: Any) -> Any:
    return str(v)


def _finite(v: Any) -> Any:
    """inf (an unshaped link) -> None, everywhere: JSON has no infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def _shown(source: str) -> str:
    """A scenario file as a report names it: relative to the repository when it lies there (a report is
    committed as a result, and a machine's own paths say nothing to its readers)."""
    path = Path(source)
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path.name


def markdown(s: dict[str, Any], data: dict[str, Any]) -> str:
    sc: Scenario = data["scenario"]
    emu = s["emulation"]
    lines = [
        f"# Scenario `{s['scenario']}`: {'PASSED' if s['passed'] else 'FAILED'}",
        "",
        s["description"] or "",
        "",
        f"- scenario file: `{_shown(s['source'])}`; run file: `{sc.run}` merged with the overrides into "
        f"`run.toml`; mode **{s['mode']}**",
        f"- emulation: **{emu.get('emulation')}**: {emu.get('what', '')}",
    ]
    lines += [f"- not emulated: {n}" for n in s["not_emulated"]]
    lines += [
        f"- {s['peers']} peers, {s['duration_s']:g} s scenario ({s['seconds']:g} s measured), "
        f"{s['events']} events carried out"
        + (", **interrupted**" if s["interrupted"] else "")
        + (f" (shortened from {s['written_duration_s']:g} s)" if s.get("written_duration_s") else ""),
    ]
    if s.get("load"):
        lines.append(
            f"- machine load (1/5/15 min): {s['load']['before']} at the start, {s['load']['after']} at the "
            f"end, on {os.cpu_count()} CPUs: the peers share them, and other work on the machine counts too"
        )
    if s["dropped_events"]:
        lines.append(f"- {len(s['dropped_events'])} events past the shortened duration were not carried out")
    lo = s["loss"]
    lines += [
        f"- global steps: **{s['last_step']}** (the first at {_num(s['first_step_at_s'])} s, "
        f"{_num(s['steps_per_min'])} per minute); samples computed: {s['samples']:,} "
        f"({_num(s['samples_per_s'])}/s over the whole run)",
        f"- {lo['kind']} loss: {lo['first']} -> **{lo['last']}** (largest rise between evaluations "
        f"{_pct(lo['largest_rise'])})",
        f"- divergence: **{s['divergence']['verdict']}** "
        f"({s['divergence']['steps_compared']} steps compared)",
        "",
        "## Checks",
        "",
        "| check | result | measured | target |",
        "|---|---|---|---|",
    ]
    for c in s["checks"]:
        verdict = {True: "pass", False: "**FAIL**", None: "reported"}[c["passed"]]
        lines.append(f"| {c['check']} | {verdict} | {c['measured']} | {c['target']} |")
    lines += _hostile_section(s)
    lines += [
        "",
        "## Peers",
        "",
        "| peer | slowdown | up/down Mbit/s | latency ms | processes | last step | samples (share) "
        "| utilization | averaged / alone / aborted / no group / synced | MB sent / received |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in s["per_peer"]:
        r = p["rounds"]
        lines.append(
            f"| {p['peer']} {p['name']}{' (' + p['adversary'] + ')' if p.get('adversary') else ''} "
            f"| {p['slowdown']:g} "
            f"| {_mbit(p['up_mbit'])} / {_mbit(p['down_mbit'])} | {p['latency_ms']:g} | {p['processes']} "
            f"| {p['final_step']} | {p['samples']:,} ({_pct(p['share'])}) "
            f"| {_pct(p['utilization'])} | {' / '.join(str(r.get(k, 0)) for k in OUTCOMES)} "
            f"| {p['mb_sent']:g} / {p['mb_received']:g} |"
        )
    lines += [
        "",
        "## Memory (RSS)",
        "",
        "| peer | process | lived s | after warm-up MB | end MB | peak MB | growth |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for r in s["rss"]:
        mark = "" if r["judged"] else " (not judged)"
        lines.append(
            f"| {r['peer']} | {r['process']} | {r['lived_s']:g} | {_num(r['rss_warm_mb'])} "
            f"| {r['rss_end_mb']} "
            f"| {r['rss_peak_mb']} | {_pct(r['growth'])}{mark} |"
        )
    if s["recoveries"]:
        delays = [r["next_step_s"] for r in s["recoveries"] if r["next_step_s"] is not None]
        lines += [
            "",
            "## Failures",
            "",
            f"{len(s['recoveries'])} failures; the swarm's next global step came after median "
            f"{_med(delays)} s (worst {max(delays, default='-')} s).",
            "",
            "| t s | event | peer | swarm step | next step after s | |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['t']:.0f} | {r['action']} | {r['peer']} | {r['step']} | {_num(r['next_step_s'])} "
            f"| {r['verdict']} |"
            for r in s["recoveries"]
        ]
    if s["catch_ups"]:
        lines += [
            "",
            "## Joins and restarts",
            "",
            "| t s | event | peer | swarm step | caught up after s | at step | first sync s "
            "| first averaged s | |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {x['t']:.0f} | {x['action']} | {x['peer']} | {x['swarm_step']} | {_num(x['caught_up_s'])} "
            f"| {_num(x['caught_up_step'])} | {_num(x['first_sync_s'])} | {_num(x['first_averaged_s'])} "
            f"| {x['verdict']} |"
            for x in s["catch_ups"]
        ]
    d = s["divergence"]
    if d["repaired_forks"] or d["divergences"]:
        lines += ["", "## Digest disagreements", ""]
        for x in d["divergences"][:20]:
            lines.append(
                f"- DIVERGED: peer {x['peer']} at step {x['step']} ({x['t']:.0f} s, {x['outcome']}) held "
                f"{x['digest']}, the majority {x['majority']}"
            )
        for x in d["repaired_forks"][:20]:
            lines.append(
                f"- repaired fork: peer {x['peer']} at step {x['step']} ({x['t']:.0f} s, {x['outcome']}), "
                f"repaired by {x['repaired_by']}"
            )
    if s["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in s["problems"]]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in s["plots"]]
    lines += [
        "",
        "Files: `peer-N.json` (processes, events, per-second series, metrics lines), `events.json`, "
        "`summary.json`, `run.toml`; node folders (logs, checkpoints) under `nodes/` unless `--workdir` "
        "put them elsewhere.",
        "",
    ]
    return "\n".join(lines)


def _hostile_section(s: dict[str, Any]) -> list[str]:
    off, h = s.get("offenders") or [], s.get("honest") or {}
    if not off:
        return []
    kept = {r["peer"]: r for r in h.get("per_peer", [])}
    out = [
        "",
        "## Hostile peers",
        "",
        f"Honest peers {', '.join(map(str, h.get('peers', [])))}: "
        + ("**kept training**" if h.get("kept_training") else "**did NOT all keep training**")
        + f" (each a global step within the last {h.get('window_s', 0):g} s; final steps "
        + ", ".join(f"{i}: {r['final_step']}" for i, r in kept.items())
        + ").",
        "",
        "| peer | attack | id | accused by (honest peers) | accusing lines | excluded rounds | banned by |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in off:
        out.append(
            f"| {o['peer']} | {o['adversary']} | `{o['peer_id'] or '?'}` "
            f"| {', '.join(map(str, o['named_by'])) or '**nobody**'} | {o['accusing_lines']} "
            f"| {o['excluded_rounds']} | {', '.join(map(str, o['banned_by'])) or '-'} |"
        )
    examples = [x for o in off for x in o["examples"]]
    if examples:
        out += ["", "Accusing log lines (first few):", ""] + [f"- `{x}`" for x in examples[:10]]
    for x in s.get("false_accusations") or []:
        by = ", ".join(map(str, x["accused_by"]))
        out.append(
            f"- honest peer {x['peer']} (`{x['peer_id']}`) accused by honest peer(s) {by} in "
            f"{x['accusing_lines']} line(s), e.g. `{x['examples'][0]}`"
        )
    return out


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def _mbit(x: float | None) -> str:
    return "unshaped" if x is None or (isinstance(x, float) and math.isinf(x)) else f"{x:g}"
