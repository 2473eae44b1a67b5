"""A Hugging Face ``transformers.Trainer`` that trains in a swarm.

::

    from p2ptrain.integrations import join_swarm
    from p2ptrain.integrations.huggingface import SwarmTrainer

    with join_swarm(run, listen="0.0.0.0:31337", join=[address]) as node:
        trainer = SwarmTrainer(model=model, args=args, train_dataset=data, swarm=node, run=run)
        trainer.train()

:class:`SwarmTrainer` is a ``Trainer`` whose optimizer (the one ``args`` or ``optimizers`` choose) is
wrapped in a :class:`~p2ptrain.integrations.SwarmOptimizer`: every ``args.gradient_accumulation_steps``
batches it hands the gradients to the swarm, and the optimizer steps when the swarm does. What every
peer must do alike comes from the run file: the learning rate and its warm-up (the Trainer's scheduler
is replaced by one that holds the rate), gradient clipping (``[training] grad_clip``, applied to the
averaged gradients: the Trainer's own ``max_grad_norm`` is turned off, as it would clip each peer's
part), and the global batch (``target_batch_size``). One process per peer: the Trainer's own
distributed modes (several GPUs in one peer) are not supported here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from ..config import RunConfig
from ..node import BackgroundNode
from ..tasks import default_samples
from .shards import SwarmShards
from .swarm import HeldLR, SwarmOptimizer

log = logging.getLogger(__name__)

__all__ = ["SwarmTrainer"]


class SwarmTrainer(Trainer):
    """``transformers.Trainer`` for one peer of a swarm.

    The Trainer's optimizer is wrapped in a [`SwarmOptimizer`][p2ptrain.integrations.SwarmOptimizer], so
    it steps when the swarm does; the run file's learning rate schedule replaces the Trainer's, and its
    ``grad_clip`` clips the averaged gradients (the Trainer's ``max_grad_norm`` is turned off).
    ``swarm_optimizer`` (once training started) says the swarm's step and last round.

    Args:
        *args: The Trainer's positional arguments.
        swarm: This peer's node (see [`join_swarm`][p2ptrain.integrations.join_swarm]).
        run: The swarm's run file.
        wait_peers: How many peers (this one included) must train in the swarm before training starts
            (at most 10 minutes).
        shards: A [`SwarmShards`][p2ptrain.integrations.SwarmShards] of the training dataset: the peers
            read disjoint data (give ``max_steps``: its sampler is endless).
        **kwargs: The Trainer's other arguments.

    Raises:
        ValueError: The Trainer runs several processes (one process per peer).
    """

    def __init__(
        self,
        *args: Any,
        swarm: BackgroundNode,
        run: RunConfig,
        wait_peers: int = 1,
        shards: SwarmShards | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1:
            raise ValueError("SwarmTrainer runs one process per peer: start each peer as its own process")
        if self.args.max_grad_norm:
            log.info(
                "max_grad_norm %g turned off: the run's grad_clip (%g) clips the swarm's averaged gradients",
                self.args.max_grad_norm,
                run.training.grad_clip,
            )
            self.args.max_grad_norm = 0.0
        self.swarm_node = swarm
        self.swarm_run = run
        self.swarm_optimizer: SwarmOptimizer | None = None
        self.wait_peers = wait_peers
        self.shards = shards
        if shards is not None and shards.trusted is None:  # fresh keys' claims do not starve this peer
            shards.trusted = self._trusted

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        if not isinstance(optimizer, SwarmOptimizer):
            assert isinstance(self.model, torch.nn.Module)
            per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
            optimizer = SwarmOptimizer(
                self.swarm_node, self.model, optimizer, self.swarm_run, samples_per_step=per_step
            )
            self.optimizer = optimizer
            if self.wait_peers > 1:
                log.info("waiting for %d peers in the swarm", self.wait_peers)
                optimizer.wait_for_peers(self.wait_peers)
        self.swarm_optimizer = optimizer
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if not isinstance(self.lr_scheduler, HeldLR):
            held = optimizer if optimizer is not None else self.optimizer
            assert isinstance(held, torch.optim.Optimizer)
            self.lr_scheduler = HeldLR(held)  # type: ignore[assignment]
        return self.lr_scheduler

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        if self.shards is not None:
            return self.shards.sampler()
        return super()._get_train_sampler(*args, **kwargs)

    def _trusted(self) -> Any:
        opt = self.swarm_optimizer
        return opt.swarm.optimizer.trusted() if opt is not None else None

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.swarm_optimizer is not None:  # the samples this batch adds to the next step
            self.swarm_optimizer.add(_samples(inputs))
        return super().training_step(model, inputs, *args, **kwargs)


def _samples(inputs: Any) -> int:
    """Rows in a Trainer batch (a dict of tensors, usually with ``input_ids``)."""
    if isinstance(inputs, Mapping) and "input_ids" in inputs:
        return len(inputs["input_ids"])
    return default_samples(inputs)
