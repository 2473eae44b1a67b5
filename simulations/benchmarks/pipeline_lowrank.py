"""Activation compression for pipelines: a low-rank code measured against blockwise int8.

A GPT split into stages (``pipeline.stages``) is trained from the same seed on the same batches once
per scheme, with every stage boundary's activation (forward) and its gradient (backward) passed through
the scheme's encode and decode, as they would cross the wire:

- ``none``: float32 (the reference);
- ``int8``: the pipeline's blockwise int8 (``averaging.compression``: a float32 scale per 1024 values);
- ``lowrank-R``: per micro-batch, the (tokens x width) matrix's best rank-R approximation (a truncated
  SVD), sent as its two float32 factors (R x (tokens + width) values);
- ``lowrank-R+int8``: the same factors in blockwise int8.

Reported per scheme: the bytes per token across one boundary (forward and backward), the validation
loss after ``--steps`` steps and its gap to float32's, and, at the start, the relative error of one
boundary's activation and the cosine between the compressed and the exact parameter gradients. In
process, one thread: the wire codes are what is measured, not the network.

Usage::

    python -m simulations.bench_pipeline_lowrank [--steps 60] [--layers 8] [--embd 64] [--block 32]
        [--ranks 4,16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2ptrain.averaging.compression import Compression, decode, encode
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import Stage, split_gpt, stage_loss
from p2ptrain.tasks.gpt import GPT, GPTConfig
from p2ptrain.tasks.text import gpt_task

RESULTS = Path(__file__).resolve().parents[1] / "results"
Codec = Callable[[torch.Tensor], tuple[torch.Tensor, int]]  # tensor -> (decoded, bytes on the wire)


def int8(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    flat = x.detach().reshape(-1).to(torch.float32).contiguous()
    buf = encode(flat, Compression.INT8)
    return decode(buf, Compression.INT8, flat.numel()).view_as(x), len(memoryview(buf))


def lowrank(rank: int, quantize: bool) -> Codec:
    def code(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        m = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        a, b = u[:, :rank] * s[:rank], vh[:rank]
        if quantize:
            a, na = int8(a)
            b, nb = int8(b)
            nbytes = na + nb
        else:
            nbytes = 4 * (a.numel() + b.numel())
        return (a @ b).view_as(x), nbytes

    return code


def none(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x.detach(), 4 * x.numel()


class Wire(torch.autograd.Function):
    """Identity whose forward value and backward gradient pass through a codec (counting bytes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: Codec, meter: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.codec, ctx.meter = codec, meter
        y, n = codec(x)
        meter[0] += n
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        y, n = ctx.codec(g)
        ctx.meter[0] += n
        return y, None, None


def run_stages(stages: list[Stage], x: torch.Tensor, codec: Codec, meter: list[int]) -> torch.Tensor:
    h = x
    for i, stage in enumerate(stages):
        h = stage(h)
        if i < len(stages) - 1:
            h = Wire.apply(h, codec, meter)
    return h


def build(cfg: GPTConfig, pipeline: PipelineSection) -> list[Stage]:
    torch.manual_seed(0)
    return split_gpt(GPT(cfg), pipeline)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ranks", default="4,16")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--json", default=str(RESULTS / "pipeline_lowrank.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    task = gpt_task(
        n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.block, max_bytes=1_000_000
    )
    cfg = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.embd)
    bounds = tuple(round(i * args.layers / args.stages) for i in range(args.stages))
    pipeline = PipelineSection(stages=bounds)
    batches = task.batches(7, args.batch)
    train = [next(batches) for _ in range(args.steps)]
    val = task.validation(16)[:4]
    schemes: dict[str, Codec] = {"none": none, "int8": int8}
    for r in (int(v) for v in args.ranks.split(",")):
        schemes[f"lowrank-{r}"] = lowrank(r, False)
        schemes[f"lowrank-{r}+int8"] = lowrank(r, True)
    # the exact gradients at the start, to compare each scheme's first gradients with
    ref_stages = build(cfg, pipeline)
    x0, y0 = train[0]
    stage_loss(run_stages(ref_stages, x0, none, [0]), y0).backward()
    exact = torch.cat([p.grad.reshape(-1) for s in ref_stages for p in s.parameters() if p.grad is not None])
    with torch.no_grad():
        h = ref_stages[0](x0)
    tokens = x0.numel()
    rows = []
    for name, codec in schemes.items():
        stages = build(cfg, pipeline)
        meter = [0]
        stage_loss(run_stages(stages, x0, codec, meter), y0).backward()
        grads = torch.cat([p.grad.reshape(-1) for s in stages for p in s.parameters() if p.grad is not None])
        cosine = float(torch.nn.functional.cosine_similarity(grads, exact, dim=0))
        bytes_per_token = meter[0] / (args.stages - 1) / tokens  # one boundary, forward and backward
        err = float((codec(h)[0] - h).norm() / h.norm())
        params = [p for s in stages for p in s.parameters()]
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        opt.zero_grad(set_to_none=True)
        for x, y in train:
            stage_loss(run_stages(stages, x, codec, [0]), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            loss = sum(float(stage_loss(run_stages(stages, x, none, [0]), y)) for x, y in val) / len(val)
        rows.append(
            {
                "scheme": name,
                "bytes_per_token_per_boundary": round(bytes_per_token, 2),
                "activation_rel_error": round(err, 4),
                "first_gradient_cosine": round(cosine, 4),
                "val_loss": round(loss, 4),
            }
        )
        print(f"{name:18s} {rows[-1]}", file=sys.stderr)
    ref = next(r for r in rows if r["scheme"] == "none")
    for r in rows:
        r["val_loss_gap_pct"] = round(100 * (r["val_loss"] - ref["val_loss"]) / ref["val_loss"], 2)
        r["bytes_vs_fp32"] = round(ref["bytes_per_token_per_boundary"] / r["bytes_per_token_per_boundary"], 2)
    report = {
        "benchmark": "pipeline-lowrank",
        "command": "python -m simulations.bench_pipeline_lowrank "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {
            "n_layer": args.layers,
            "n_embd": args.embd,
            "block_size": args.block,
            "stages": list(bounds),
        },
        "steps": args.steps,
        "batch": args.batch,
        "schemes": rows,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(report, indent=2)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
