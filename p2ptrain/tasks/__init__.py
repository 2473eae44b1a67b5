"""Tasks: what p2ptrain trains. The :class:`Task` interface users implement, and the built-in tasks.

A task bundles a model factory, a training-data stream, a loss, and optionally a validation set. Every
peer of a run loads the same task (``load_task(spec, options)``), seeds torch with the run's seed and
builds the model, so all peers start from identical weights; each then draws its own training batches
(``batches(seed, batch_size)`` with a per-peer seed) and contributes gradients to the shared model.

Built-in: ``tiny-gpt`` (alias ``gpt``), a byte-level GPT on the Python standard library's sources (see
:mod:`p2ptrain.tasks.text`). Your own: ``module:callable``, a function returning a :class:`Task`, called
with the run's task options as keyword arguments; the module may sit in the current directory.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ..errors import ConfigError
from .gpt import GPT, GPTConfig
from .task import Batch, Task, default_samples, default_to_device
from .text import gpt_task

__all__ = [
    "BUILTIN_TASKS",
    "GPT",
    "Batch",
    "GPTConfig",
    "Task",
    "default_samples",
    "default_to_device",
    "gpt_task",
    "load_task",
]

log = logging.getLogger(__name__)

#: The tasks that need no module of their own, by name.
BUILTIN_TASKS: Mapping[str, Callable[..., Task]] = {"tiny-gpt": gpt_task, "gpt": gpt_task}


def load_task(spec: str, options: Mapping[str, Any] | None = None) -> Task:
    """Build the task named by ``spec`` with ``options`` as keyword arguments.

    A module not found on ``sys.path`` is looked for in the current directory, which then stays on
    ``sys.path`` so the module's own lazy imports of its neighbours work.

    Args:
        spec: A built-in name (``tiny-gpt``, alias ``gpt``) or ``module:callable`` (the module may be
            dotted, ``package.module:callable``; the callable may be dotted too,
            ``module:Class.factory``).
        options: Keyword arguments for the task's function (the run file's ``[task.options]``).

    Returns:
        The task the function built.

    Raises:
        p2ptrain.errors.ConfigError: With one line saying what is wrong: an unknown or malformed spec, a
            module that cannot be imported, an option the function does not take, a function that
            failed or returned something other than a [`Task`][p2ptrain.tasks.Task].
    """
    options = dict(options or {})
    spec = spec.strip()
    if spec in BUILTIN_TASKS:
        return _build(spec, BUILTIN_TASKS[spec], options, builtin=True)
    if ":" not in spec:
        known = ", ".join(BUILTIN_TASKS)
        raise ConfigError(f"unknown task {spec!r}: give a built-in task ({known}) or module:callable")
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise ConfigError(f"malformed task {spec!r}: expected module:callable, e.g. mytask:make_task")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        raise ConfigError(f"malformed task {spec!r}: give a module name (mytask:make_task), not a file path")
    target: object = _import(module_name)
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"task module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise ConfigError(f"task {spec!r} is a {type(target).__name__}, not a callable returning a Task")
    return _build(spec, target, options, builtin=False)


def _import(module_name: str) -> ModuleType:
    try:
        return _import_once(module_name)
    except ImportError as exc:
        if not _worth_retry_from_cwd(module_name, exc):
            raise _import_error(module_name, exc) from exc
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    try:
        module = _import_once(module_name)
    except ImportError as exc:
        sys.path.remove(cwd)
        raise _import_error(module_name, exc) from exc
    except ConfigError:
        sys.path.remove(cwd)
        raise
    log.info("imported task module %s from the current directory %s", module_name, cwd)
    return module


def _worth_retry_from_cwd(module_name: str, exc: ImportError) -> bool:
    # Only a miss of the module itself (or of a parent package) is worth a retry from the cwd: a module
    # that was found but failed on one of its own imports would fail the same way again, after running
    # its top-level code a second time.
    missing = (exc.name or "") if isinstance(exc, ModuleNotFoundError) else ""
    if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
        return False
    cwd = os.getcwd()
    return not any(p in ("", ".", cwd) for p in sys.path)


def _import_once(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError:
        raise
    except Exception as exc:  # the module's own code failed (SyntaxError, a raise at import time, ...)
        raise ConfigError(
            f"importing task module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _import_error(module_name: str, exc: ImportError) -> ConfigError:
    return ConfigError(f"cannot import task module {module_name!r}: {exc}")


def _build(spec: str, factory: Callable[..., object], options: dict[str, Any], *, builtin: bool) -> Task:
    accepted = _accepted_options(factory)
    if accepted is not None:
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            listed = ", ".join(accepted) or "none"
            raise ConfigError(f"task {spec!r} has no option {unknown[0]!r} (accepted: {listed})")
    try:
        task = factory(**options)
    except ConfigError as exc:
        if builtin:  # its messages already name the task and the option
            raise
        raise ConfigError(f"task {spec!r}: {exc}") from exc
    except TypeError as exc:  # e.g. an option its **kwargs passed on to something that refused it
        raise ConfigError(f"task {spec!r} refused its options: {exc}") from exc
    except Exception as exc:  # the user's factory failed; say so in one line, chained for the traceback
        raise ConfigError(f"task {spec!r} failed to build: {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise ConfigError(f"task {spec!r} returned a {type(task).__name__}, not a p2ptrain.tasks.Task")
    return task


def _accepted_options(factory: Callable[..., object]) -> list[str] | None:
    """The keyword arguments ``factory`` takes, or None when it takes any (``**kwargs``) or is opaque."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in keyword]
