"""A host's local data-parallel group (LocalGroup): rank 0 here, real worker processes, gloo on CPU.

What is proved here: one backward through the group leaves rank 0 with the sample-weighted mean of every
rank's gradient, computed on the parameters rank 0 published last; a worker killed with SIGKILL costs
nothing but a restart (the batch in progress counts with rank 0's own gradient, the new workers join
again); too many failures leave rank 0 training alone; closing, or an error on rank 0, leaves no process
behind; and a Trainer on a real node trains a few global steps with a local worker, the loss going down.

Worker processes run on the wall clock (imports, a TCPStore, gloo), so these tests bound every wait by a
deadline instead of asserting times.
"""

from __future__ import annotations

import copy
import hashlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.config import RunConfig
from p2ptrain.errors import ConfigError
from p2ptrain.identity import Identity
from p2ptrain.tasks import Task, load_task
from p2ptrain.training.local.group import LocalGroup, local_devices, worker_data_seed
from p2ptrain.training.local.protocol import backend_for
from p2ptrain.training.loop.trainer import Trainer, TrainerOptions

BATCH = 8  # each worker's batch size (training.batch_size)
OWN = 3  # rank 0's batch in these tests: a different size, so the sample weights matter
DATA_SEED = 1234
TIMEOUT = 5.0  # seconds a collective may take
RESTART_LIMIT = 30.0  # seconds a restarted group may take to train again (imports, task, gloo)

TASK_MODULE = """\
import torch

from p2ptrain.tasks import Task


def make_task() -> Task:
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def batches(seed, batch_size):
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, 4, generator=gen)
            yield x, x.sum(1, keepdim=True)

    def loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    return Task("local-group-test", model, batches, loss)
"""
TASK = "p2ptrain_local_group_task:make_task"


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    """LocalGroup and Trainer set torch's thread count for this process: give the next test its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_group(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[LocalGroup, Task, torch.nn.Module]]]:
    """A LocalGroup over the small task above (its module on a path added at run time, as a user's task
    may be), the task, and rank 0's model; every group is closed at the end."""
    (tmp_path / "p2ptrain_local_group_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[LocalGroup] = []

    def make(world: int = 2, **kwargs: Any) -> tuple[LocalGroup, Task, torch.nn.Module]:
        config = RunConfig().replace("task", name=TASK).replace("training", batch_size=BATCH, threads=1)
        task = load_task(TASK)
        torch.manual_seed(config.run.seed)
        model = task.model()
        group = LocalGroup(config, task, ["cpu"] * world, timeout=kwargs.pop("timeout", TIMEOUT), **kwargs)
        made.append(group)
        return group, task, model

    yield make
    for group in made:
        group.close()


def compute_for(task: Task, model: torch.nn.Module) -> Callable[[Any], float]:
    def compute(batch: Any) -> float:  # what Trainer._compute does
        loss = task.loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())

    return compute


def own_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(OWN, 4, generator=torch.Generator().manual_seed(7))
    return x, x.sum(1, keepdim=True)


def gradient(task: Task, model: torch.nn.Module, batch: Any) -> tuple[list[torch.Tensor], float]:
    """The gradient (and loss) of ``batch`` alone, on a copy of ``model``."""
    alone = copy.deepcopy(model)
    alone.zero_grad(set_to_none=True)
    loss = task.loss(alone, batch)
    loss.backward()  # type: ignore[no-untyped-call]
    return [p.grad.clone() for p in alone.parameters() if p.grad is not None], float(loss.detach())


def worker_batch(task: Task, group: LocalGroup, rank: int = 1, index: int = 0) -> Any:
    """The ``index``-th batch worker ``rank`` of the group's current generation computes."""
    batches = task.batches(worker_data_seed(DATA_SEED, rank, group.generation), BATCH)
    for _ in range(index):
        next(batches)
    return next(batches)


def nudge(model: torch.nn.Module, amount: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_devices_backends_and_seeds() -> None:
    assert local_devices(3) == ["cpu"] * 3
    assert backend_for(["cpu", "cpu"]) == "gloo"
    assert backend_for(["cuda:0", "cuda:1"]) == "nccl"
    with pytest.raises(ConfigError, match="all CPU or all CUDA"):
        backend_for(["cuda:0", "cpu"])
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="GPUs"):
            local_devices(2, "cuda")
    task = load_task("tiny-gpt", TINY)
    with pytest.raises(ConfigError, match="at least 2"):
        LocalGroup(RunConfig(), task, ["cpu"])
    with pytest.raises(ConfigError, match="needs an index"):
        LocalGroup(RunConfig(), task, ["cuda:0", "cuda"])
    seeds = {worker_data_seed(DATA_SEED, rank, generation) for rank in (1, 2) for generation in (1, 2)}
    assert len(seeds) == 4 and DATA_SEED not in seeds


def test_one_backward_gives_the_sample_weighted_mean_gradient(make_group: Callable[..., Any]) -> None:
    group, task, model = make_group()
    assert group.start(model, DATA_SEED)
    nudge(model, 0.1)  # the worker must compute on these published weights, not on its initial ones
    group.publish(model, changed=True, stop=False)

    loss, samples = group.backward(model, compute_for(task, model), own_batch())

    own, own_loss = gradient(task, model, own_batch())
    theirs, their_loss = gradient(task, model, worker_batch(task, group))
    assert samples == OWN + BATCH
    assert loss == pytest.approx((OWN * own_loss + BATCH * their_loss) / (OWN + BATCH), rel=1e-6)
    for p, g0, g1 in zip(model.parameters(), own, theirs, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, (OWN * g0 + BATCH * g1) / (OWN + BATCH))


def test_three_ranks_weigh_each_batch_by_its_samples(make_group: Callable[..., Any]) -> None:
    group, task, model = make_group(world=3)
    assert group.start(model, DATA_SEED)
    compute = compute_for(task, model)
    group.backward(model, compute, own_batch())  # the first batch of every rank
    model.zero_grad(set_to_none=True)

    _, samples = group.backward(model, compute, own_batch())

    expected = [OWN * g for g in gradient(task, model, own_batch())[0]]
    for rank in (1, 2):
        theirs = gradient(task, model, worker_batch(task, group, rank, index=1))[0]
        expected = [e + BATCH * g for e, g in zip(expected, theirs, strict=True)]
    assert samples == OWN + 2 * BATCH
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e / samples)


def test_steps_match_one_process_on_the_combined_batches(make_group: Callable[..., Any]) -> None:
    """Several optimizer steps, the parameters published after each (as DiLoCo's inner steps go): the
    result is what one process computes on each step's batches of both ranks together."""
    group, task, model = make_group()
    reference = copy.deepcopy(model)
    assert group.start(model, DATA_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    expected = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    mine = task.batches(DATA_SEED, OWN)
    theirs = task.batches(worker_data_seed(DATA_SEED, 1, group.generation), BATCH)
    compute = compute_for(task, model)
    for _ in range(5):
        own = next(mine)
        assert group.backward(model, compute, own)[1] == OWN + BATCH
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        group.publish(model, changed=True, stop=False)

        both = OWN * task.loss(reference, own) + BATCH * task.loss(reference, next(theirs))
        (both / (OWN + BATCH)).backward()
        expected.step()
        expected.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert len(set(group.digests())) == 1


def test_workers_hold_the_parameters_rank_0_published(make_group: Callable[..., Any]) -> None:
    group, task, model = make_group()
    assert group.start(model, DATA_SEED)
    first = group.digests()
    assert len(first) == 2 and first[0] == first[1]

    nudge(model, 0.5)
    stale = group.digests()
    assert stale[0] != stale[1] and stale[1] == first[1]  # digests report what each rank holds

    group.publish(model, changed=True, stop=False)
    assert len(set(group.digests())) == 1

    nudge(model, -0.25)  # changed in place without saying so (a state download, say)
    group.publish(model, changed=False, stop=False)
    assert len(set(group.digests())) == 1

    group.backward(model, compute_for(task, model), own_batch())  # a batch changes gradients only
    assert len(set(group.digests())) == 1


def test_a_killed_worker_costs_a_restart_not_a_batch(make_group: Callable[..., Any]) -> None:
    group, task, model = make_group()
    assert group.start(model, DATA_SEED)
    compute = compute_for(task, model)
    assert group.backward(model, compute, own_batch())[1] == OWN + BATCH
    old = group.worker_pids[0]

    os.kill(old, signal.SIGKILL)
    model.zero_grad(set_to_none=True)
    loss, samples = group.backward(model, compute, own_batch())  # raises nothing

    own, own_loss = gradient(task, model, own_batch())
    assert (samples, loss) == (OWN, pytest.approx(own_loss))  # rank 0's batch alone, counted once
    for p, g in zip(model.parameters(), own, strict=True):
        assert torch.equal(p.grad, g)
    assert group.restarts == 1
    assert gone(old)

    deadline = time.monotonic() + RESTART_LIMIT
    while samples != OWN + BATCH:  # rank 0 trains alone until the new worker is ready
        assert time.monotonic() < deadline, "the local group did not come back"
        time.sleep(0.05)
        model.zero_grad(set_to_none=True)
        loss, samples = group.backward(model, compute, own_batch())
    assert group.worker_pids[0] != old
    assert len(set(group.digests())) == 1


def test_a_hung_worker_is_given_up_after_the_timeout(make_group: Callable[..., Any]) -> None:
    group, task, model = make_group(timeout=2.0)
    assert group.start(model, DATA_SEED)
    stuck = group.worker_pids[0]
    os.kill(stuck, signal.SIGSTOP)  # alive, but it will never answer

    assert group.backward(model, compute_for(task, model), own_batch())[1] == OWN
    assert group.restarts == 1 and gone(stuck)
    assert group.start(model)
    assert group.backward(model, compute_for(task, model), own_batch())[1] == OWN + BATCH


def test_too_many_failures_leave_rank_0_alone(
    make_group: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    group, task, model = make_group(max_restarts=1)
    compute = compute_for(task, model)
    assert group.start(model, DATA_SEED)
    os.kill(group.worker_pids[0], signal.SIGKILL)
    assert group.backward(model, compute, own_batch())[1] == OWN  # first failure: a restart
    assert group.start(model)  # waits until the new generation is up
    pid = group.worker_pids[0]
    os.kill(pid, signal.SIGKILL)

    assert group.backward(model, compute, own_batch())[1] == OWN  # second failure: alone
    assert group.status()["state"] == "alone"
    assert group.worker_pids == [] and gone(pid)
    assert group.backward(model, compute, own_batch())[1] == OWN
    assert "trains on alone" in caplog.text


def test_close_leaves_no_process_behind(make_group: Callable[..., Any]) -> None:
    group, _, model = make_group(world=3)
    assert group.start(model, DATA_SEED)
    pids = group.worker_pids
    assert len(pids) == 2 and not any(gone(pid) for pid in pids)

    group.close()

    assert all(gone(pid) for pid in pids)
    assert group.status()["state"] == "closed"


def test_close_while_the_workers_start_leaves_no_process_behind(make_group: Callable[..., Any]) -> None:
    group, _, model = make_group()
    assert not group.start(model, DATA_SEED, wait=False)
    pids = group.worker_pids
    group.close()
    assert pids and all(gone(pid) for pid in pids)


def test_an_error_on_rank_0_mid_batch_kills_the_workers(make_group: Callable[..., Any]) -> None:
    group, _, model = make_group()
    assert group.start(model, DATA_SEED)
    pids = group.worker_pids

    def broken(batch: Any) -> float:
        raise FloatingPointError("the loss is nan: training diverged")

    with pytest.raises(FloatingPointError):
        group.backward(model, broken, own_batch())
    assert all(gone(pid) for pid in pids)  # they were mid-batch: nothing to wait for


# ---- a whole node ----

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32, "max_bytes": 200_000, "val_sequences": 16}
STEPS = 8


def tiny_run() -> RunConfig:
    return (
        RunConfig()
        .replace("run", id="local-group-run")
        .replace("task", name="tiny-gpt", options=TINY)
        .replace("training", batch_size=8, target_batch_size=32, warmup_steps=0, lr=1e-2, threads=1)
        .replace("eval", every_steps=0)
        .replace("checkpoint", every_steps=0)
        .replace("averaging", timeout=5.0, matchmaking_time=0.5)
        .replace("progress", interval=0.5, ttl=3.0)
    )


async def test_a_trainer_trains_with_a_local_worker(tmp_path: Any) -> None:
    config = tiny_run()
    task = load_task(config.task.name, config.task.options)
    identity = Identity.from_seed(hashlib.blake2b(b"local-group", digest_size=32).digest())
    node = Node(identity, NodeConfig(run_id=config.run.id, listen=(("127.0.0.1", 0),)))
    group = LocalGroup(config, task, ["cpu", "cpu"], timeout=10.0)
    trainer = Trainer(node, config, task, TrainerOptions(local=group, max_steps=STEPS))
    before = await trio.to_thread.run_sync(trainer.evaluate)
    try:
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                assert await trio.to_thread.run_sync(group.start, trainer.model, DATA_SEED)
                await trainer.run()
                nursery.cancel_scope.cancel()
    finally:
        group.close()
    after = await trio.to_thread.run_sync(trainer.evaluate)

    assert trainer.opt.epoch == STEPS
    assert trainer.local_samples >= STEPS * config.training.target_batch_size
    assert trainer.local_samples % (2 * config.training.batch_size) == 0  # every batch had both ranks
    assert (group.restarts, group.status()["state"]) == (0, "closed")
    assert group.params_sent == STEPS  # at the start, then after each step but the last (it stops)
    assert after < before - 0.5, (before, after)
