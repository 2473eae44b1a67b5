"""Training with the tools people already use.

- :func:`join_swarm` starts a node for a run (a :class:`~p2ptrain.BackgroundNode`, in a thread of its
  own) from the run file's settings; :class:`SwarmOptimizer` is a ``torch.optim.Optimizer`` that any
  loop calling ``step()`` and ``zero_grad()`` can use: it hands each batch's gradients to the swarm and
  takes a step whenever the swarm does (see :class:`~p2ptrain.CollaborativeOptimizer`).
- :class:`~p2ptrain.integrations.shards.SwarmShards`: the dataset indices this peer reads, disjoint
  from the other peers' (shards claimed in the DHT), across restarts and joins;
  :func:`~p2ptrain.integrations.data.swarm_batches` makes a dataset a Task's batches with them, for the
  tasks ``p2ptrain node`` trains.
- :mod:`p2ptrain.integrations.huggingface`: a ``transformers.Trainer`` that trains in a swarm.
- :mod:`p2ptrain.integrations.lightning`: a Lightning ``Callback`` that does the same for ``L.Trainer``.

Neither library is a dependency of p2ptrain: each module imports its own when it is imported
(``pip install 'p2ptrain[integrations]'``).
"""

from .shards import SwarmShards
from .swarm import SwarmOptimizer, join_swarm

__all__ = ["SwarmOptimizer", "SwarmShards", "join_swarm"]
