"""The package's front door: ``p2ptrain.__all__`` is the documented public API, every name resolves, and
``import p2ptrain`` stays cheap (the lazily imported names are the ones the TYPE_CHECKING block names)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import p2ptrain
from p2ptrain import errors

ERRORS = {
    name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Exception)
}

PUBLIC = {
    "__version__",
    # training with the tools people use
    "join_swarm",
    "SwarmOptimizer",
    "SwarmTrainer",
    "SwarmCallback",
    "SwarmShards",
    # the collaborative optimizer
    "CollaborativeOptimizer",
    "SyncCollaborativeOptimizer",
    # run files and tasks
    "load_config",
    "RunConfig",
    "Task",
    "load_task",
    # a node from Python
    "Node",
    "NodeConfig",
    "BackgroundNode",
} | ERRORS

# Where each name is documented as coming from (the same object through both doors).
HOMES = {
    "join_swarm": "p2ptrain.integrations",
    "SwarmOptimizer": "p2ptrain.integrations",
    "SwarmShards": "p2ptrain.integrations",
    "SwarmTrainer": "p2ptrain.integrations.huggingface",
    "SwarmCallback": "p2ptrain.integrations.lightning",
    "CollaborativeOptimizer": "p2ptrain.training",
    "SyncCollaborativeOptimizer": "p2ptrain.training",
    "load_config": "p2ptrain.config",
    "RunConfig": "p2ptrain.config",
    "Task": "p2ptrain.tasks",
    "load_task": "p2ptrain.tasks",
    "Node": "p2ptrain.node",
    "NodeConfig": "p2ptrain.node",
    "BackgroundNode": "p2ptrain.node",
    "__version__": "p2ptrain.version",
} | {name: "p2ptrain.errors" for name in ERRORS}


def test_the_front_door_is_exactly_the_public_api() -> None:
    assert set(p2ptrain.__all__) == PUBLIC
    assert len(p2ptrain.__all__) == len(PUBLIC)  # (no name twice)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_name_resolves_to_its_home(name: str) -> None:
    import importlib

    assert getattr(p2ptrain, name) is getattr(importlib.import_module(HOMES[name]), name)


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("RpcRegistry", "p2ptrain.net"),
        ("RpcStream", "p2ptrain.net"),
        ("Method", "p2ptrain.net"),
        ("Reply", "p2ptrain.net"),
        ("CallContext", "p2ptrain.net"),
        ("PeerAddress", "p2ptrain.net"),
        ("Host", "p2ptrain.net"),
        ("Message", "p2ptrain.wire"),
        ("Identity", "p2ptrain.identity"),
        ("AveragerConfig", "p2ptrain.averaging"),
    ],
)
def test_the_toolkit_underneath_is_behind_its_own_door(name: str, home: str) -> None:
    import importlib

    assert getattr(importlib.import_module(home), name) is not None
    with pytest.raises(AttributeError):
        getattr(p2ptrain, name)


def test_the_lazy_names_are_the_ones_type_checkers_see() -> None:
    """``_LAZY`` (what ``__getattr__`` imports) and the ``TYPE_CHECKING`` block (what mypy and the docs
    read) name the same names from the same modules."""
    tree = ast.parse(Path(p2ptrain.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    typed = {
        alias.name: (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == p2ptrain._LAZY


def test_import_p2ptrain_loads_neither_torch_nor_the_network_stack() -> None:
    probe = (
        "import sys, p2ptrain;"
        " print(sorted(m for m in ('torch', 'trio', 'p2ptrain.net', 'p2ptrain.node') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
