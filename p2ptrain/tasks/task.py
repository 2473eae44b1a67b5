"""The :class:`Task` interface: what p2ptrain needs to train a model (a model factory, a stream of
training batches, a loss, and optionally a validation set), and the defaults for its optional parts.

Its own module, apart from :mod:`p2ptrain.tasks`, so that the built-in tasks (:mod:`p2ptrain.tasks.text`)
build a Task without importing the package that lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError

Batch = Any  # whatever the task's iterators yield; usually a tuple of tensors
InitialValue = tuple[str, Callable[[torch.Tensor], object]]
"""A parameter's name and what writes its initial values into a tensor of its shape."""


def default_samples(batch: Batch) -> int:
    """How many samples a batch holds: the length of its first element (tuple, list, dict), else its own."""
    if isinstance(batch, tuple | list):
        return len(batch[0])
    if isinstance(batch, Mapping):
        return len(next(iter(batch.values())))
    return len(batch)


def default_to_device(batch: Batch, device: torch.device) -> Batch:
    """Move every tensor of a tuple, list or dict (or a lone tensor) to ``device``; leave the rest."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(default_to_device(item, device) for item in batch)
    if isinstance(batch, Mapping):
        return {key: default_to_device(value, device) for key, value in batch.items()}
    return batch


@dataclass(frozen=True)
class Task:
    """What p2ptrain needs to train a model. Build one in a function and pass ``module:function``.

    Every peer of a run builds the same task, seeds torch with the run's seed and calls ``model()``, so
    all peers start from identical weights; each then draws its own batches.

    Attributes:
        name: Shown to users and in logs.
        model: ``model()`` returns a fresh model. The caller runs ``torch.manual_seed(run_seed)`` first,
            so every peer builds identical initial weights: draw every random initial value from torch's
            default generator.
        batches: ``batches(seed, batch_size)`` returns an endless iterator of training batches for one
            peer; different seeds must draw different data (each peer gets its own seed).
        loss: ``loss(model, batch)`` returns the mean loss of the model on a batch, a scalar tensor with
            grad.
        validation: ``validation(batch_size)`` returns held-out batches, exactly the same on every peer
            and every call (return a list, not a one-shot generator); None when there is no validation.
        samples: ``samples(batch)`` says how many samples a batch holds; it weights each peer's share of
            the average.
        to_device: ``to_device(batch, device)`` returns the batch with its tensors on ``device``.
        info: Free-form facts shown to users (parameter count, corpus size, data fingerprint, ...).
        initial_values: Optional: ``initial_values(model)`` yields the model's initialization tensor by
            tensor, in the order ``model()`` draws it from torch's default generator: (parameter name,
            fill), every parameter named once (a tied one under the name ``named_parameters`` gives
            it), each ``fill(tensor)`` writing that parameter's initial values into a tensor of its
            shape. Calling them in order after ``torch.manual_seed(run_seed)`` must give exactly
            ``model()``'s weights. With it, a site that shards the model builds it on the meta device
            and fills its shards one parameter at a time, so no rank ever holds the whole model;
            without it every rank builds the model whole once. The built-in GPT's
            (``GPT.initial_values``) is an example.

    Raises:
        p2ptrain.errors.ConfigError: When the task is built with an empty name or a field that is not
            callable, so that a bad task fails where it is built, not at a remote peer's first step.
    """

    name: str
    model: Callable[[], torch.nn.Module]
    batches: Callable[[int, int], Iterator[Batch]]
    loss: Callable[[torch.nn.Module, Batch], torch.Tensor]
    validation: Callable[[int], Iterable[Batch]] | None = None
    samples: Callable[[Batch], int] = default_samples
    to_device: Callable[[Batch, torch.device], Batch] = default_to_device
    info: Mapping[str, str | int | float] = field(default_factory=dict)
    initial_values: Callable[[torch.nn.Module], Iterable[InitialValue]] | None = None

    def __post_init__(self) -> None:
        # Fail where the task is built, not at the first training step on some remote host.
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Task.name must be a non-empty string, not {self.name!r}")
        for attr in ("model", "batches", "loss", "samples", "to_device"):
            if not callable(getattr(self, attr)):
                raise ConfigError(f"Task.{attr} of task {self.name!r} must be callable")
        if self.validation is not None and not callable(self.validation):
            raise ConfigError(f"Task.validation of task {self.name!r} must be callable or None")
        if self.initial_values is not None and not callable(self.initial_values):
            raise ConfigError(f"Task.initial_values of task {self.name!r} must be callable or None")
