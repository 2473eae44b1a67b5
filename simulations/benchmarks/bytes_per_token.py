"""Bytes per token: what each recipe sends on the wire for the same training, and the loss it reaches.

Swarms of 4 and 8 peers (``--quick``: 4) train the built-in byte-level GPT, 4 layers, 256 wide, 128 bytes
of context: 3,257,856 parameters, about a second per batch of 16 on one core here (``--quick``: 2 x 64,
64 bytes: 120,576), for the same tokens in every recipe (``--tokens``, the swarm's at 4 peers; at 8,
twice as many: the same tokens per peer, the same rounds), with ``p2ptrain simulate`` (real node
processes on loopback). Recipes:

- ``sync-fp32``, the baseline: ``training.mode = "sync"``, ``averaging.compression = "none"``: fp32
  gradients averaged every global step, whose target is one batch per peer;
- ``diloco-fp16``, ``diloco-int8``: DiLoCo with a target of H batches per peer per outer round (H = 16
  as in ``configs/tiny-gpt-diloco.toml``; ``--h``), pseudo-gradients in fp16 or blockwise int8;
- ``diloco-topk0.5-q2`` ... ``diloco-topk3-q4``: DiLoCo with the sparse top-k compressions, run with
  just those config values (their error feedback is the optimizer's business), in a private swarm
  (``simulate --private``: a run file refuses top-k in an open one);
- ``streaming-int8``, ``streaming-topk1-q2``, ``streaming-topk0.5-q2``: the same in 4 fragments, one
  averaged per round (``diloco.fragments = 4``); ``streaming-topk0.5-q2-h32``: with H = 32 whatever
  ``--h`` says (half the rounds per token: the payload per token halves); ``...-h32-ttl30``,
  ``...-h64-ttl30``: H = 32 or 64, and progress records valid 30 s (``progress.ttl``, as in the GPT-2
  run files), so that a steady peer's heartbeat goes out every 10 s instead of 3.3 s;
  ``streaming16-int8-h64``: int8 in 16 fragments at H = 64, a round every 4 inner steps as with 4
  fragments at H = 16, each a sixteenth of the model: for the peak rate against plain DiLoCo's.

A run stops (Ctrl-C to ``simulate``, as a user would: the nodes finish their round) at the first
evaluation at or past the budget: every outer step in DiLoCo, every H/4 steps in sync. Steps average
more samples than their target (peers compute while a group forms), so step counts differ; each record
says what a step took. The validation loss at equal tokens is linear between the evaluations around
the budget. A run in which two peers held different parameters on some step (``diverged_steps``, from
the simulation's report: two lineages, repaired or not) meets no target.

Bytes are the node's own wire counter (``traffic.bytes_sent``: every byte of every connection after
encryption and framing: the rounds, and also the DHT, progress records, matchmaking, state downloads;
not TCP/IP headers) on each peer's line of its last global step; tokens are the samples it computed
(``samples_here``) times the context. Bytes per token per peer: the swarm's bytes over the swarm's
tokens. Peak bytes per second: the largest rise of one peer's counter between two of its status files
(about 1 s apart). ``wire_over_payload``: the bytes sent over what the encodings imply per round (one
member, equal shares): the protocol's and the background traffic's share. A top-k sum sends only the
slots its members filled, so for top-k recipes the payload is what the rounds' value streams carried
(``payload_source``: "round streams", from ``sent_by_method``) rather than the encodings' largest size.

Target: a recipe with >= 1000x fewer bytes per token than the baseline at <= 2% higher validation loss
at equal tokens (stretch: 4000x).

Usage::

    python -m simulations.bench_bytes [--quick] [--peers 4,8] [--recipes NAME,...] [--h 16]
        [--tokens N] [--matchmaking S] [--json PATH] [--workdir DIR]

``--matchmaking``: the seconds a leader gathers its group (``averaging.matchmaking_time``; the node's
default is 3 s). The 8-peer rows were measured with 6: with 3, on 2 cores, two leaders gathered at once
and the peers left out downloaded the state, most of those runs' bytes.

The JSON goes to PATH (default ``simulations/results/bytes-per-token.json``), the loss curves of every
recipe beside it (``.png``), the table to stderr. With ``--recipes``, an earlier report's entries of the
other recipes are kept if its settings were the same. Every node is killed at the end, Ctrl-C included;
node folders (logs, metrics, status) stay in the work directory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2ptrain.averaging.compression import encoded_size, parse_compression
from p2ptrain.tasks.gpt import GPTConfig
from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment
from simulations.benchmarks.training_runs import (
    LoadSampler,
    Proc,
    cli,
    evidence_counts,
    kill_all,
    log_evidence,
    read_jsonl,
    read_jsonl_one,
    run_to_end,
    shown,
    step_lines,
    write_run_file,
)

MODULE = "simulations.bench_bytes"
DEFAULT_JSON = "simulations/results/bytes-per-token.json"
RATIO_TARGET, RATIO_STRETCH, LOSS_TOLERANCE = 1000.0, 4000.0, 0.02
TARGET = (
    f">= {RATIO_TARGET:g}x fewer bytes per token than the baseline at <= {100 * LOSS_TOLERANCE:g}% higher "
    f"validation loss at equal tokens (stretch {RATIO_STRETCH:g}x)"
)
SPARSE = ("topk0.5-q2", "topk1-q2", "topk1-q4", "topk3-q2", "topk3-q4")
RECIPES: dict[str, tuple[str, str]] = {  # name -> (training.mode, averaging.compression)
    "sync-fp32": ("sync", "none"),
    "diloco-fp16": ("diloco", "fp16"),
    "diloco-int8": ("diloco", "int8"),
    **{f"diloco-{c}": ("diloco", c) for c in SPARSE},
    "streaming-int8": ("diloco", "int8"),
    "streaming-topk1-q2": ("diloco", "topk1-q2"),
    "streaming-topk0.5-q2": ("diloco", "topk0.5-q2"),
    "streaming-topk0.5-q2-h32": ("diloco", "topk0.5-q2"),
    "streaming-topk0.5-q2-h32-ttl30": ("diloco", "topk0.5-q2"),
    "streaming-topk0.5-q2-h64-ttl30": ("diloco", "topk0.5-q2"),
    "streaming16-int8-h64": ("diloco", "int8"),
}
# recipe -> diloco.fragments
STREAMING = {
    name: 16 if name.startswith("streaming16-") else 4 for name in RECIPES if name.startswith("streaming")
}
# Recipes with their own H (the others: --h), and records valid 30 s instead of 10 (progress.ttl, as the
# GPT-2 run files have it: a record goes out on a step and every ttl / 3 besides)
RECIPE_H = {
    "streaming-topk0.5-q2-h32": 32,
    "streaming-topk0.5-q2-h32-ttl30": 32,
    "streaming-topk0.5-q2-h64-ttl30": 64,
    "streaming16-int8-h64": 64,
}
RECIPE_TTL = {"streaming-topk0.5-q2-h32-ttl30": 30.0, "streaming-topk0.5-q2-h64-ttl30": 30.0}
BASELINE = "sync-fp32"
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128, "max_bytes": 4_000_000}
QUICK_MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "max_bytes": 1_000_000}
H = 16  # configs/tiny-gpt-diloco.toml: target_batch_size 1024 = 16 inner steps x 16 samples x 4 peers
BATCH = 16
STEPPED = ("averaged", "alone")


@dataclass(frozen=True)
class Plan:
    peers: tuple[int, ...]
    recipes: tuple[str, ...]
    h: int
    tokens: int  # per recipe, the whole swarm's at 4 peers (see ``budget``)
    quick: bool
    workdir: Path
    model: dict[str, int] = field(default_factory=dict)
    timeout: float = 3600.0  # seconds per recipe
    matchmaking: float | None = None  # averaging.matchmaking_time (None: the node's default, 3 s)

    @property
    def block(self) -> int:
        return int(self.model["block_size"])

    def budget(self, peers: int) -> int:
        """The swarm's tokens per recipe: ``tokens`` at 4 peers, the same per peer at other sizes (the
        same rounds: at 8 peers, half the tokens per peer held two DiLoCo rounds at H=16, too few to
        compare recipes by)."""
        return self.tokens * peers // 4

    def params(self) -> int:
        keys = ("n_layer", "n_head", "n_embd", "block_size")
        return GPTConfig(**{k: self.model[k] for k in keys}).num_parameters()

    def per_step(self, name: str, peers: int) -> int:
        """Samples the swarm processes per global step: one batch per peer (sync), H (DiLoCo), H/F
        (streaming: each of the F fragments is still synced every H batches)."""
        mode = RECIPES[name][0]
        return BATCH * peers * (max(1, self.h_of(name) // fragments_of(name)) if mode == "diloco" else 1)

    def h_of(self, name: str) -> int:
        return RECIPE_H.get(name, self.h)

    def eval_every(self, name: str) -> int:
        """DiLoCo: every ``--h`` batches per peer (F steps when streaming, fewer for a recipe with a
        longer H of its own: its budget may hold only a few steps); sync: every H/4 steps."""
        if RECIPES[name][0] != "diloco":
            return max(1, self.h // 4)
        return max(1, fragments_of(name) * self.h // self.h_of(name))

    def settings(self) -> dict[str, Any]:
        return {"h": self.h, "tokens": self.tokens, "model": self.model, "batch_size": BATCH}

    def command(self) -> str:
        words = [f"python -m {MODULE}"] + (["--quick"] if self.quick else [])
        words += ["--peers", ",".join(map(str, self.peers)), "--h", str(self.h), "--tokens", str(self.tokens)]
        if self.recipes != tuple(RECIPES):
            words += ["--recipes", ",".join(self.recipes)]
        if self.matchmaking is not None:
            words += ["--matchmaking", f"{self.matchmaking:g}"]
        return " ".join(words)


def fragments_of(name: str) -> int:
    return STREAMING.get(name, 1)


def run_sections(plan: Plan, name: str, peers: int) -> dict[str, dict[str, Any]]:
    mode, compression = RECIPES[name]
    diloco = mode == "diloco"
    val = {} if plan.quick else {"val_sequences": 128}  # 16k validation tokens: steadier at the 2% scale
    training = {"mode": mode, "batch_size": BATCH, "target_batch_size": plan.per_step(name, peers)}
    training |= {"lr": 1e-3, "warmup_steps": 4 if plan.quick else 20, "threads": 1}  # (inner steps in DiLoCo)
    return {
        "run": {"id": f"bench-bytes-{name}-{peers}", "seed": 1},
        "task": {"name": "tiny-gpt"},
        "task.options": {**plan.model, **val},
        "training": training,
        "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9, "overlap": False, "fragments": fragments_of(name)},
        "averaging": {"compression": compression, "timeout": 60.0 if diloco else 30.0}
        | ({} if plan.matchmaking is None else {"matchmaking_time": plan.matchmaking}),
        **({"progress": {"ttl": RECIPE_TTL[name]}} if name in RECIPE_TTL else {}),
        "checkpoint": {"every_steps": 0},
        "eval": {"every_steps": plan.eval_every(name), "batch_size": 16},
    }


# ---- one run -----------------------------------------------------------------------------------------


def poll_traffic(path: Path, trace: list[tuple[float, int]]) -> None:
    """Append (time, bytes sent) from a node's status file when it was written again."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        st = json.loads(path.read_text())
        t, sent = float(st["updated_at"]), int(st["traffic"]["bytes_sent"])
        if not trace or t > trace[-1][0]:
            trace.append((t, sent))


def peak_rate(trace: list[tuple[float, int]]) -> float:
    """The largest rise of the counter per second between two successive status files seen."""
    pairs = itertools.pairwise(trace)
    return max(((b1 - b0) / (t1 - t0) for (t0, b0), (t1, b1) in pairs if t1 - t0 >= 0.5), default=0.0)


def sent_by_method(statuses: list[Path]) -> dict[str, int]:
    """What a peer's bytes went to, by RPC method (the mean over the peers' last status files; frames'
    headers and bodies, without the channel's framing)."""
    total: collections.Counter[str] = collections.Counter()
    for path in statuses:
        total.update(read_jsonl_one(path).get("traffic", {}).get("sent_by_method") or {})
    return {k: round(v / max(1, len(statuses))) for k, v in total.most_common()}


def allgather_per_round(compression: str, params: int, peers: int) -> float:
    """Bytes one member would send in a round of ``peers`` that all-gathers the encoded contributions
    (each member's to every other, each member summing them all) instead of reducing shares: the
    comparison the sparse recipes' round was chosen by."""
    return (peers - 1) * encoded_size(parse_compression(compression), params)


ROUND_DATA = ("avg.part", "avg.fetch", "avg.fetch_early", "avg.relay_result")
"""The round's streams of values: contributions, reduced shares, relays."""


def measured_payload(by_method: dict[str, int], averaged: int) -> float:
    """A top-k round's payload per member, as its value streams carried it (``sent_by_method``: a peer's
    mean): a sum sends only the slots its members filled, so the encodings give only its largest size."""
    return sum(by_method.get(m, 0) for m in ROUND_DATA) / max(1, averaged)


def payload_per_round(compression: str, params: int, peers: int) -> float:
    """Bytes one member sends in a round of ``peers`` with equal shares, by the encodings' sizes: its
    contributions to the other reducers, then its reduced share to the other members."""
    mode = parse_compression(compression)
    up, down = encoded_size(mode, params), encoded_size(mode, params, members=peers)
    return (peers - 1) / peers * (up + down)


def curve(per_peer: list[list[dict[str, Any]]], block: int, every: int) -> list[list[float]]:
    """[tokens, validation loss] at each evaluation: the swarm's tokens when it was taken (each peer's
    samples_here on its latest line up to that step)."""
    ref = max(per_peer, key=len)
    out = []
    for m in ref:
        if m["step"] % every or m.get("val_loss") is None:
            continue
        samples = sum(
            next((x["samples_here"] for x in reversed(lines) if x["step"] <= m["step"]), 0)
            for lines in per_peer
        )
        out.append([samples * block, round(float(m["val_loss"]), 5)])
    return out


def run_recipe(plan: Plan, name: str, peers: int, folder: Path) -> dict[str, Any]:
    """One recipe: ``p2ptrain simulate`` until an evaluation at or past the token budget (then Ctrl-C,
    as a user would: the nodes finish their round and stop), or the step bound, or the time limit."""
    mode, compression = RECIPES[name]
    config = folder / "run.toml"
    text = write_run_file(config, run_sections(plan, name, peers))
    # a bound on the steps (the budget ends a run: steps take more samples than their target)
    bound = 4 * plan.budget(peers) // (plan.block * plan.per_step(name, peers)) + 4
    argv = [*cli(), "simulate", "--peers", str(peers), "--max-steps", str(bound), "--config", str(config)]
    argv += ["--threads", "1", "--workdir", str(folder), "--no-live"]
    argv += ["--private"] if compression.startswith("topk") else []  # (an open swarm refuses top-k)
    out: dict[str, Any] = {"recipe": name, "mode": mode, "compression": compression, "peers": peers}
    out |= {"command": shown(argv), "run_file": text, "step_bound": bound, "bench_command": plan.command()}
    out["budget"] = plan.budget(peers)
    print(f"  {name}, {peers} peers ...", file=sys.stderr, flush=True)
    began, traces = time.perf_counter(), [list[tuple[float, int]]() for _ in range(peers)]
    metrics = [folder / f"node{i}" / "metrics.jsonl" for i in range(peers)]
    every, reached = plan.eval_every(name), False
    with LoadSampler() as load:
        proc = Proc("simulate", argv, folder, logs=("simulate.out", "simulate.err"))
        deadline = time.monotonic() + plan.timeout
        try:
            while proc.proc.poll() is None and time.monotonic() < deadline:
                for i, trace in enumerate(traces):
                    poll_traffic(folder / f"node{i}" / "status.json", trace)
                lines = [step_lines(read_jsonl(m)) for m in metrics]
                points = curve(lines, plan.block, every) if all(lines) else []
                if not reached and points and points[-1][0] >= out["budget"]:
                    reached = True
                    proc.proc.send_signal(signal.SIGINT)
                time.sleep(0.5)
            ended = run_to_end([proc], deadline - time.monotonic())
        finally:
            proc.stop(grace=30.0)
    out |= {"exit_code": ended["exit_codes"][0], "timed_out": bool(ended["timed_out"])}
    out |= {"seconds": round(time.perf_counter() - began, 1), "load": load.summary()}
    per_peer = [step_lines(read_jsonl(m)) for m in metrics]
    out["evidence"] = evidence_counts({f"node{i}": log_evidence(folder / f"node{i}") for i in range(peers)})
    summary = read_jsonl_one(folder / "report" / "summary.json")
    out["identical_parameters"] = summary.get("identical")
    out["diverged_steps"] = summary.get("diverged_steps")  # steps two peers held apart (forks)
    if out["timed_out"] or out["exit_code"] or not reached:
        with contextlib.suppress(OSError):  # (simulate prints why a node failed, with its last log line)
            out["error_tail"] = (folder / "simulate.out").read_text(errors="replace")[-1500:]
    if not all(per_peer):
        return out | {"status": "error", "error": "a peer logged no global step"}
    by_method = sent_by_method([folder / f"node{i}" / "status.json" for i in range(peers)])
    out |= measure(plan, per_peer, traces, name, peers, by_method)
    out["sent_by_method"] = by_method
    out["status"] = "ok" if reached else "incomplete"
    return out


def measure(
    plan: Plan,
    per_peer: list[list[dict[str, Any]]],
    traces: list[list[tuple[float, int]]],
    name: str,
    peers: int,
    by_method: dict[str, int],
) -> dict[str, Any]:
    compression = RECIPES[name][1]
    finals = [lines[-1] for lines in per_peer]
    sent = [int(m["bytes_sent"]) for m in finals]
    tokens = [int(m["samples_here"]) * plan.block for m in finals]
    got: dict[str, Any] = {
        "final_step": max(m["step"] for m in finals),
        "tokens": sum(tokens),
        "tokens_per_peer": tokens,
        "bytes_sent_per_peer": sent,
        "bytes_per_token": sum(sent) / max(1, sum(tokens)),
        "bytes_per_token_per_peer": [round(b / max(1, t), 3) for b, t in zip(sent, tokens, strict=True)],
        "curve": curve(per_peer, plan.block, plan.eval_every(name)),
        "rounds": max(finals, key=lambda m: m["step"])["rounds"] | {"last": None},
        # state downloads (a peer that fell behind: its samples were discarded, donors sent the state)
        "synced_per_peer": [m["rounds"].get("synced", 0) for m in finals],
    }
    used = [m["rounds"]["last"] for m in max(per_peer, key=len)]
    got["tokens_in_steps"] = plan.block * sum(
        x.get("samples") or 0 for x in used if x.get("outcome") in STEPPED
    )
    got["final_val_loss"] = got["curve"][-1][1] if got["curve"] else None
    peaks = [peak_rate(tr) for tr in traces]
    got["peak_bytes_per_s"] = max(peaks, default=0.0)
    got["peak_bytes_per_s_per_peer"] = [round(p) for p in peaks]
    got["samples_per_step"] = round(sum(tokens) / plan.block / max(1, got["final_step"]), 1)
    payload = payload_per_round(compression, plan.params() // fragments_of(name), peers)
    averaged = got["rounds"].get("averaged") or 0
    got["payload_source"] = "encodings"
    if parse_compression(compression).sparse and averaged and by_method:
        payload = measured_payload(by_method, averaged)
        got["payload_source"] = "round streams"
    got["payload_bytes_per_round"] = round(payload)
    got["allgather_bytes_per_round"] = round(
        allgather_per_round(compression, plan.params() // fragments_of(name), peers)
    )
    got["payload_bytes_per_token"] = averaged * payload * peers / max(1, sum(tokens))
    got["wire_over_payload"] = round(statistics.fmean(sent) / (averaged * payload), 3) if averaged else None
    # the rest, over each peer's time from its first status file to its last step: the background
    spans = [m["time"] - tr[0][0] for m, tr in zip(finals, traces, strict=True) if tr]
    rest = statistics.fmean(sent) - averaged * payload
    got["background_bytes_per_s"] = round(rest / statistics.fmean(spans)) if spans else None
    return got


# ---- comparison with the baseline ---------------------------------------------------------------------


def val_at(points: list[list[float]], tokens: float) -> float | None:
    """The validation loss at ``tokens``, linear between evaluations; None outside the curve."""
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t0 <= tokens <= t1:
            return v0 + (v1 - v0) * ((tokens - t0) / (t1 - t0) if t1 > t0 else 1.0)
    if points and abs(points[-1][0] - tokens) < 1e-9:
        return points[-1][1]
    return None


def compare(results: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """Per swarm size: every recipe against the baseline at the budget (or the tokens all reached);
    ``tokens``: the budget at 4 peers, for results that do not say theirs."""
    summary: dict[str, Any] = {}
    for peers in sorted({r["peers"] for r in results}):
        done = [r for r in results if r["peers"] == peers and r.get("curve")]
        base = next((r for r in done if r["recipe"] == BASELINE), None)
        if not done:
            continue
        finished = [r for r in done if r["status"] == "ok"] or done  # (a cut run does not set the mark)
        budget = max(r.get("budget", tokens * peers // 4) for r in done)
        common = min([budget] + [r["curve"][-1][0] for r in finished])
        ref = val_at(base["curve"], common) if base else None
        for r in done:
            v = val_at(r["curve"], common)
            rel = v / ref - 1 if v is not None and ref else None
            ratio = base["bytes_per_token"] / r["bytes_per_token"] if base else None
            pay = r.get("payload_bytes_per_token")
            r |= {
                "equal_tokens": common,
                "val_loss_at_equal_tokens": None if v is None else round(v, 5),
                "val_vs_baseline": None if rel is None else round(rel, 5),
                "ratio": None if ratio is None else round(ratio, 2),
                "payload_ratio": round(base["payload_bytes_per_token"] / pay, 1) if base and pay else None,
            }
            if ratio is None or rel is None or r is base:
                r["met"] = r["stretch_met"] = None
            elif r.get("diverged_steps"):  # two lineages: no loss of one swarm to compare
                r["met"] = r["stretch_met"] = False
            else:
                r["met"] = ratio >= RATIO_TARGET and rel <= LOSS_TOLERANCE
                r["stretch_met"] = r["met"] and ratio >= RATIO_STRETCH
        best = [r for r in done if r.get("met")]
        summary[str(peers)] = {
            "equal_tokens": common,
            "met": bool(best) if base else None,
            "best": max(best, key=lambda r: r["ratio"])["recipe"] if best else None,
            "stretch_met": any(r["stretch_met"] for r in done),
        }
    return summary


# ---- plot, table, README rows -------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """Every recipe's validation loss against the swarm's tokens, one panel per swarm size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["peers"] for r in report["results"]})
    n = max(1, len(sizes))
    fig, axes = plt.subplots(1, n, figsize=(8 * n, 7), dpi=100, squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, peers in zip(axes[0], sizes, strict=False):
        rows = [r for r in report["results"] if r["peers"] == peers and r.get("curve")]
        for i, r in enumerate(rows):
            base = r["recipe"] == BASELINE
            ratio = f", {r['ratio']:,.0f}x fewer B/token" if r.get("ratio") and not base else ""
            xs, ys = zip(*r["curve"], strict=True)
            ax.plot(  # past ten recipes the colours repeat: the line style tells them apart
                [x / 1e6 for x in xs], ys, marker="o", markersize=3, label=f"{r['recipe']}{ratio}",
                color="black" if base else colors[i % len(colors)], linewidth=2.0 if base else 1.2,
                linestyle="-" if i < len(colors) else "--",
            )  # fmt: skip
        budget = max(r.get("budget", 0) for r in report["results"] if r["peers"] == peers) / 1e6
        ax.axvline(
            budget or report["settings"]["tokens"] / 1e6,
            color="grey",
            linestyle="--",
            linewidth=0.8,
            label="equal tokens (the budget)",
        )
        ax.set_xlabel("tokens trained by the swarm (millions)")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{peers} peers, {report['params']:,}-parameter GPT, H={report['settings']['h']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _num(v: Any, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def table_rows(r: dict[str, Any]) -> list[str]:
    rounds = (r.get("rounds") or {}) | {"synced": sum(r.get("synced_per_peer") or [0])}
    outcome = "/".join(str(rounds.get(k, "-")) for k in ("averaged", "alone", "synced", "aborted"))
    if r.get("diverged_steps"):
        outcome += f" FORKED on {r['diverged_steps']}"
    met = {True: "yes", False: "no", None: "-"}[r.get("met")] + (" (stretch)" if r.get("stretch_met") else "")
    if "bytes_per_token" not in r:
        why = f"{r.get('status')}: {str(r.get('error') or r.get('error_tail') or '')[-120:]}"
        return [
            str(r["peers"]),
            r["recipe"],
            why.replace("\n", " "),
            *["-"] * 10,
            f"{r.get('seconds', 0):.0f}",
        ]
    rel, ratio = r.get("val_vs_baseline"), r.get("ratio")
    return [
        str(r["peers"]), r["recipe"], f"{r['tokens']:,}", _num(r.get("final_val_loss")),
        _num(r.get("val_loss_at_equal_tokens")), "-" if rel is None else f"{100 * rel:+.2f}%",
        f"{r['bytes_per_token']:,.3f}", "-" if ratio is None else f"{ratio:,.1f}x",
        peaks(r, table=True), _num(r.get("background_bytes_per_s"), ",.0f"),
        "-" if r.get("payload_ratio") is None else f"{r['payload_ratio']:,.0f}x", outcome, met,
        f"{r['seconds']:.0f}",
    ]  # fmt: skip


def format_table(report: dict[str, Any]) -> str:
    head = ["peers", "recipe", "tokens", "final val", "val @ equal", "vs base", "B/token/peer", "base/recipe"]
    head += ["peak MB/s max/median", "bg B/s", "payload x", "rounds a/l/s/x", "met", "s"]
    lines = [head] + [table_rows(r) for r in report["results"]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    s = report["settings"]
    text += [
        f"target: a recipe with {TARGET}",
        f"model: tiny-gpt {s['model']}: {report['params']:,} parameters; {s['tokens']:,} tokens per "
        "recipe at 4 peers (the same per peer at other sizes); "
        f"batch {s['batch_size']}; targets: one batch per peer per sync step, H = {s['h']} per DiLoCo round",
        "val @ equal: at the token budget, linear between the evaluations around it; peak: a peer's bytes/s "
        "between two status files; bg: a peer's bytes/s beyond the rounds' payload (the encodings' sizes; "
        "top-k: the round streams' bytes); "
        "payload x: base/recipe by that payload alone; rounds: the furthest peer's averaged/alone steps, "
        "state downloads of all peers, aborted rounds",
        f"node folders: {report['workdir']}; plot: {report.get('plot', '-')}",
    ]
    return "\n".join(text)


def peaks(r: dict[str, Any], table: bool = False) -> str:
    """The highest peer's peak rate and the median peer's (a peer that served a state download to one
    that fell behind has the highest: the rounds' own peak is the median's)."""
    top = r["peak_bytes_per_s"] / 1e6
    mid = statistics.median(r.get("peak_bytes_per_s_per_peer") or [r["peak_bytes_per_s"]]) / 1e6
    return f"{top:,.2f} / {mid:,.2f}" if table else f"{top:.2f} MB/s, median peer {mid:.2f}"


def result_rows(results: Path) -> list[dict[str, Any]]:
    """Rows of the README's results table (``simulations.benchmarks.suite``) from ``bytes-per-token.json``."""
    from simulations.benchmarks.suite import not_run, row

    path = results / Path(DEFAULT_JSON).name
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return [not_run("bytes per token", f"python -m {MODULE}")]
    out = []
    for r in d.get("results", []):
        bench, command = f"bytes per token ({r['peers']} peers)", r.get("bench_command") or d["command"]
        if "bytes_per_token" not in r:
            out.append(not_run(bench, command, f"{r['recipe']}: {r.get('status')}"))
            continue
        rel, ratio = r.get("val_vs_baseline"), r.get("ratio")
        metric = (
            f"{r['recipe']}: bytes sent per token per peer (val {_num(r.get('val_loss_at_equal_tokens'))} "
            f"at {r.get('equal_tokens', 0):,} tokens, {'-' if rel is None else f'{100 * rel:+.2f}%'} vs "
            f"{BASELINE}; peak {peaks(r)})"
        )
        base = r["recipe"] == BASELINE
        value = f"{r['bytes_per_token']:,.3g} B" + (
            "" if ratio is None or base else f" ({ratio:,.1f}x fewer)"
        )
        target, met = ("(the baseline)", None) if base else (TARGET, r.get("met"))
        out.append(row(bench, metric, value, None, target, met, command))
    return out


# ---- main ---------------------------------------------------------------------------------------------


def kept_results(path: Path, plan: Plan) -> list[dict[str, Any]]:
    """An earlier report's entries for the recipes and swarm sizes not run now, when it had the same
    settings."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if old.get("settings") != json.loads(json.dumps(plan.settings())) or old.get("quick") != plan.quick:
        return []
    rerun = {(name, n) for name in plan.recipes for n in plan.peers}
    kept = [r for r in old.get("results", []) if (r["recipe"], r["peers"]) not in rerun]
    for r in kept:  # (the run that measured it)
        r.setdefault("bench_command", old.get("command"))
    return kept


def parse_recipes(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items or any(x not in RECIPES for x in items):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(RECIPES)} (comma-separated)")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 peers, H 4: a smoke run")
    parser.add_argument("--peers", help="comma list of swarm sizes (default 4,8; --quick: 4)")
    parser.add_argument(
        "--recipes", type=parse_recipes, default=tuple(RECIPES), help="comma list (default all)"
    )
    parser.add_argument("--h", type=int, help=f"DiLoCo inner steps per round (default {H}; --quick: 4)")
    parser.add_argument(
        "--tokens",
        type=int,
        help="tokens per recipe, the swarm's at 4 peers, the same per peer at other sizes (default 2^20;"
        " --quick 2^17)",
    )
    parser.add_argument("--timeout", type=float, help="seconds per recipe (default 3600; --quick: 600)")
    parser.add_argument(
        "--matchmaking",
        type=float,
        metavar="S",
        help="averaging.matchmaking_time, the seconds a leader gathers its group (default: the node's 3 s)",
    )
    parser.add_argument(
        "--json", default=DEFAULT_JSON, metavar="PATH", help=f"report (default {DEFAULT_JSON})"
    )
    parser.add_argument("--workdir", metavar="DIR", help="node folders go here (default: a new temp folder)")
    args = parser.parse_args(argv)
    peers = tuple(int(x) for x in (args.peers or ("4" if args.quick else "4,8")).split(","))
    if any(p < 2 for p in peers) or (args.h is not None and args.h < 1):
        parser.error("--peers must be at least 2 and --h at least 1")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-bytes-"))
    plan = Plan(
        peers=peers,
        recipes=args.recipes,
        h=args.h or (4 if args.quick else H),
        tokens=args.tokens or (2**17 if args.quick else 2**20),
        quick=args.quick,
        workdir=workdir.resolve(),
        model=QUICK_MODEL if args.quick else MODEL,
        timeout=args.timeout or (600.0 if args.quick else 3600.0),
        matchmaking=args.matchmaking,
    )
    json_path = REPO_ROOT / DEFAULT_JSON if args.json == DEFAULT_JSON else Path(args.json).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the nodes are killed
    report: dict[str, Any] = {"benchmark": "bytes-per-token", "command": plan.command(), "quick": plan.quick}
    report |= {"target": TARGET, "settings": plan.settings(), "params": plan.params()}
    report |= {"environment": base_environment(("p2ptrain", "torch", "numpy", "trio"))}
    report["workdir"] = str(plan.workdir)
    results = kept_results(json_path, plan)
    began = time.perf_counter()
    try:
        for n in plan.peers:
            for name in plan.recipes:
                folder = plan.workdir / f"{n}-peers" / name
                try:
                    results.append(run_recipe(plan, name, n, folder))
                except Exception as e:  # one recipe failing must not hide the others' numbers
                    results.append(
                        {"recipe": name, "peers": n, "status": "error", "error": f"{type(e).__name__}: {e}"}
                    )
                finally:
                    kill_all()
    finally:
        kill_all()
    order = {name: i for i, name in enumerate(RECIPES)}
    report["results"] = sorted(results, key=lambda r: (r["peers"], order[r["recipe"]]))
    report["summary"] = compare(report["results"], plan.tokens)
    report["total_s"] = round(time.perf_counter() - began, 1)
    png = json_path.with_suffix(".png")
    with contextlib.suppress(ImportError):
        plot(report, png)
        report["plot"] = str(png.relative_to(REPO_ROOT) if png.is_relative_to(REPO_ROOT) else png)
    write_report(report, str(json_path), format_table(report))
    return 0 if all(r.get("status") == "ok" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
