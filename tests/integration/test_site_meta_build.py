"""A site builds its model on the meta device and fills its shards one parameter at a time
(``site.node.sharded_model``, with ``Task.initial_values``): real ranks (gloo on the CPU, spawned
processes). Every rank's shards are the rows of the model an unsharded peer builds from the same seed,
bit for bit, for any number of ranks; and no rank's memory ever holds the whole model (every rank used
to build it whole once: 280 GB per rank for a 70B model). A task whose ``initial_values`` misses or
invents a parameter is refused with its name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from p2ptrain.errors import ConfigError
from p2ptrain.tasks.gpt import GPT, GPTConfig
from p2ptrain.tasks.text import gpt_initial_values
from p2ptrain.training.site import launch
from p2ptrain.training.site.layout import rows_of
from p2ptrain.training.site.node import sharded_model
from p2ptrain.training.site.outer import local_of
from simulations.benchmarks import site_build
from simulations.benchmarks.site_build import site_task

pytestmark = pytest.mark.timeout(300)  # (spawned ranks start slowly on a busy machine)

SEED = 1234


def same_rows(rank: int, world: int, out: str, cfg_fields: dict[str, int]) -> None:
    cfg = GPTConfig(**cfg_fields)
    mesh = init_device_mesh("cpu", (world,))
    model = sharded_model(site_task(cfg, initial_values=True), SEED, mesh, "cpu")
    torch.manual_seed(SEED)
    whole = dict(GPT(cfg).named_parameters())  # an unsharded peer's (the test's reference only)
    for name, p in model.named_parameters():
        rows = rows_of(p.shape[0], world, rank)
        want = whole[name].detach()[rows.start : rows.stop]
        assert torch.equal(local_of(p).view(torch.int32), want.view(torch.int32)), f"{name} on rank {rank}"
    if rank == 0:
        Path(out).write_text("ok")


@pytest.mark.parametrize("world", [2, 3])
def test_a_sites_shards_are_the_rows_of_every_peers_initial_model(tmp_path: Path, world: int) -> None:
    """3 ranks: uneven chunks (a width of 72 over 3, 6 layers' rows), and the tied embedding."""
    cfg = {"n_layer": 3, "n_head": 2, "n_embd": 72, "block_size": 40, "vocab_size": 101}
    out = tmp_path / "ok"
    launch.spawn(same_rows, world, str(out), cfg, timeout=120)
    assert out.read_text() == "ok"


BIG = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 128}  # 85M parameters: 341 MB of fp32


def test_no_rank_holds_the_whole_model_while_it_builds(tmp_path: Path) -> None:
    """Two ranks build an 85M-parameter GPT (341 MB): with the task's initial values, each rank's peak
    memory grows by its shards, about one parameter and FSDP2's own (under three quarters of the model:
    measured 0.62); without them (the way every site built before), by the whole model at least."""
    full = GPTConfig(**BIG).num_parameters() * 4
    grown = {}
    for initial_values in (True, False):
        out = tmp_path / f"iv-{initial_values}"
        launch.spawn(site_build.build, 2, str(out), initial_values, BIG, timeout=240)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
        grown[initial_values] = [(r["grew"], r["held"]) for r in ranks]
    for grew, held in grown[True]:
        assert held <= 0.51 * full
        assert grew <= 0.75 * full, f"a rank grew by {grew / 1e6:.0f} MB of a {full / 1e6:.0f} MB model"
    assert all(grew >= full for grew, _ in grown[False]), grown[False]


def test_initial_values_that_miss_or_invent_a_parameter_are_refused_by_name(tmp_path: Path) -> None:
    out = tmp_path / "ok"
    launch.spawn(refused, 1, str(out), timeout=120)
    assert out.read_text() == "ok"


def refused(rank: int, world: int, out: str) -> None:
    cfg = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
    mesh = init_device_mesh("cpu", (world,))
    base = site_task(cfg, initial_values=True)
    for values, said in (
        (lambda m: list(gpt_initial_values(m))[:-1], "leaves 1 parameters unfilled: ln_f.bias"),
        (lambda m: [*gpt_initial_values(m), ("lm_head.weight", torch.nn.init.zeros_)], "'lm_head.weight'"),
        (lambda m: [*gpt_initial_values(m), ("wte.weight", torch.nn.init.zeros_)], "named twice"),
    ):
        with pytest.raises(ConfigError, match=said):
            sharded_model(dataclasses.replace(base, initial_values=values), SEED, mesh, "cpu")
    Path(out).write_text("ok")
