"""Sharded sites in a real swarm: two sites of N ranks (``p2ptrain node --shard N``) against two unsharded
peers that process the same tokens per step (``batch_size`` x N), each run on this host's loopback.

For each compression (``--compression``, default ``int8,topk3-q4``; top-k runs as a private swarm
under a throwaway authority, as ``p2ptrain simulate --private`` does):

1. **sites**: site A starts, site B joins it; both train the built-in GPT (``--layers``/``--width``)
   for ``--steps`` DiLoCo outer steps, each writing a per-rank checkpoint (DCP) after every step and
   evaluating every ``--eval-every`` steps. Checked afterwards: the two sites' global parameters,
   converted from their checkpoints (``dcp_to_torch_save``), are equal bit for bit at every step.
   Sampled meanwhile (every 0.2 s): each process's peak RSS (``VmHWM``) of both sites' process trees.
2. **unsharded**: the same run with two unsharded peers whose batches hold N times the samples.

Reported: the validation losses at equal tokens (the sites' against the unsharded peers', relative
difference; the target is within 1%), each step's round time from the nodes' metrics (the averager's
``seconds``), the wall time per step, and the per-process peak RSS (at these sizes the libraries'
footprint dominates it: the memory multiple at 350M parameters is ``bench_sharded``'s). Whether two
peers hold the same state after every outer step is also read from the state digests every node
reports in its metrics (global parameters and outer momentum: a site's digest is the one an unsharded
peer with the same state publishes), so it holds for a site beside an unsharded peer too
(``--peer unsharded``) and needs no checkpoints (``--checkpoint-every 0``: the nodes keep nothing).

A site of one rank (``--ranks 1``) is ``torchrun --standalone --nproc-per-node 1 -m p2ptrain node ...``
(FSDP2 on a group of one). **On a GPU** (``--device cuda``) that is the site one GPU holds (NCCL refuses
two ranks on one GPU), a site of N ranks is ``--shard N`` (N GPUs), and an unsharded peer is
``--device cuda``. Sampled as well: each process's GPU
memory (``nvidia-smi``), and each process's resident set while the nodes take outer steps (after their
first step: the startup's one full copy of the model, built on the CPU before it is sharded, is left
out), so that a host copy of the model made per round would show. A site's rank 0 also reports its
peak device memory from torch's allocator and the pinned host memory of its piece channel. At ~1B
parameters of the built-in GPT::

    python -m simulations.bench_sharded_swarm --device cuda --ranks 1 --peer unsharded \
        --compression int8 --layers 36 --heads 20 --width 1520 --steps 3 --skip-unsharded \
        --checkpoint-every 0 --eval-every 0 --target 64

Usage::

    python -m simulations.bench_sharded_swarm [--ranks 4] [--compression int8,topk3-q4] [--steps 6]
        [--layers 4] [--heads 4] [--width 256] [--device cpu|cuda] [--peer site|unsharded]
        [--skip-unsharded] [--overlap] [--rate-mbit 0] [--checkpoint-every 1] [--json PATH]
        [--timeout 1500]

The JSON report goes to PATH (default ``simulations/results/sharded-swarm.json``), a table to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import environment, write_report

DEFAULT_JSON = "simulations/results/sharded-swarm.json"


def run_file(folder: Path, args: argparse.Namespace, compression: str, batch: int, authority: str) -> Path:
    text = f"""
[run]
id = "sharded-swarm"
seed = 0
authority = "{authority}"

[task]
name = "tiny-gpt"

[task.options]
n_layer = {args.layers}
n_head = {args.heads}
n_embd = {args.width}
block_size = {args.block}
max_bytes = 2000000

[training]
mode = "diloco"
batch_size = {batch}
target_batch_size = {args.target}
lr = 0.001
warmup_steps = 4
grad_clip = 1.0
threads = {args.threads}

[diloco]
overlap = {str(args.overlap).lower()}

[averaging]
timeout = 300.0
matchmaking_time = 3.0
compression = "{compression}"

[progress]
interval = 0.5

[eval]
every_steps = {args.eval_every}
batch_size = 16

[checkpoint]
every_steps = {args.checkpoint_every}
keep = {args.steps + 2}
"""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"run-{compression}-{batch}.toml"
    path.write_text(text)
    return path


def membership(folder: Path, authority: Any) -> list[str]:
    """A node's key and its certificate from ``authority`` (a private swarm), as flags."""
    from p2ptrain.authority import authority_key_text, issue_certificate, save_certificate
    from p2ptrain.identity import load_or_create_identity

    identity, _ = load_or_create_identity(folder / "identity.key")
    now = time.time()
    cert = issue_certificate(authority, identity.peer_id, not_before=now - 60, expires=now + 86400)
    save_certificate(cert, folder / "membership.cert", overwrite=True)
    return [
        "--authority",
        authority_key_text(authority.public_key),
        "--certificate",
        str(folder / "membership.cert"),
        "--identity",
        str(folder / "identity.key"),
    ]


def start(
    folder: Path,
    run: Path,
    steps: int,
    shard: int,
    join: str | None,
    extra: list[str],
    *,
    device: str = "cpu",
    keep: bool = True,
    threads: int = 1,
    lab: Any = None,
    index: int = 0,
) -> subprocess.Popen[bytes]:
    """A node: a site of ``shard`` ranks (0: an unsharded peer); a site of one rank is started by
    ``torchrun``. ``keep``: the node's data folder is ``folder`` (checkpoints); else it keeps
    nothing (a key file in ``folder`` is its identity). ``lab``: a ``NetnsLab``, in whose namespace
    ``index`` the node runs (its ranks with it, on that namespace's loopback), listening on its shaped
    link."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable]
    if shard == 1:  # (a site of one rank: FSDP2 on a group of one, started as torchrun starts sites)
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    listen = f"{lab.address(index)}:0" if lab is not None else "127.0.0.1:0"
    cmd += ["-m", "p2ptrain", "node", "--config", str(run), "--listen", listen]
    cmd += ["--max-steps", str(steps), "--no-live", "--wait-peers", "2"]
    cmd += ["--metrics-file", str(folder / "metrics.jsonl")]
    if keep:
        cmd += ["--data-dir", str(folder)]
    elif "--identity" not in extra:
        from p2ptrain.identity import load_or_create_identity

        load_or_create_identity(folder / "identity.key")
        cmd += ["--identity", str(folder / "identity.key")]
    cmd += ["--shard", str(shard)] if shard > 1 else []
    cmd += ["--device", device] if device != "cpu" else []
    cmd += ["--join", join] if join else []
    cmd += extra
    log = open(folder / "node.log", "wb")  # noqa: SIM115  (closed with the process)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if lab is not None:
        return lab.popen(index, cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def address(folder: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str:
    end = time.time() + timeout
    while time.time() < end:
        for line in (folder / "node.log").read_text(errors="replace").splitlines():
            if line.startswith("/ip4/"):
                return line.strip()
        if proc is not None and proc.poll() is not None:
            tail = (folder / "node.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the node exited with {proc.returncode} before its address:\n{tail}")
        time.sleep(0.5)
    raise TimeoutError(f"no join address in {folder / 'node.log'}")


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except OSError:
            pass
    return out


def status_bytes(pid: int, field: str) -> int:
    """A memory figure of ``/proc/<pid>/status`` in bytes ("VmHWM": peak resident, "VmRSS": resident
    now); 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gpu_memory() -> dict[int, int]:
    """GPU memory used by each process (``nvidia-smi``; empty without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            used[int(fields[0])] = int(fields[1]) * 2**20
    return used


@dataclasses.dataclass
class Watched:
    """What :func:`watch` sampled, per node: each process's peak RSS (``VmHWM``), its resident sets
    over time (``VmRSS``: (time, {pid: bytes})), and its peak GPU memory (``nvidia-smi``)."""

    peaks: dict[str, dict[int, int]]
    samples: dict[str, list[tuple[float, dict[int, int]]]]
    gpu: dict[str, dict[int, int]]


def last_line(folder: Path) -> str:
    try:
        lines = (folder / "node.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def watch(
    procs: dict[str, subprocess.Popen[bytes]],
    timeout: float,
    *,
    gpu: bool = False,
    folders: dict[str, Path] | None = None,
    every: float = 15.0,
) -> Watched:
    """Wait for the nodes to end; sample each process's memory meanwhile, per node. Every ``every``
    seconds the last line of each node's log (in ``folders``) goes to stderr: a run that is stopped
    from outside still says where it was."""
    seen = Watched({name: {} for name in procs}, {name: [] for name in procs}, {name: {} for name in procs})
    began = time.time()
    end = began + timeout
    last_gpu = last_said = 0.0
    while any(p.poll() is None for p in procs.values()):
        if folders and time.time() - last_said >= every:
            last_said = time.time()
            for name, f in folders.items():
                print(f"[{last_said - began:.0f}s] {name}: {last_line(f)}", file=sys.stderr, flush=True)
        if time.time() > end:
            for p in procs.values():
                p.kill()
            raise TimeoutError("the nodes did not finish in time")
        used = {}
        if gpu and time.time() - last_gpu >= 1.0:
            used, last_gpu = gpu_memory(), time.time()
        for name, p in procs.items():
            if p.poll() is None:
                now: dict[int, int] = {}
                for pid in tree(p.pid):
                    seen.peaks[name][pid] = max(seen.peaks[name].get(pid, 0), status_bytes(pid, "VmHWM"))
                    now[pid] = status_bytes(pid, "VmRSS")
                    if pid in used:
                        seen.gpu[name][pid] = max(seen.gpu[name].get(pid, 0), used[pid])
                seen.samples[name].append((time.time(), now))
        time.sleep(0.2)
    for name, p in procs.items():
        if p.returncode:
            raise RuntimeError(f"{name} exited with {p.returncode}")
    return seen


def digests(folder: Path) -> dict[str, str]:
    """The state digest a node reported for each step (its metrics' ``digests``, all lines)."""
    out: dict[str, str] = {}
    for m in metrics(folder):
        for step, d in (m.get("digests") or {}).items():
            if d:
                out[step] = d
    return out


def metrics(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def pair(
    folder: Path, args: argparse.Namespace, compression: str, shards: tuple[int, int], authority: Any
) -> dict[str, Any]:
    """Nodes a and b, each a site of ``shards[i]`` ranks (0: an unsharded peer whose batches hold a
    site's samples per inner step)."""
    key = ""
    if authority is not None:
        from p2ptrain.authority import authority_key_text

        key = authority_key_text(authority.public_key)
    runs = {  # (an unsharded peer's batch: a site's samples per inner step)
        n: run_file(folder, args, compression, args.batch * (n or args.ranks), key) for n in set(shards)
    }
    a, b = folder / "a", folder / "b"
    for f in (a, b):
        f.mkdir(parents=True, exist_ok=True)
    extra_a = membership(a, authority) if authority is not None else []
    extra_b = membership(b, authority) if authority is not None else []
    keep = args.checkpoint_every > 0
    with contextlib.ExitStack() as stack:
        lab = None
        if args.rate_mbit > 0:  # (each node's link shaped with tc tbf, each way: see ``labs.netns``)
            from simulations.labs.netns import NetnsLab, unavailable

            why = unavailable()
            if why is not None:
                raise SystemExit(f"--rate-mbit needs a network-namespace lab: {why}")
            lab = stack.enter_context(NetnsLab(2, args.rate_mbit, prefix="p2pshard"))
        return run_pair(folder, args, runs, shards, (extra_a, extra_b), keep, lab)


def run_pair(
    folder: Path,
    args: argparse.Namespace,
    runs: dict[int, Path],
    shards: tuple[int, int],
    extras: tuple[list[str], list[str]],
    keep: bool,
    lab: Any,
) -> dict[str, Any]:
    """:func:`pair`'s nodes, run and measured (in ``lab``'s namespaces, where there is one)."""
    a, b = folder / "a", folder / "b"
    extra_a, extra_b = extras
    began = time.time()

    def node(f: Path, n: int, join: str | None, extra: list[str]) -> subprocess.Popen[bytes]:
        i = 0 if f == a else 1
        return start(
            f,
            runs[n],
            args.steps,
            n,
            join,
            extra,
            device=args.device,
            keep=keep,
            threads=args.threads,
            lab=lab,
            index=i,
        )

    procs = {"a": node(a, shards[0], None, extra_a)}
    deadline = began + args.timeout  # (for the whole run: the start and the steps)
    try:
        join = address(a, args.timeout, procs["a"])
    except (TimeoutError, RuntimeError):
        procs["a"].kill()
        raise
    procs["b"] = node(b, shards[1], join, extra_b)
    try:
        left = max(deadline - time.time(), 1.0)
        seen = watch(procs, left, gpu=args.device == "cuda", folders={"a": a, "b": b})
    except (TimeoutError, RuntimeError):
        for name, f in (("a", a), ("b", b)):  # (the folder goes with the run: say what the nodes said)
            tail = (f / "node.log").read_text(errors="replace")[-4000:]
            print(f"--- node {name}'s log, its end ---\n{tail}", file=sys.stderr)
        raise
    out: dict[str, Any] = {"wall_s": round(time.time() - began, 1), "ranks": list(shards)}
    fp32 = 4 * args.parameters
    for name, f in (("a", a), ("b", b)):
        lines = [m for m in metrics(f) if m.get("step")]
        steps = {m["step"]: m for m in lines}
        started = [m["time"] for m in lines]
        after = min(started) if started else float("inf")  # (from its first outer step on)
        stepping: dict[int, int] = {}
        for t, now in seen.samples[name]:
            if t >= after:
                for pid, v in now.items():
                    stepping[pid] = max(stepping.get(pid, 0), v)
        local = next((m["local"] for m in reversed(lines) if m.get("local")), None)
        out[name] = {
            "val_loss": {s: m["val_loss"] for s, m in sorted(steps.items()) if m.get("val_loss") is not None},
            "round_s": [m["rounds"]["last"].get("seconds") for _, m in sorted(steps.items())],
            "outcomes": [m["rounds"]["last"].get("outcome") for _, m in sorted(steps.items())],
            "contributors": [m["rounds"]["last"].get("contributors") for _, m in sorted(steps.items())],
            "step_wall_s": round((max(started) - min(started)) / max(len(steps) - 1, 1), 2)
            if started
            else None,
            "peak_rss_mb": sorted(round(v / 2**20) for v in seen.peaks[name].values() if v),
            # each process's largest resident set once outer steps began, over the fp32 parameter bytes
            "stepping_rss_mb": sorted(round(v / 2**20) for v in stepping.values() if v),
            "stepping_rss_over_fp32": round(max(stepping.values(), default=0) / fp32, 3),
            "gpu_mb": sorted(round(v / 2**20) for v in seen.gpu[name].values() if v),
            "local": local,
            "digests": digests(f),
        }
    da, db = out["a"]["digests"], out["b"]["digests"]
    common = sorted(set(da) & set(db), key=int)
    out["same_digest_steps"] = {s: da[s] == db[s] for s in common}
    if keep and shards[0] > 0 and shards[1] > 0:
        out["identical_steps"] = identical(a, b, args.steps, folder)
    return out


def identical(a: Path, b: Path, steps: int, scratch: Path) -> dict[str, bool]:
    """Per step: whether the two sites' global parameters (from their checkpoints) are equal."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for step in range(1, steps + 1):
        full = []
        for f in (a, b):
            where = f / "checkpoints" / "site" / f"step-{step}"
            if not where.is_dir():
                break
            dst = scratch / f"{f.name}-{step}.pt"
            dcp_to_torch_save(str(where), str(dst))
            state = torch.load(dst, weights_only=False)
            full.append({k: v for k, v in state["outer"].items() if k.startswith("global.")})
        if len(full) == 2:
            same = full[0].keys() == full[1].keys() and all(
                torch.equal(full[0][k], full[1][k]) for k in full[0]
            )
            out[str(step)] = bool(same and full[0])
    return out


def parameters(args: argparse.Namespace) -> int:
    """The built-in GPT's parameters at these settings (built on the meta device: no memory)."""
    import torch

    from p2ptrain.tasks.gpt import GPT, GPTConfig

    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block)
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench_sharded_swarm", description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--compression", default="int8,topk3-q4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="samples per batch on each rank")
    ap.add_argument("--target", type=int, default=128, help="samples per outer step")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (1: several CPU processes share this host's cores; on a GPU host"
        " with cores to spare, more: the model's build, digests and the rounds' coding run on the CPU)",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--peer",
        default="site",
        choices=["site", "unsharded"],
        help="node b: a site like a, or an unsharded peer",
    )
    ap.add_argument("--skip-unsharded", action="store_true", help="no run of two unsharded peers")
    ap.add_argument(
        "--overlap", action="store_true", help="diloco.overlap: rounds run while the next batches compute"
    )
    ap.add_argument(
        "--checkpoint-every", type=int, default=1, help="0: the nodes keep no data folder (no checkpoints)"
    )
    ap.add_argument(
        "--rate-mbit",
        type=float,
        default=0.0,
        help="each node's link at this rate each way (tc tbf in network namespaces; root); 0: loopback",
    )
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per run of two nodes, all told")
    args = ap.parse_args(argv)
    args.parameters = parameters(args)
    report: dict[str, Any] = {
        "benchmark": "sharded-swarm",
        "command": "python -m simulations.bench_sharded_swarm " + " ".join(argv or sys.argv[1:]),
        "settings": vars(args),
        "environment": environment(("torch",)),
        "runs": {},
    }
    rows = []
    for compression in args.compression.split(","):
        authority = None
        if compression.startswith("topk"):
            from p2ptrain.identity import Identity

            authority = Identity.generate()
        b = args.ranks if args.peer == "site" else 0
        with tempfile.TemporaryDirectory(prefix="p2ptrain-sharded-swarm-") as tmp:
            sites = pair(Path(tmp) / "sites", args, compression, (args.ranks, b), authority)
            plain = (
                None
                if args.skip_unsharded
                else pair(Path(tmp) / "plain", args, compression, (0, 0), authority)
            )
        run: dict[str, Any] = {"sites": sites, "unsharded": plain}
        va, vp = sites["a"]["val_loss"], plain["a"]["val_loss"] if plain is not None else {}
        common = sorted(set(va) & set(vp))
        if common:
            last = common[-1]
            run["val_loss_step"] = last
            run["val_loss_relative_difference"] = abs(va[last] - vp[last]) / vp[last]
        report["runs"][compression] = run
        rounds_site = [s for s in sites["a"]["round_s"] if s]
        rounds_plain = [s for s in plain["a"]["round_s"] if s] if plain is not None else []
        checks = {**sites.get("identical_steps", {}), **sites["same_digest_steps"]}
        same = all(checks.values()) and bool(sites["same_digest_steps"])
        run["identical_after_every_step"] = same
        diff = run.get("val_loss_relative_difference", float("nan"))
        mean_site = sum(rounds_site) / max(len(rounds_site), 1)
        mean_plain = sum(rounds_plain) / max(len(rounds_plain), 1)
        pa, sa, sb = plain["a"] if plain else {}, sites["a"], sites["b"]
        rows.append(
            f"{compression:>10} {same!s:>9} {diff:>9.4f} {mean_site:>8.2f} {mean_plain:>8.2f}"
            f" {sa['step_wall_s']!s:>8} {pa.get('step_wall_s', '-')!s:>8}"
            f"  site peaks MB {sa['peak_rss_mb']}, unsharded {pa.get('peak_rss_mb', '-')};"
            f" stepping RSS / fp32: a {sa['stepping_rss_over_fp32']}, b {sb['stepping_rss_over_fp32']};"
            f" GPU MB a {sa['gpu_mb']}, b {sb['gpu_mb']}"
        )
    head = "  ".join(f"{h:>8}" for h in ("compress", "identical", "val diff", "round s", "unsh. s", "step s"))
    table = "\n".join([head + "    unsh.", *rows])
    write_report(report, args.json, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
