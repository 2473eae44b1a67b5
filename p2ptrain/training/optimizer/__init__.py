"""The collaborative optimizer and its parts (see ``collaborative`` for the theory of operation).

``CollaborativeOptimizer`` and ``SyncCollaborativeOptimizer`` are importable from here; they are imported
on first use, so that a module that needs only a part (the progress records, say) does not load them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .collaborative import CollaborativeOptimizer, SyncCollaborativeOptimizer

__all__ = ["CollaborativeOptimizer", "SyncCollaborativeOptimizer"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import collaborative

    value = getattr(collaborative, name)
    globals()[name] = value
    return value
