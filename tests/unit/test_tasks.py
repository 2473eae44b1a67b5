"""Tasks: the Task interface, load_task's errors, the stdlib corpus and its split, batches, the GPT."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from p2ptrain.errors import ConfigError
from p2ptrain.tasks import (
    GPT,
    GPTConfig,
    Task,
    default_samples,
    default_to_device,
    gpt_task,
    load_task,
)
from p2ptrain.tasks.text import (
    SEPARATOR,
    fixed_windows,
    is_validation,
    list_sources,
    load_corpus,
    random_windows,
    stdlib_root,
)

SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "max_bytes": 200_000, "val_sequences": 8}

# The user task example of the docs (docs/own-script.md): tests below write it to a file and load it.
EXAMPLE_TASK = '''\
"""example_task.py: fit y = sin(x) with a small MLP. Run: p2ptrain node --task example_task:make_task"""

from collections.abc import Iterator

import torch

from p2ptrain.tasks import Task

Batch = tuple[torch.Tensor, torch.Tensor]


def make_task(hidden: int = 64) -> Task:
    def model() -> torch.nn.Module:  # p2ptrain seeds torch first: every peer gets the same weights
        return torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def batches(seed: int, batch_size: int) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(seed)  # each peer has its own seed, so its own data
        while True:
            x = torch.rand(batch_size, 1, generator=gen) * 6 - 3
            yield x, torch.sin(x) + 0.05 * torch.randn(batch_size, 1, generator=gen)

    def validation(batch_size: int) -> list[Batch]:  # the same points on every peer, every call
        x = torch.linspace(-3, 3, 256).unsqueeze(1)
        return [(x[i : i + batch_size], torch.sin(x[i : i + batch_size])) for i in range(0, 256, batch_size)]

    def loss(net: torch.nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(net(x), y)

    return Task("sine-mlp", model, batches, loss, validation, info={"hidden": hidden})
'''


@pytest.fixture
def small_task() -> Task:
    return load_task("tiny-gpt", SMALL)


_module_ids = itertools.count()


@pytest.fixture
def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Write a module with the given source into an importable folder; returns its (unique) name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(source: str) -> str:
        name = f"p2ptrain_test_task_{next(_module_ids)}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _validation_loss(task: Task, model: torch.nn.Module, batch_size: int = 16) -> float:
    assert task.validation is not None
    batches = list(task.validation(batch_size))
    with torch.no_grad():
        total = sum(task.loss(model, b).item() * task.samples(b) for b in batches)
    return total / sum(task.samples(b) for b in batches)


# --- load_task: the built-in task -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-gpt", "gpt", "  tiny-gpt "])
def test_load_task_builds_the_builtin_task_by_name_or_alias(name: str) -> None:
    task = load_task(name, SMALL)
    assert isinstance(task, Task) and task.name == "tiny-gpt"
    torch.manual_seed(0)
    model = task.model()
    assert isinstance(model, GPT)
    assert task.info["parameters"] == model.num_parameters()
    assert task.info["train_bytes"] == SMALL["max_bytes"]
    assert isinstance(task.info["data_fingerprint"], str) and len(task.info["data_fingerprint"]) == 16


def test_the_builtin_task_rejects_an_unknown_option_naming_it_and_the_accepted_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"no option 'n_layers' \(accepted: n_layer, n_head, .*val_sequences"
    ):
        load_task("tiny-gpt", {"n_layers": 2})


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("n_layer", 0, "n_layer must be a positive integer"),
        ("n_embd", -32, "n_embd must be a positive integer"),
        ("block_size", "32", "block_size must be a positive integer"),
        ("max_bytes", True, "max_bytes must be a positive integer"),
        ("val_sequences", 2.0, "val_sequences must be a positive integer"),
        ("n_head", 3, r"n_embd \(32\) must be divisible by n_head \(3\)"),
        ("dropout", 1.0, r"dropout must be a number in \[0, 1\)"),
        ("dropout", "0.1", r"dropout must be a number in \[0, 1\)"),
        ("val_fraction", 0.0, r"val_fraction must be a number in \(0, 1\)"),
        ("val_fraction", float("nan"), r"val_fraction must be a number in \(0, 1\)"),
    ],
)
def test_the_builtin_task_rejects_bad_option_values(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_task("tiny-gpt", {**SMALL, option: value})


def test_a_corpus_too_small_for_one_window_is_refused() -> None:
    with pytest.raises(ConfigError, match="fewer than one window"):
        gpt_task(**{**SMALL, "max_bytes": 16})


# --- load_task: module:callable and every way it can fail ----------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown task ''"),
        ("tiny_gpt", "unknown task 'tiny_gpt': give a built-in task"),
        ("mytask:", "malformed task"),
        (":make_task", "malformed task"),
        ("a:b:c", "malformed task"),
        ("./mytask.py:make_task", "not a file path"),
    ],
)
def test_malformed_specs_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_task(spec)


def test_a_module_that_does_not_exist_is_named_with_the_import_error() -> None:
    with pytest.raises(
        ConfigError, match="cannot import task module 'no_such_task_module': No module named 'no_such"
    ):
        load_task("no_such_task_module:make_task")


def test_a_module_whose_own_import_fails_names_the_missing_dependency(
    write_module: Callable[[str], str],
) -> None:
    name = write_module("import no_such_dependency_xyz\n")
    with pytest.raises(
        ConfigError, match=f"cannot import task module '{name}': No module named 'no_such_dep"
    ):
        load_task(f"{name}:make_task")


def test_a_module_that_raises_while_importing_is_reported(write_module: Callable[[str], str]) -> None:
    name = write_module("def broken(:\n")
    with pytest.raises(ConfigError, match=f"importing task module '{name}' failed: SyntaxError"):
        load_task(f"{name}:make_task")


def test_a_missing_or_uncallable_attribute_is_named(write_module: Callable[[str], str]) -> None:
    name = write_module("make_task = 42\n")
    with pytest.raises(ConfigError, match=f"task module '{name}' has no attribute 'make_tsak'"):
        load_task(f"{name}:make_tsak")
    with pytest.raises(ConfigError, match="is a int, not a callable returning a Task"):
        load_task(f"{name}:make_task")


def test_an_unknown_option_for_a_user_factory_is_named_with_the_accepted_ones(
    write_module: Callable[[str], str],
) -> None:
    name = write_module(EXAMPLE_TASK)
    with pytest.raises(ConfigError, match=r"has no option 'hiden' \(accepted: hidden\)"):
        load_task(f"{name}:make_task", {"hiden": 3})


def test_a_type_error_inside_a_kwargs_factory_names_the_option(write_module: Callable[[str], str]) -> None:
    name = write_module("def inner(*, size=1):\n    pass\n\ndef make_task(**kw):\n    return inner(**kw)\n")
    with pytest.raises(ConfigError, match=r"refused its options: .*unexpected keyword argument 'colour'"):
        load_task(f"{name}:make_task", {"colour": "red"})


def test_a_factory_that_raises_is_reported_in_one_line(write_module: Callable[[str], str]) -> None:
    name = write_module("def make_task():\n    raise ValueError('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"failed to build: ValueError: no GPU here$") as info:
        load_task(f"{name}:make_task")
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)  # the traceback stays reachable


def test_a_factory_raising_config_error_is_reported_with_the_task(write_module: Callable[[str], str]) -> None:
    name = write_module(
        "from p2ptrain.errors import ConfigError\n"
        "def make_task():\n    raise ConfigError('width must be even')\n"
    )
    with pytest.raises(ConfigError, match=f"task '{name}:make_task': width must be even"):
        load_task(f"{name}:make_task")


def test_a_factory_returning_something_else_than_a_task_is_refused(
    write_module: Callable[[str], str],
) -> None:
    name = write_module("import torch\ndef make_task():\n    return torch.nn.Linear(1, 1)\n")
    with pytest.raises(ConfigError, match=r"returned a Linear, not a p2ptrain\.tasks\.Task"):
        load_task(f"{name}:make_task")


def test_a_module_in_the_current_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "p2ptrain_cwd_example_task"
    (tmp_path / f"{name}.py").write_text(EXAMPLE_TASK)
    monkeypatch.chdir(tmp_path)
    # As under the installed `p2ptrain` script: the current directory is not on sys.path.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        task = load_task(f"{name}:make_task", {"hidden": 8})
    finally:
        sys.modules.pop(name, None)
    assert task.name == "sine-mlp" and task.info == {"hidden": 8}
    assert sys.path[0] == str(tmp_path)  # found through the retry, which leaves the folder on the path


def test_the_readme_example_task_loads_and_learns(write_module: Callable[[str], str]) -> None:
    task = load_task(f"{write_module(EXAMPLE_TASK)}:make_task", {"hidden": 16})
    torch.manual_seed(0)
    model = task.model()
    before = _validation_loss(task, model, batch_size=64)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for batch in itertools.islice(task.batches(1, 64), 150):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    assert _validation_loss(task, model, batch_size=64) < 0.2 * before


# --- the Task dataclass and its defaults ----------------------------------------------------------------


def test_samples_counts_the_first_element_of_a_tuple_list_or_dict_else_the_batch() -> None:
    x, y = torch.zeros(5, 3), torch.zeros(5)
    assert default_samples((x, y)) == 5
    assert default_samples([x, y]) == 5
    assert default_samples({"input": x, "target": y}) == 5
    assert default_samples(x) == 5


def test_to_device_moves_every_tensor_of_a_tuple_list_dict_or_lone_tensor() -> None:
    meta = torch.device("meta")  # a device every machine has: proves the tensors really moved
    x, y = torch.zeros(2, 3), torch.ones(2)
    moved = default_to_device((x, y, "label"), meta)
    assert isinstance(moved, tuple) and [t.device for t in moved[:2]] == [meta, meta] and moved[2] == "label"
    as_list = default_to_device([x, y], meta)
    assert isinstance(as_list, list) and all(t.device == meta for t in as_list)
    assert default_to_device({"x": x}, meta)["x"].device == meta
    assert default_to_device(x, meta).device == meta
    assert default_to_device(7, meta) == 7


def test_a_task_uses_the_defaults_and_refuses_what_is_not_callable() -> None:
    task = Task("t", model=lambda: torch.nn.Linear(1, 1), batches=lambda s, b: iter(()), loss=lambda m, b: m)
    assert task.samples is default_samples and task.to_device is default_to_device
    assert task.validation is None and task.info == {}
    with pytest.raises(ConfigError, match=r"Task.loss of task 't' must be callable"):
        Task("t", model=task.model, batches=task.batches, loss=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="non-empty string"):
        Task("", model=task.model, batches=task.batches, loss=task.loss)


# --- the corpus and its split ------------------------------------------------------------------------


def test_reading_the_corpus_twice_gives_the_same_bytes_and_a_disjoint_split() -> None:
    first = load_corpus.__wrapped__(200_000, 0.05, 20_000)  # bypass the per-process cache: read again
    second = load_corpus.__wrapped__(200_000, 0.05, 20_000)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert first.train_files == second.train_files and first.fingerprint == second.fingerprint
    assert first.train.dtype == torch.uint8 and len(first.train) == 200_000 and len(first.val) == 20_000
    assert first.train_files and first.val_files
    assert not set(first.train_files) & set(first.val_files)
    assert all(is_validation(f, 0.05) for f in first.val_files)
    assert not any(is_validation(f, 0.05) for f in first.train_files)
    # The training text is the training files, in order, joined by the separator (cut at max_bytes).
    root = stdlib_root()
    head = SEPARATOR.join((root / f).read_bytes() for f in first.train_files[:3])
    assert bytes(first.train[: len(head)].numpy()) == head


def test_the_corpus_is_read_once_per_process_and_shared() -> None:
    assert load_corpus(200_000, 0.05, 20_000) is load_corpus(200_000, 0.05, 20_000)


def test_the_stdlib_listing_is_sorted_and_skips_packages_caches_and_test_suites() -> None:
    files = list_sources(stdlib_root())
    assert files == sorted(files) and "os.py" in files and "json/__init__.py" in files
    parts = {p for f in files for p in f.split("/")[:-1]}
    assert not parts & {"site-packages", "dist-packages", "__pycache__", "test", "tests"}
    assert not any(f.startswith(("tkinter/", "idlelib/", "lib2to3/")) for f in files)


def test_the_split_follows_each_file_name_alone(tmp_path: Path) -> None:
    names = [f"m{i:03d}.py" for i in range(200)]
    for name in names:
        (tmp_path / name).write_bytes(name.encode())
    for skipped in ("site-packages/x.py", "__pycache__/y.py", "test/z.py", "pkg/tests/t.py", "tkinter/w.py"):
        (tmp_path / skipped).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped).write_bytes(b"SKIPPED")
    (tmp_path / "pkg" / "ok.py").write_bytes(b"pkg/ok.py")
    corpus = load_corpus.__wrapped__(10**6, 0.25, 10**6, tmp_path)
    val = [n for n in [*names, "pkg/ok.py"] if is_validation(n, 0.25)]
    assert 20 < len(val) < 80  # about a quarter: the hash spreads names evenly
    assert list(corpus.val_files) == sorted(val)
    assert bytes(corpus.val.numpy()) == SEPARATOR.join(n.encode() for n in sorted(val))
    assert b"SKIPPED" not in bytes(corpus.train.numpy()) + bytes(corpus.val.numpy())
    # Adding files elsewhere in the tree moves no existing file from one side to the other.
    (tmp_path / "extra.py").write_bytes(b"extra")
    again = load_corpus.__wrapped__(10**6, 0.25, 10**6, tmp_path)
    assert set(corpus.val_files) <= set(again.val_files) and set(corpus.train_files) <= set(again.train_files)


# --- batches and validation --------------------------------------------------------------------------


def test_training_batches_are_random_windows_with_y_shifted_by_one() -> None:
    data = torch.arange(250, dtype=torch.uint8)  # each byte is its own offset: windows are easy to read
    x, y = next(random_windows(data, 16, seed=3, batch_size=64))
    assert x.shape == y.shape == (64, 16) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(64, 15, dtype=torch.int64))  # contiguous windows
    assert torch.equal(y, x + 1)
    assert int(y.max()) <= 249  # every window, y included, lies inside the data
    assert len(set(x[:, 0].tolist())) > 30  # the starts are spread, not one window repeated


def test_training_batches_are_deterministic_per_seed_and_differ_across_seeds(small_task: Task) -> None:
    a = list(itertools.islice(small_task.batches(7, 4), 3))
    b = list(itertools.islice(small_task.batches(7, 4), 3))
    c = list(itertools.islice(small_task.batches(8, 4), 3))
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    assert not torch.equal(a[0][0], a[1][0])  # the stream moves on
    x, y = a[0]
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert small_task.samples(a[0]) == 4
    next(small_task.batches(-1, 2))  # any int is a seed


@pytest.mark.parametrize("batch_size", [0, -2, 1.5, True])
def test_a_bad_batch_size_is_refused_at_once(small_task: Task, batch_size: int) -> None:
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        small_task.batches(0, batch_size)
    assert small_task.validation is not None
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        small_task.validation(batch_size)


def test_validation_is_the_same_every_call_and_on_every_separately_built_task(small_task: Task) -> None:
    assert small_task.validation is not None
    first = list(small_task.validation(3))
    assert [len(x) for x, _ in first] == [3, 3, 2]  # val_sequences = 8 in batches of 3
    again = list(small_task.validation(3))
    load_corpus.cache_clear()  # another peer: reads the files itself
    other = load_task("gpt", SMALL)
    assert other.validation is not None and other.info == small_task.info
    for batches in (again, list(other.validation(3))):
        assert all(
            torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(first, batches, strict=True)
        )
    whole = torch.cat([x for x, _ in first])
    assert len(set(map(tuple, whole.tolist()))) == 8  # eight different sequences, not one repeated


def test_validation_windows_are_evenly_spaced_and_cover_the_data() -> None:
    data = torch.arange(101, dtype=torch.uint8)
    (x, y), (x2, _) = fixed_windows(data, 10, count=6, batch_size=4)
    starts = torch.cat([x, x2])[:, 0].tolist()
    assert starts == [0, 18, 36, 54, 72, 90] and int(y[-1, -1]) <= 100
    assert fixed_windows(data, 10, count=1, batch_size=4)[0][0][:, 0].tolist() == [0]


# --- the model --------------------------------------------------------------------------------------


def test_two_models_built_after_the_same_seed_are_bit_identical(small_task: Task) -> None:
    torch.manual_seed(1234)
    a = small_task.model()
    torch.manual_seed(1234)
    b = small_task.model()
    torch.manual_seed(4321)
    c = small_task.model()
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["wte.weight"], sc["wte.weight"])


def test_the_model_is_gpt2_shaped_with_tied_embeddings_and_scaled_residual_init() -> None:
    config = GPTConfig(block_size=16, n_layer=8, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(config)
    assert model.lm_head.weight is model.wte.weight
    assert model.num_parameters() == config.num_parameters()
    assert model(torch.zeros(2, 16, dtype=torch.int64)).shape == (2, 16, 256)
    std = model.blocks[0].attn.proj.weight.std().item()  # type: ignore[union-attr]
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)  # type: ignore[union-attr]


def test_the_model_is_causal_and_refuses_sequences_longer_than_its_context() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])  # no position sees a later one
    assert not torch.allclose(a[0, 10:], b[0, 10:])
    with pytest.raises(ValueError, match="longer than block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_the_loss_at_init_is_near_uniform_and_training_on_a_batch_lowers_it(small_task: Task) -> None:
    torch.manual_seed(0)
    model = small_task.model()
    batch = next(small_task.batches(0, 8))
    first = small_task.loss(model, batch)
    assert first.ndim == 0 and first.requires_grad
    # Uniform is ln 256 = 5.55; tied embeddings make "the next byte repeats this one" a little likelier.
    assert 5.0 < first.item() < 5.7
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(25):
        opt.zero_grad()
        small_task.loss(model, batch).backward()
        opt.step()
    assert small_task.loss(model, batch).item() < 0.6 * first.item()


def test_gpt_config_validates_itself() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        GPTConfig(n_layer=0)
