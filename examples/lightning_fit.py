"""One peer of a swarm that trains a small GPT-2 with Lightning.

    python examples/lightning_fit.py --listen 127.0.0.1:31337                        # the first peer
    python examples/lightning_fit.py --listen 127.0.0.1:31338 --join ADDRESS          # every other peer

Each peer prints the address others join through, then a line per global step of the swarm (its step
number and a digest of the parameters: the same on every peer at the same step).
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import torch
from common import ByteWindows, options, param_digest, small_gpt2

from p2ptrain import load_config
from p2ptrain.integrations import SwarmShards, join_swarm
from p2ptrain.integrations.lightning import SwarmCallback


class LanguageModel(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.model = small_gpt2(seed)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())  # (the run file sets its learning rate)


class PrintSwarmSteps(pl.Callback):
    def __init__(self, swarm: SwarmCallback) -> None:
        self.swarm = swarm

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        opt = self.swarm.optimizer
        if opt is not None and opt.stepped:
            print(json.dumps({"step": opt.epoch, "params": param_digest(pl_module)}), flush=True)


opts = options(__doc__.splitlines()[1])
run = load_config(opts.run)
module = LanguageModel(run.run.seed)
with join_swarm(run, listen=opts.listen, join=opts.join) as node:  # (1) start this peer's node
    print(json.dumps({"address": str(node.addresses[0])}), flush=True)
    windows = ByteWindows()
    shards = SwarmShards(node, len(windows), shard_size=256, seed=run.run.seed)  # (3) disjoint data
    data = torch.utils.data.DataLoader(windows, batch_size=opts.batch_size, sampler=shards.sampler())
    # (2) a callback that makes the optimizer step with the swarm
    swarm = SwarmCallback(node, run, wait_peers=opts.wait_peers, shards=shards)
    trainer = pl.Trainer(
        max_steps=opts.max_steps,
        accelerator="cpu",
        callbacks=[swarm, PrintSwarmSteps(swarm)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, data)
