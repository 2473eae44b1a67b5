"""The built-in GPT at real sizes: the shipped run files' models have the parameter counts their comments
claim, GPTConfig.num_parameters counts what GPT builds, a build is bit-identical for a seed, and the
docs' transformers GPT-2 task (docs/own-script.md) trains.

No test here allocates a large model: the shipped sizes are counted by GPTConfig.num_parameters and by
GPT built on the meta device (shapes without storage), and the weights are compared at small shapes.
"""

from __future__ import annotations

import inspect
import itertools
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from p2ptrain.config import load_config
from p2ptrain.tasks import BUILTIN_TASKS, GPT, GPTConfig, gpt_task, load_task

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

#: The shipped sizes of the built-in GPT: run file, (n_layer, n_head, n_embd, block_size), parameters.
SHIPPED = {
    "gpt2-small.toml": ((12, 12, 768, 1024), 86_039_040),
    "gpt2-124m.toml": ((25, 10, 640, 1024), 123_908_480),
    "gpt2-medium.toml": ((24, 16, 1024, 1024), 303_622_144),
}

_SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")


def _gpt_config(path: Path) -> GPTConfig:
    """The model shape a run file of the built-in task asks for, its defaults filled in as gpt_task does."""
    options = dict(load_config(path).task.options)
    defaults = {
        name: p.default
        for name, p in inspect.signature(gpt_task).parameters.items()
        if name in _SHAPE_OPTIONS
    }
    return GPTConfig(**{name: options.get(name, default) for name, default in defaults.items()})


def _claimed_parameters(path: Path) -> int | None:
    """The count the file's opening comment states (``86,039,040 parameters``), if it states one."""
    header = "".join(line[1:] for line in path.read_text().splitlines() if line.startswith("#"))
    found = re.search(r"(\d{1,3}(?:,\d{3})+) parameters", " ".join(header.split()))
    return int(found.group(1).replace(",", "")) if found else None


def _builtin_run_files() -> list[Path]:
    return [p for p in sorted(CONFIGS.glob("*.toml")) if load_config(p).task.name.strip() in BUILTIN_TASKS]


# --- the shipped sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_gpt2_run_file_has_its_shape_and_the_count_its_comment_claims(name: str) -> None:
    (n_layer, n_head, n_embd, block_size), count = SHIPPED[name]
    path = CONFIGS / name
    config = _gpt_config(path)
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size) == (
        n_layer,
        n_head,
        n_embd,
        block_size,
    )
    assert config.vocab_size == 256  # byte-level
    assert config.num_parameters() == count
    assert _claimed_parameters(path) == count
    run = load_config(path)
    assert run.training.mode == "diloco" and run.diloco.overlap
    assert run.averaging.compression in ("fp16", "int8")
    assert run.training.grad_clip > 0


def test_every_built_in_task_run_file_that_states_a_count_states_the_right_one() -> None:
    claims = {path.name: _claimed_parameters(path) for path in _builtin_run_files()}
    assert set(SHIPPED) <= {name for name, claimed in claims.items() if claimed is not None}
    for name, claimed in claims.items():
        if claimed is None:  # the tiny runs state no count
            continue
        assert _gpt_config(CONFIGS / name).num_parameters() == claimed, name
        # What peers are shown comes from the same count, without building the model.
        run = load_config(CONFIGS / name)
        assert load_task(run.task.name, run.task.options).info["parameters"] == claimed, name


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shipped_sizes_built_without_storage_count_what_the_config_says(name: str) -> None:
    config = _gpt_config(CONFIGS / name)
    with torch.device("meta"):  # the real modules, no memory and no random draws
        model = GPT(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight
    assert model.num_parameters() == config.num_parameters() == SHIPPED[name][1]


# --- the count against a real build ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        GPTConfig(),
        GPTConfig(block_size=8, n_layer=1, n_head=1, n_embd=8),
        GPTConfig(vocab_size=300, block_size=64, n_layer=3, n_head=6, n_embd=48),
        GPTConfig(block_size=1024, n_layer=2, n_head=4, n_embd=64, dropout=0.1),
    ],
    ids=repr,
)
def test_num_parameters_counts_what_a_real_build_holds(config: GPTConfig) -> None:
    torch.manual_seed(0)
    model = GPT(config)
    distinct = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert config.num_parameters() == model.num_parameters() == sum(distinct.values())
    assert model.lm_head.weight is model.wte.weight  # the tie holds: the LM head adds nothing


# --- bit-identical builds ---------------------------------------------------------------------------

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1)


def _build(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The weights built after seeding torch, and the next number the default generator draws."""
    torch.manual_seed(seed)
    model = GPT(SMALL)
    return model.state_dict(), torch.rand(4)


def test_two_builds_from_the_same_seed_are_bit_identical_and_draw_the_same_numbers() -> None:
    first, after_first = _build(7)
    second, after_second = _build(7)
    other, _ = _build(8)
    assert first.keys() == second.keys()
    for key in first:
        # Bytes, not values: -0.0 == 0.0 and NaN != NaN would hide a difference between peers.
        assert first[key].numpy().tobytes() == second[key].numpy().tobytes(), key
    assert torch.equal(after_first, after_second)  # the build drew the same amount from the generator
    assert not torch.equal(first["wte.weight"], other["wte.weight"])


def test_every_tensor_is_initialized_the_gpt2_way_and_none_is_left_uninitialized() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
        elif isinstance(module, nn.Linear) and module.bias is not None:
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), name
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.ndim == 2:  # every matrix is drawn: N(0, 0.02), the residual projections smaller
            assert 0.002 < p.std().item() < 0.03, name
    assert model.wpe.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_the_weights_are_gpt2s_draws_in_module_order_and_the_build_draws_nothing_else() -> None:
    """The exact stream: every peer, whatever its version of this code, must draw the same numbers in the
    same order. A layer that also ran torch's default initialization would shift every later draw."""
    torch.manual_seed(11)
    model = GPT(SMALL)
    after_build = torch.rand(4)
    c, residual = SMALL.n_embd, 0.02 / math.sqrt(2 * SMALL.n_layer)
    torch.manual_seed(11)
    expected = {
        "wte.weight": torch.empty(SMALL.vocab_size, c).normal_(0.0, 0.02),
        "wpe.weight": torch.empty(SMALL.block_size, c).normal_(0.0, 0.02),
    }
    for i in range(SMALL.n_layer):
        for name, shape, std in (
            ("attn.qkv", (3 * c, c), 0.02),
            ("attn.proj", (c, c), residual),
            ("mlp.fc", (4 * c, c), 0.02),
            ("mlp.proj", (c, 4 * c), residual),
        ):
            expected[f"blocks.{i}.{name}.weight"] = torch.empty(shape).normal_(0.0, std)
    assert torch.equal(torch.rand(4), after_build)
    state = model.state_dict()
    for key, value in expected.items():
        assert state[key].numpy().tobytes() == value.numpy().tobytes(), key


# --- the docs' transformers example --------------------------------------------------------------

_module_ids = itertools.count()


def test_the_readme_transformers_gpt2_task_builds_identically_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    readme = (CONFIGS.parent / "docs" / "own-script.md").read_text()
    start = readme.index('"""hf_gpt2.py')
    name = f"p2ptrain_test_hf_gpt2_{next(_module_ids)}"
    (tmp_path / f"{name}.py").write_text(readme[start : readme.index("```", start)])
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        task = load_task(f"{name}:make_task", {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32})
    finally:
        sys.modules.pop(name, None)
    assert task.name == "hf-gpt2"
    torch.manual_seed(5)
    model = task.model()
    torch.manual_seed(5)
    again = task.model().state_dict()
    assert all(torch.equal(value, again[key]) for key, value in model.state_dict().items())
    # Its count is the built-in GPT's at the same shape: the same layout, the embedding tied to the head.
    assert (
        sum(p.numel() for p in model.parameters())
        == GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32).num_parameters()
    )
    batch = next(task.batches(0, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = task.loss(model, batch)
    assert 5.0 < first.item() < 6.0  # about ln 256: a fresh model
    for _ in range(10):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    assert task.loss(model, batch).item() < first.item() - 0.5
