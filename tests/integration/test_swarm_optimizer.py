"""``p2ptrain.integrations.SwarmOptimizer``: a torch optimizer facade for other libraries' loops, on a
real node (loopback TCP, one peer: the swarm's first, stepping alone)."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.config import RunConfig, parse_config
from p2ptrain.integrations import SwarmOptimizer, join_swarm
from p2ptrain.integrations.swarm import HeldLR

pytestmark = pytest.mark.timeout(120)


def run_config() -> RunConfig:
    return parse_config({"run": {"id": "facade"}, "training": {"lr": 0.01, "warmup_steps": 0}})


def test_the_facade_is_the_wrapped_optimizer_to_a_loop_and_needs_a_sample_count() -> None:
    """Schedulers, checkpoints and accelerate read ``param_groups`` and ``state`` and may load a state
    dict, which replaces the wrapped optimizer's groups: the facade reads through, so it never holds a
    stale copy. The run file sets the rate; a scheduler that holds it changes nothing; ``zero_grad``
    leaves the gradients to the swarm; a ``step`` with no sample count says so."""
    run = run_config()
    model = torch.nn.Linear(4, 2)
    with join_swarm(run, listen="127.0.0.1:0") as node:
        inner = torch.optim.AdamW(model.parameters(), lr=0.5)
        opt = SwarmOptimizer(node, model, inner, run)
        assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == 0.01
        opt.load_state_dict(opt.state_dict())
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        held = HeldLR(opt)
        model(torch.ones(3, 4)).sum().backward()
        opt.zero_grad()
        assert all(p.grad is not None for p in model.parameters())
        with pytest.raises(RuntimeError, match="no samples counted"):
            opt.step()
        opt.add(3)
        loss = opt.step(lambda: torch.tensor(1.5))
        assert loss == 1.5 and all(p.grad is None for p in model.parameters())  # the swarm took them
        assert opt.swarm.optimizer.samples == 3
        held.step()
        assert opt.param_groups[0]["lr"] == 0.01


def test_a_data_dir_holds_one_node_at_a_time_and_is_free_once_it_closes(tmp_path) -> None:
    """Two nodes of one process in one folder would share its identity (each refusing to dial the
    other): the second is refused with the reason; once the first is closed, the folder (and with it
    the same identity) serves the next node."""
    from p2ptrain.config import ConfigError

    run = run_config()
    with join_swarm(run, listen="127.0.0.1:0", data_dir=tmp_path) as first:
        who = first.node.identity.peer_id
        with pytest.raises(ConfigError, match="in use by another node in this process"):
            join_swarm(run, listen="127.0.0.1:0", data_dir=tmp_path)
    with join_swarm(run, listen="127.0.0.1:0", data_dir=tmp_path) as again:
        assert again.node.identity.peer_id == who
