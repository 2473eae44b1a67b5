"""Training: the collaborative optimizer, the state it keeps and moves, the loop a node runs.

- ``optimizer/``: the collaborative optimizer (``CollaborativeOptimizer``) and its parts.
- ``state/``: the training state's byte format, capture and restore, chunked layout and root digest,
  serving it to joiners and downloading it from donors, checkpoints, file-backed tensors.
- ``local/``: the local data-parallel group (this host's other devices, one peer of the swarm).
- ``loop/``: the training loop a node runs (``Trainer``), its console, its experiment trackers.

``CollaborativeOptimizer`` is importable from here; it is imported on first use, so that importing one
submodule (the console, say) does not load the whole training stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .optimizer.collaborative import CollaborativeOptimizer, SyncCollaborativeOptimizer

__all__ = ["CollaborativeOptimizer", "SyncCollaborativeOptimizer"]

_LAZY = {
    "CollaborativeOptimizer": "optimizer.collaborative",
    "SyncCollaborativeOptimizer": "optimizer.collaborative",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
