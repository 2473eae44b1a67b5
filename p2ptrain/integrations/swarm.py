"""A swarm node for a training script, and a torch optimizer that steps with the swarm.

Theory of operation. A training loop of another library (a ``transformers.Trainer``, Lightning, a loop
of the user's) owns the model, the data and the calls to ``optimizer.step()`` and ``zero_grad()``. The
swarm's :class:`~p2ptrain.CollaborativeOptimizer` wants to be told after each backward pass how many
samples it covered, and decides itself when the wrapped optimizer steps: when the swarm's target batch
is reached and the group's averaged gradients (or DiLoCo's outer step) are in. :class:`SwarmOptimizer`
sits between the two: it *is* a ``torch.optim.Optimizer`` to the loop (the wrapped optimizer's
parameter groups and state, so schedulers, checkpoints and ``isinstance`` checks keep working), and its
``step()`` reports the samples to the swarm. Its ``zero_grad()`` does nothing: the swarm already took
the gradients (sync mode moves them into its accumulator and clears ``.grad``; DiLoCo's inner step
clears them).

The learning rate and its warm-up are the run file's (``[training] lr``, ``warmup_steps``): every peer
of a run must step alike, so a loop's own scheduler is replaced by :class:`HeldLR`, which changes
nothing. The number of samples a ``step()`` covers is counted by the caller (:meth:`SwarmOptimizer.add`)
or, when nobody counted, the ``samples_per_step`` given at construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..identity import Identity, load_identity, save_identity
from ..net.address import PeerAddress
from ..node import BackgroundNode, NodeConfig, averaging_settings, id_work
from ..nodebase import lock_data_dir, parse_listen
from ..training.optimizer import SyncCollaborativeOptimizer


def join_swarm(
    run: RunConfig,
    *,
    listen: str = "0.0.0.0:31337",
    join: Sequence[str] = (),
    data_dir: str | Path | None = None,
    timeout: float = 60.0,
) -> BackgroundNode:
    """Start a node of ``run`` in a thread of its own and return it once it listens.

    Stop it with ``close()``, or use it as a context manager:

    ```python
    with join_swarm(run, listen="0.0.0.0:31337", join=[address]) as node:
        ...
    ```

    Args:
        run: The run file's settings (the same on every peer of the run): its run id, averaging
            settings and identity work are the node's.
        listen: ``HOST:PORT`` to listen on (port 0: any free one).
        join: Addresses of peers already in the swarm, as ``p2ptrain node`` prints them; empty for the
            swarm's first peer.
        data_dir: Where the node keeps its identity and remembered peers, held until the node is closed
            (one node per folder). Without one, a fresh identity each time.
        timeout: Seconds to wait for the node to listen.

    Returns:
        The started node (a ``BackgroundNode``), listening and bootstrapping towards ``join``.

    Raises:
        p2ptrain.errors.ConfigError: The data directory is held by another node, or a setting is invalid.
        p2ptrain.errors.IdentityError: The key file in ``data_dir`` is malformed or readable by others.
        TimeoutError: The node did not listen within ``timeout`` seconds.
    """
    folder = None
    release: Callable[[], None] = lambda: None  # noqa: E731
    if data_dir is not None:
        folder = Path(data_dir)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        release = lock_data_dir(folder)
    try:
        return _start(run, folder, listen, join, timeout, release)
    except BaseException:
        release()  # (a node that did not start holds nothing)
        raise


def _start(
    run: RunConfig,
    folder: Path | None,
    listen: str,
    join: Sequence[str],
    timeout: float,
    release: Callable[[], None],
) -> BackgroundNode:
    identity, peer_cache = Identity.generate(), None
    if folder is not None:
        key = folder / "identity.key"
        if key.exists():
            identity = load_identity(key)
        else:
            save_identity(identity, key)
        peer_cache = folder / "peers.json"
    config = NodeConfig(
        run_id=run.run.id,
        listen=(parse_listen(listen),),
        join=tuple(PeerAddress.parse(a) for a in join),
        peer_cache=peer_cache,
        averaging=averaging_settings(run),
        peer_list_buckets=run.progress.buckets,
    )
    if run.run.id_work:  # the run prices ids: ours carries the work (found once, kept with the key)
        work = id_work(identity, run.run.id_work, folder)
        config = dataclasses.replace(
            config, host=dataclasses.replace(config.host, id_work=run.run.id_work, work=work)
        )
    node = BackgroundNode(identity, config)
    node.after_close(release)  # the folder is free again once the node has stopped
    try:
        return node.start(timeout)
    except BaseException:
        node.close()
        raise


class SwarmOptimizer(torch.optim.Optimizer):
    """``optimizer`` trained by the swarm that ``node`` belongs to, for loops that call ``step()``.

    To the loop it *is* a ``torch.optim.Optimizer`` (the wrapped optimizer's parameter groups and state,
    so schedulers, checkpoints and ``isinstance`` checks keep working); its ``step()`` hands the batch's
    gradients to the swarm, and the wrapped optimizer steps when the swarm does:

    ```python
    node = join_swarm(run, listen="0.0.0.0:31337", join=[address])
    opt = SwarmOptimizer(node, model, torch.optim.AdamW(model.parameters()), run, samples_per_step=32)
    ...                                   # the loop's own: loss.backward(); opt.step(); opt.zero_grad()
    ```

    The learning rate and its warm-up are the run file's (``[training] lr``, ``warmup_steps``).

    Args:
        node: The node of the swarm (see [`join_swarm`][p2ptrain.integrations.join_swarm]).
        model: The model whose gradients the swarm averages.
        optimizer: The optimizer to wrap; build it with every parameter (no group can be added later).
        run: The run file's settings, the same on every peer.
        samples_per_step: The samples one ``step()`` covers (the batch size times the gradient
            accumulation steps) unless [`add`][p2ptrain.integrations.SwarmOptimizer.add] counted them.
    """

    def __init__(
        self,
        node: BackgroundNode,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        run: RunConfig,
        *,
        samples_per_step: int | None = None,
    ) -> None:
        # Not Optimizer.__init__: the parameters, their groups and state stay the wrapped optimizer's
        # (read through, see below: its load_state_dict replaces them).
        self.optimizer = optimizer
        self.samples_per_step = samples_per_step
        t = run.training  # the run's rate from the start (the swarm sets it again at every step)
        for group in optimizer.param_groups:
            group["lr"] = t.lr / t.warmup_steps if t.warmup_steps else t.lr
        self._counted = 0
        self.swarm = SyncCollaborativeOptimizer(node, model, optimizer, run)
        self.stepped = False  # whether the last step() took a global step (or synced the state)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def wait_for_peers(self, count: int, timeout: float = 600.0) -> int:
        """Block until ``count`` peers (this one included) train in the swarm, or ``timeout`` seconds.

        A swarm that starts together then begins together.

        Args:
            count: Peers to wait for, this one included.
            timeout: Seconds to wait at most.

        Returns:
            How many peers train in the swarm now.
        """
        return self.swarm.wait_for_peers(count, timeout)

    def add(self, samples: int) -> None:
        """Count ``samples`` toward the next ``step()`` (a loop's callback, once per batch).

        Args:
            samples: The samples the batch just computed covered.
        """
        self._counted += samples

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Hand the gradients of the samples counted since the last call to the swarm.

        The wrapped optimizer steps (with the swarm's averaged gradients, or DiLoCo's outer step) when
        the swarm has done its target batch; ``stepped`` then says so.

        Args:
            closure: Recomputes the loss, as for any torch optimizer.

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: No samples were counted with ``add()`` and no ``samples_per_step`` was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        samples = self._counted or self.samples_per_step
        if not samples:
            raise RuntimeError("SwarmOptimizer.step: no samples counted (add()) and no samples_per_step")
        self._counted = 0
        self.stepped = self.swarm.step(int(samples))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the swarm took the gradients in ``step()``.

        Args:
            set_to_none: Ignored; kept for the ``torch.optim.Optimizer`` interface.
        """

    @property
    def epoch(self) -> int:
        """The swarm's global step."""
        return self.swarm.epoch

    @property
    def stats(self) -> Any:
        """The optimizer's statistics: its last round (``stats.last``) and counters."""
        return self.swarm.stats

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("the swarm averages a fixed set of parameters: build the optimizer with all")

    def __repr__(self) -> str:
        return f"SwarmOptimizer({self.optimizer.__class__.__name__}, step {self.epoch})"


class HeldLR(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler that leaves the learning rate where the swarm put it (the run file's schedule)."""

    def get_lr(self) -> list[float | torch.Tensor]:
        return [group["lr"] for group in self.optimizer.param_groups]
