"""One peer of a swarm that trains a small GPT-2 with the Hugging Face ``Trainer``.

    python examples/hf_trainer.py --listen 127.0.0.1:31337                          # the first peer
    python examples/hf_trainer.py --listen 127.0.0.1:31338 --join ADDRESS            # every other peer

Each peer prints the address others join through, then a line per global step of the swarm (its step
number and a digest of the parameters: the same on every peer at the same step).
"""

from __future__ import annotations

import json

from common import ByteWindows, options, param_digest, small_gpt2
from transformers import TrainerCallback, TrainingArguments

from p2ptrain import load_config
from p2ptrain.integrations import SwarmShards, join_swarm
from p2ptrain.integrations.huggingface import SwarmTrainer


class PrintSwarmSteps(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
        swarm = trainer.swarm_optimizer
        if swarm is not None and swarm.stepped:
            print(json.dumps({"step": swarm.epoch, "params": param_digest(model)}), flush=True)


opts = options(__doc__.splitlines()[1])
run = load_config(opts.run)
model = small_gpt2(run.run.seed)
with join_swarm(run, listen=opts.listen, join=opts.join) as node:  # (1) start this peer's node
    print(json.dumps({"address": str(node.addresses[0])}), flush=True)
    data = ByteWindows()
    args = TrainingArguments(
        output_dir="hf-example-output",
        per_device_train_batch_size=opts.batch_size,
        max_steps=opts.max_steps,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = SwarmTrainer(  # (2) a Trainer that steps with the swarm
        model=model,
        args=args,
        train_dataset=data,
        swarm=node,
        run=run,
        wait_peers=opts.wait_peers,
        shards=SwarmShards(node, len(data), shard_size=256, seed=run.run.seed),  # (3) disjoint data
        callbacks=[PrintSwarmSteps()],
    )
    trainer.train()
