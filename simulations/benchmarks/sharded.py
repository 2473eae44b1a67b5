"""Sharded sites: memory per rank and the outer round of a site of N ranks (FSDP2, gloo on the CPU).

For each N (``--ranks``, default 1,2,4) one site trains the built-in GPT (``--size``, default ``350m``:
GPT-2 medium's shape at the byte vocabulary, 302.6M parameters at a 64-byte context) with AdamW inner
steps under FSDP2 (every block a unit, the root the rest), then takes one DiLoCo outer round: every rank
streams its shard of the pseudo-gradient into rank 0's wire buffer piece by piece
(``ShardedOuter.contribute``), rank 0 reads and writes the whole wire vector once as an averaging round
does in place (a stand-in for the round: the network is not part of this measurement), and the landing
scatters the pieces back and steps every rank's shard of the outer state (``land``). Measured per rank:

* the **footprint** before the model exists (imports, gloo, one FSDP2 step of a 1-layer model: the
  libraries and their buffers), then the kernel's high-water mark reset (``/proc/self/clear_refs``);
* the **peak RSS** of each phase (build, inner steps, outer round), each phase's high-water mark read
  from ``VmHWM`` and reset after it;
* the **multiple**: (peak - footprint) / (4 x parameters), the figure the issue targets at
  ``7 / N + 0.5`` (2.25 at N = 4; unsharded DiLoCo peers measure 5.5-5.8, see the scale benchmark).

Also: an **unsharded peer's** outer step (``OuterStep.pseudo_gradients`` and ``step``, same size, one
process) against the site's (``contribute`` + ``land``), the time a site adds around a round whose bytes on
the wire are the same (``--skip-unsharded``: not measured); and **two sites** of ``--pair-ranks`` ranks
each (default 2; ``--pair-size``, default ``10m``), each training on its own data, whose rank 0s exchange
their wire vectors piece by piece (a stand-in for the averager, which tests/integration/test_sharded_swarm.py
runs for real) and average them: after every outer step the two sites' global parameters must hash the
same, and every rank's peak RSS per phase is measured as for the single site. Two sites of 4 ranks at ~1B
parameters (8 processes, about 2.25 x 4 GB of RSS each at the target: a host of 64 GB or more)::

    python -m simulations.bench_sharded --size 1b --ranks "" --skip-unsharded --pair-size 1b \
        --pair-ranks 4 --pair-steps 2 --inner 1 --compression int8

Usage::

    python -m simulations.bench_sharded [--size 350m] [--ranks 1,2,4] [--compression none|topk3-q4]
        [--inner 2] [--pair-size 10m] [--pair-ranks 2] [--pair-steps 3] [--skip-pair] [--skip-unsharded]
        [--json PATH] [--timeout 1800]

The JSON report goes to PATH (default ``simulations/results/sharded.json``; ``-``: stdout), a table to
stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simulations.benchmarks.environment import environment, write_report

DEFAULT_JSON = "simulations/results/sharded.json"
SIZES: dict[str, tuple[int, int, int]] = {
    "10m": (6, 6, 384),
    "124m": (25, 10, 640),
    "350m": (24, 16, 1024),
    "1b": (36, 20, 1520),
}
BLOCK_SIZE = 64


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _config(size: str) -> Any:
    from p2ptrain.tasks.gpt import GPTConfig

    n_layer, n_head, n_embd = SIZES[size]
    return GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=BLOCK_SIZE)


def _sharded_gpt(cfg: Any, mesh: Any, seed: int) -> torch.nn.Module:
    """The GPT built on the meta device, sharded (a unit per block, the root the rest), then each rank's
    shards filled from a per-parameter seed: the same values for any N, no full tensor but one
    parameter's at a time."""
    from torch.distributed.fsdp import fully_shard

    from p2ptrain.tasks.gpt import GPT
    from p2ptrain.training.site.layout import rows_of
    from p2ptrain.training.site.outer import local_of

    with torch.device("meta"):
        model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    world, rank = mesh.size(), mesh.get_local_rank()
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(seed * 100_003 + k)
            if name.endswith("bias"):
                full = torch.zeros(p.shape)
            elif "ln" in name:
                full = torch.ones(p.shape)
            else:
                full = torch.randn(p.shape, generator=g) * 0.02
            rows = rows_of(p.shape[0], world, rank)
            local_of(p).copy_(full[rows.start : rows.stop])
    return model


def _inner(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (1, BLOCK_SIZE + 1), generator=g)
    logits = model(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _footprint(mesh: Any) -> int:
    """The process's peak RSS once everything but the model is loaded (a tiny FSDP2 step)."""
    from torch.distributed.fsdp import fully_shard

    from p2ptrain.tasks.gpt import GPT, GPTConfig

    tiny = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))
    fully_shard(tiny, mesh=mesh)
    opt = torch.optim.AdamW(tiny.parameters())
    tiny(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    opt.step()
    del tiny, opt
    return _status("VmHWM")


def site_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from p2ptrain.averaging.compression import Compression, all_finite
    from p2ptrain.config import DilocoSection
    from p2ptrain.training.site.layout import WireLayout
    from p2ptrain.training.site.outer import ShardedOuter
    from p2ptrain.training.site.pieces import PieceChannel
    from p2ptrain.training.site.wire import WireBuffer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {"rank": rank, "footprint_bytes": _footprint(mesh)}
    _reset_peak()
    cfg = _config(spec["size"])
    model = _sharded_gpt(cfg, mesh, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    names = [n for n, _ in model.named_parameters()]
    layout = WireLayout(names, [p.shape for p in model.parameters()], world)
    outer = ShardedOuter(
        list(model.parameters()),
        layout,
        PieceChannel(layout, rank),
        DilocoSection(),
        Compression(spec["compression"]),
    )
    out["parameters"] = layout.total
    dist.barrier()
    out["build_peak_bytes"] = _status("VmHWM")
    _reset_peak()
    began = time.perf_counter()
    for k in range(spec["inner"]):
        _inner(model, opt, seed=1000 * rank + k)
    dist.barrier()
    out["inner_s"] = round((time.perf_counter() - began) / spec["inner"], 3)
    out["inner_peak_bytes"] = _status("VmHWM")
    _reset_peak()
    every = range(len(names))
    began = time.perf_counter()
    wire = WireBuffer(layout.total) if rank == 0 else None
    outer.contribute(every, wire)
    dist.barrier()
    out["contribute_s"] = round(time.perf_counter() - began, 3)
    if wire is not None:  # what an in-place round touches: it reads every value and writes the mean
        with wire.keep_released():  # (as a site's rank 0 does while its round runs)
            assert all_finite(wire.flat)
            wire.flat.mul_(1.0)
    # what the resident set holds at the end of the round: anonymous memory, and mapped file pages (the
    # wire buffer's: page cache, which the kernel can write back and drop under pressure)
    out["round_end_rss_anon_bytes"] = _status("RssAnon")
    out["round_end_rss_file_bytes"] = _status("RssFile")
    began = time.perf_counter()
    outer.land(every, wire, committed=True)
    dist.barrier()
    out["land_s"] = round(time.perf_counter() - began, 3)
    if wire is not None:
        wire.close()
    out["round_peak_bytes"] = _status("VmHWM")
    out["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(spec["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(out))


def unsharded(spec: dict[str, Any]) -> dict[str, Any]:
    """An unsharded peer's outer step at the same size: the time around a round a site compares with."""
    from p2ptrain.averaging.compression import Compression
    from p2ptrain.config import DilocoSection
    from p2ptrain.tasks.gpt import GPT
    from p2ptrain.training.optimizer.buffers import Contribution
    from p2ptrain.training.optimizer.outer import OuterStep

    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = GPT(_config(spec["size"]))
    params = list(model.parameters())
    contribution = Contribution(params, [range(len(params))], diloco=True, summed=False)
    outer = OuterStep(
        params, contribution, DilocoSection(outer_state="memory"), Compression(spec["compression"])
    )
    began = time.perf_counter()
    outer.pseudo_gradients()
    if outer.feedback is not None:
        outer.feedback.fold(contribution.buffer, 0)
    pseudo = time.perf_counter() - began
    began = time.perf_counter()
    outer.step(after=outer.reset_local)
    return {"pseudo_gradient_s": round(pseudo, 3), "step_s": round(time.perf_counter() - began, 3)}


def _exchange(wire: Any, other: int, first: bool, piece: int = 1 << 20) -> None:
    """A stand-in for the averager between two sites' rank 0s (global ``other`` is the other's): the
    wire vectors swapped piece by piece and averaged in place, each piece's pages released after it (as
    the site's round keeps them out of rank 0's resident set). ``(a + b) / 2`` is the same bits on both
    sides (IEEE addition commutes)."""
    theirs = torch.empty(min(piece, wire.numel), dtype=torch.float32)
    for lo in range(0, wire.numel, piece):
        hi = min(lo + piece, wire.numel)
        mine, got = wire.piece(lo, hi), theirs[: hi - lo]
        if first:
            dist.send(mine.contiguous(), dst=other)
            dist.recv(got, src=other)
        else:
            dist.recv(got, src=other)
            dist.send(mine.contiguous(), dst=other)
        mine.add_(got).div_(2)
        wire.release(lo, hi)


def _progress(out: dict[str, Any], phase: str) -> None:
    """One line to stderr per phase of a pair's rank (a run cut by its time box still says how far each
    rank got, and at what peak)."""
    times = {k: out[k] for k in ("inner_s", "round_s") if out.get(k)}
    print(
        f"site {out['site']} rank {out['rank']}: {phase}, peak RSS {_status('VmHWM') / 2**30:.2f} GiB"
        f" (footprint {out['footprint_bytes'] / 2**30:.2f}) {times}",
        file=sys.stderr,
        flush=True,
    )


def pair_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """Two sites of ``world // 2`` ranks; their rank 0s (global 0 and world // 2) swap wire vectors. Each
    rank's peak RSS per phase is measured as in :func:`site_rank` (build, inner steps, outer rounds)."""
    from torch.distributed.device_mesh import init_device_mesh

    from p2ptrain.averaging.compression import Compression
    from p2ptrain.config import DilocoSection
    from p2ptrain.training.site.layout import WireLayout
    from p2ptrain.training.site.outer import ShardedOuter
    from p2ptrain.training.site.pieces import PieceChannel
    from p2ptrain.training.site.wire import WireBuffer

    torch.set_num_threads(1)
    per = world // 2
    mesh = init_device_mesh("cpu", (2, per), mesh_dim_names=("site", "shard"))["shard"]
    site, local = divmod(rank, per)
    out: dict[str, Any] = {"rank": local, "site": site, "footprint_bytes": _footprint(mesh)}
    _reset_peak()
    model = _sharded_gpt(_config(spec["pair_size"]), mesh, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = [n for n, _ in model.named_parameters()]
    layout = WireLayout(names, [p.shape for p in model.parameters()], per)
    channel = PieceChannel(layout, local, group=mesh.get_group())
    outer = ShardedOuter(
        list(model.parameters()), layout, channel, DilocoSection(), Compression(spec["compression"])
    )
    out["parameters"] = layout.total
    dist.barrier()
    out["build_peak_bytes"] = _status("VmHWM")
    _progress(out, "built")
    out["inner_peak_bytes"] = out["round_peak_bytes"] = 0
    out["inner_s"], out["round_s"] = [], []
    digests = []
    for step in range(spec["pair_steps"]):
        _reset_peak()
        began = time.perf_counter()
        for k in range(spec["inner"]):
            _inner(model, opt, seed=10_000 * site + 100 * local + 10 * step + k)
        dist.barrier()
        out["inner_s"].append(round((time.perf_counter() - began) / spec["inner"], 3))
        out["inner_peak_bytes"] = max(out["inner_peak_bytes"], _status("VmHWM"))
        _reset_peak()
        began = time.perf_counter()
        wire = WireBuffer(layout.total) if local == 0 else None
        outer.contribute(range(len(names)), wire)
        if wire is not None:  # the two faces swap their contributions and take the same mean
            _exchange(wire, per if site == 0 else 0, first=site == 0)
        outer.land(range(len(names)), wire, committed=True)
        if wire is not None:
            wire.close()
        dist.barrier()
        out["round_s"].append(round(time.perf_counter() - began, 3))
        out["round_peak_bytes"] = max(out["round_peak_bytes"], _status("VmHWM"))
        _progress(out, f"outer step {step + 1}")
        h = hashlib.sha256()
        for g in outer.global_params:  # (every rank of the site gathers one parameter at a time)
            full = g.full_tensor()
            if local == 0:
                h.update(full.numpy().tobytes())
            del full
        digests.append(h.hexdigest())
    out["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(spec["out"]).joinpath(f"pair{rank}.json").write_text(json.dumps(out))
    if local == 0:
        Path(spec["out"]).joinpath(f"pair-site{site}.json").write_text(json.dumps({"digests": digests}))


def _multiples(ranks: list[dict[str, Any]]) -> None:
    """Each rank's (peak - footprint) / fp32 parameter bytes, per phase and the largest."""
    fp32 = 4 * ranks[0]["parameters"]
    for r in ranks:
        for phase in ("build", "inner", "round"):
            r[f"{phase}_multiple"] = round((r[f"{phase}_peak_bytes"] - r["footprint_bytes"]) / fp32, 3)
        r["multiple"] = max(r["build_multiple"], r["inner_multiple"], r["round_multiple"])


PLAN_SIZES = {"7B": 7e9, "13B": 13e9, "34B": 34e9, "70B": 70e9}
PLAN_SITES = [(4, 24), (8, 24), (4, 80), (8, 80), (16, 80), (32, 80)]  # (GPUs, GB each); 8 a host
GB = 1e9


def wire_bytes_per_param(compression: str, peers: int) -> float:
    """Bytes a member sends (about the same it receives) per parameter in a butterfly round of ``peers``:
    its contribution to the other reducers, and its partition's result to the other members."""
    from p2ptrain.averaging import sparse
    from p2ptrain.averaging.compression import Compression, encoded_size

    mode = Compression(compression)
    count = 10**9
    out = (peers - 1) / peers * encoded_size(mode, count) / count
    if mode.sparse:
        density, _ = mode.sparse
        back = sparse.sum_size(density, peers, count) / count
    else:
        back = encoded_size(mode, count) / count
    return out + (peers - 1) / peers * back


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Sharded sites of 7B-70B: arithmetic on the layout of a site's memory (every figure labelled) and
    on measured rates (the all-reduce's and the state download's fractions of the link)."""
    rows = []
    for size, params in PLAN_SIZES.items():
        for gpus, gb in PLAN_SITES:
            per_gpu = 16 * params / gpus / GB  # fp32 parameters, gradients, AdamW moments: FSDP2 shards
            hosts = max(1, gpus // 8)
            outer = (
                (8 if args.compression == "int8" else 12) * params / hosts / GB
            )  # global + momentum (+ residual)
            wire = wire_bytes_per_param(args.compression, args.peers) * params / GB
            rows.append(
                {
                    "size": size,
                    "site": f"{gpus} x {gb} GB" + (f" ({hosts} hosts)" if hosts > 1 else ""),
                    "gpu_state_gb": round(per_gpu, 1),
                    "fits": per_gpu <= 0.8 * gb,  # a fifth of the card left for activations and one unit
                    "host_ram_gb": round(outer, 1),
                    "rank0_page_cache_gb": round(4 * params / GB, 1),
                    "round_gb_each_way": round(wire, 2),
                    "round_s_1g": round(wire * 8 / 1.0 / args.allreduce_efficiency, 1),
                    "round_s_10g": round(wire * 8 / 10.0 / args.allreduce_efficiency, 1),
                    "state_gb": round(8 * params / GB, 1),
                    "state_s_1g": round(8 * params * 8 / 1e9 / args.sync_efficiency, 1),
                    "state_s_10g": round(8 * params * 8 / 10e9 / args.sync_efficiency, 1),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.training.site import launch

    ap = argparse.ArgumentParser(
        prog="python -m simulations.bench_sharded", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--size", default="350m", choices=sorted(SIZES))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--inner", type=int, default=2)
    ap.add_argument("--pair-size", default="10m", choices=sorted(SIZES))
    ap.add_argument("--pair-steps", type=int, default=3)
    ap.add_argument("--pair-ranks", type=int, default=2, help="ranks of each of the two sites")
    ap.add_argument("--skip-pair", action="store_true")
    ap.add_argument("--skip-unsharded", action="store_true", help="no unsharded peer's outer step")
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--plan", action="store_true", help="print the 7B-70B sites' arithmetic and exit")
    ap.add_argument("--peers", type=int, default=8, help="--plan: members of a round")
    ap.add_argument("--allreduce-efficiency", type=float, default=0.81, help="--plan: of the link bound")
    ap.add_argument("--sync-efficiency", type=float, default=0.93, help="--plan: a download, of the link")
    args = ap.parse_args(argv)
    if args.plan:
        rows = plan(args)
        print(json.dumps(rows, indent=2))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec: dict[str, Any] = {"size": args.size, "compression": args.compression, "inner": args.inner}
    report: dict[str, Any] = {
        "benchmark": "sharded",
        "command": "python -m simulations.bench_sharded "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(("torch",)),
        "size": args.size,
        "compression": args.compression,
        "sites": [],
    }
    rows = [
        f"{'ranks':>5} {'rank':>4} {'multiple':>8} {'inner':>8} {'round':>8} {'target':>7}"
        "  (peak RSS - footprint) / fp32 bytes"
    ]
    for n in [int(x) for x in args.ranks.split(",") if x.strip()]:
        with tempfile.TemporaryDirectory() as tmp:
            launch.spawn(site_rank, n, {**spec, "out": tmp}, timeout=args.timeout)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(n)]
        fp32 = 4 * ranks[0]["parameters"]
        _multiples(ranks)
        for r in ranks:
            r["round_end_anon_multiple"] = round(
                (r["round_end_rss_anon_bytes"] - r["footprint_bytes"]) / fp32, 3
            )
            r["round_end_file_multiple"] = round(r["round_end_rss_file_bytes"] / fp32, 3)
        target = round(7 / n + 0.5, 3)
        report["sites"].append(
            {"ranks": n, "parameters": ranks[0]["parameters"], "target": target, "per_rank": ranks}
        )
        for r in ranks:
            rows.append(
                f"{n:>5} {r['rank']:>4} {r['multiple']:>8.2f} {r['inner_multiple']:>8.2f}"
                f" {r['round_multiple']:>8.2f} {target:>7.2f}"
                f"  inner step {r['inner_s']} s, contribute {r['contribute_s']} s, land {r['land_s']} s;"
                f" at the round's end: anon {r['round_end_anon_multiple']},"
                f" mapped files {r['round_end_file_multiple']}"
            )
    if not args.skip_unsharded:
        report["unsharded_outer_step"] = unsharded(spec)
        rows.append(f"unsharded peer's outer step at {args.size}: {report['unsharded_outer_step']}")
    if not args.skip_pair:
        per = args.pair_ranks
        with tempfile.TemporaryDirectory() as tmp:
            pair = {**spec, "pair_size": args.pair_size, "pair_steps": args.pair_steps, "out": tmp}
            began = time.perf_counter()
            launch.spawn(pair_rank, 2 * per, pair, timeout=args.timeout)
            wall = time.perf_counter() - began
            a, b = (json.loads(Path(tmp, f"pair-site{s}.json").read_text())["digests"] for s in (0, 1))
            ranks = [json.loads(Path(tmp, f"pair{r}.json").read_text()) for r in range(2 * per)]
        _multiples(ranks)
        target = round(7 / per + 0.5, 3)
        report["two_sites"] = {
            "size": args.pair_size,
            "parameters": ranks[0]["parameters"],
            "ranks_each": per,
            "steps": args.pair_steps,
            "identical_after_every_step": a == b,
            "digests": a,
            "target": target,
            "worst_multiple": max(r["multiple"] for r in ranks),
            "wall_s": round(wall, 1),
            "per_rank": ranks,
        }
        rows.append(
            f"two sites of {per} ranks at {args.pair_size} ({ranks[0]['parameters']} parameters):"
            f" identical global parameters after every step: {a == b}; {wall:.0f} s in all"
        )
        for r in ranks:
            rows.append(
                f"  site {r['site']} rank {r['rank']}: multiple {r['multiple']:.2f} (target {target:.2f}:"
                f" build {r['build_multiple']:.2f}, inner {r['inner_multiple']:.2f}, round"
                f" {r['round_multiple']:.2f}); inner step {r['inner_s']} s, round {r['round_s']} s"
            )
    write_report(report, None if args.json == "-" else args.json, "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
