"""A Lightning ``Callback`` that trains in a swarm.

::

    from p2ptrain.integrations import join_swarm
    from p2ptrain.integrations.lightning import SwarmCallback

    with join_swarm(run, listen="0.0.0.0:31337", join=[address]) as node:
        trainer = L.Trainer(max_steps=1000, callbacks=[SwarmCallback(node, run)])
        trainer.fit(module, data)

At the start of ``fit``, :class:`SwarmCallback` wraps the optimizer that the module's
``configure_optimizers`` returned in a :class:`~p2ptrain.integrations.SwarmOptimizer`: the optimizer
then steps when the swarm does, with the gradients averaged over the swarm. It counts the samples of
every training batch (the length of its first tensor, or ``samples(batch)``). As with any swarm, the
run file decides what every peer must do alike: the learning rate and its warm-up (the module's
schedulers are dropped), clipping of the averaged gradients, the global batch. One optimizer, one
process per peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from ..config import RunConfig
from ..node import BackgroundNode
from ..tasks import default_samples
from .shards import SwarmShards
from .swarm import SwarmOptimizer

log = logging.getLogger(__name__)

__all__ = ["SwarmCallback"]


class SwarmCallback(pl.Callback):
    """Train ``L.Trainer.fit`` as one peer of the swarm that ``node`` belongs to.

    The optimizer ``configure_optimizers`` returns is wrapped in a
    [`SwarmOptimizer`][p2ptrain.integrations.SwarmOptimizer]; ``optimizer`` (once ``fit`` started) says
    the swarm's step and last round.

    Args:
        node: This peer's node (see [`join_swarm`][p2ptrain.integrations.join_swarm]).
        run: The swarm's run file.
        wait_peers: How many peers, this one included, must train in the swarm before training starts
            (at most 10 minutes).
        samples: The samples in a batch.
        shards: The [`SwarmShards`][p2ptrain.integrations.SwarmShards] whose sampler the training data
            loader uses, so that only the claims of peers this one trusts count.
    """

    def __init__(
        self,
        node: BackgroundNode,
        run: RunConfig,
        *,
        wait_peers: int = 1,
        samples: Callable[[Any], int] = default_samples,
        shards: SwarmShards | None = None,
    ) -> None:
        self.node = node
        self.run = run
        self.wait_peers = wait_peers
        self.samples = samples
        self.optimizer: SwarmOptimizer | None = None
        if shards is not None and shards.trusted is None:  # fresh keys' claims do not starve this peer
            shards.trusted = self._trusted

    def _trusted(self) -> Any:
        return self.optimizer.swarm.optimizer.trusted() if self.optimizer is not None else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if trainer.world_size > 1:
            raise ValueError("SwarmCallback runs one process per peer: start each peer as its own process")
        if len(strategy.optimizers) != 1:
            raise ValueError(f"SwarmCallback needs exactly one optimizer, got {len(strategy.optimizers)}")
        optimizer = strategy.optimizers[0]
        if not isinstance(optimizer, SwarmOptimizer):
            optimizer = SwarmOptimizer(self.node, pl_module, optimizer, self.run)
            strategy.optimizers = [optimizer]
            if self.wait_peers > 1:
                log.info("waiting for %d peers in the swarm", self.wait_peers)
                optimizer.wait_for_peers(self.wait_peers)
        if strategy.lr_scheduler_configs:
            log.info("the module's learning-rate schedulers are dropped: the run file's schedule applies")
            strategy.lr_scheduler_configs = []
        self.optimizer = optimizer

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.optimizer is not None:
            self.optimizer.add(self.samples(batch))
