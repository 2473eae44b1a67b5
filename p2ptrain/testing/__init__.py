"""Public test helpers: hostile peers on purpose (``adversary``) and, from ``p2ptrain.net``, the in-memory
network (``MemoryNetwork``) for swarms inside one process."""

from ..net.memory import MemoryNetwork
from .adversary import ADVERSARIES, install

__all__ = ["ADVERSARIES", "MemoryNetwork", "install"]
