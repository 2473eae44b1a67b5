"""Run configuration: a TOML file read into frozen dataclasses, validated with messages that name the key.

A run file has one table per section below; every key is optional and defaults to the value shown in
the dataclass. Unknown sections or keys, values of the wrong type and values out of range are refused
with a :class:`~p2ptrain.errors.ConfigError` that names ``section.key`` and what was expected, so a typo
never silently falls back to a default. ``configs/tiny-gpt.toml`` is the documented example.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .averaging.compression import Compression, parse_compression
from .averaging.protocol import sparse_problem
from .averaging.robust import Aggregation, parse_aggregation
from .errors import ConfigError
from .idwork import MAX_WORK_BITS
from .net.handshake import MAX_RUN_ID

MODES = ("sync", "diloco")
OUTER_STATES = ("auto", "memory", "file")


@dataclass(frozen=True)
class RunSection:
    id: str = "tiny-gpt"  # peers only talk within the same run id
    seed: int = 0  # seeds the initial weights: every peer starts from the same ones
    authority: str = ""  # a private swarm: its authority's public key (p2ptrain authority init); "": open
    id_work: int = 0  # bits of proof of work every peer id must carry (see p2ptrain.idwork); 0: ids are free

    def __post_init__(self) -> None:
        ok = 0 < len(self.id) <= MAX_RUN_ID and self.id.isprintable()
        _check(ok, "run.id", f"must be 1-{MAX_RUN_ID} printable characters")
        _check(0 <= self.id_work <= MAX_WORK_BITS, "run.id_work", f"must be between 0 and {MAX_WORK_BITS}")


@dataclass(frozen=True)
class TaskSection:
    name: str = "tiny-gpt"  # the built-in task, or "module:callable" returning a Task
    options: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments of the task factory

    def __post_init__(self) -> None:
        _check(bool(self.name.strip()), "task.name", "must not be empty")


@dataclass(frozen=True)
class TrainingSection:
    mode: str = "sync"  # "sync": average gradients every global step; "diloco": pseudo-gradients
    batch_size: int = 16  # samples per forward/backward on this peer
    target_batch_size: int = 256  # samples the whole swarm processes per global step
    lr: float = 1e-3  # the (inner) optimizer's learning rate
    weight_decay: float = 0.01
    warmup_steps: int = 10  # linear learning-rate warm-up, in global steps
    grad_clip: float = 1.0  # clip the averaged gradient's norm (sync) or each inner step's; 0: off
    max_steps: int = 0  # stop after this many global steps; 0: run until stopped
    threads: int = 0  # torch threads for compute; 0: torch's default

    def __post_init__(self) -> None:
        _check(self.mode in MODES, "training.mode", f"must be one of {', '.join(MODES)}")
        _check(self.batch_size >= 1, "training.batch_size", "must be at least 1")
        _check(self.target_batch_size >= 1, "training.target_batch_size", "must be at least 1")
        _check(math.isfinite(self.lr) and self.lr > 0, "training.lr", "must be positive")
        _check(self.weight_decay >= 0, "training.weight_decay", "must not be negative")
        _check(self.warmup_steps >= 0, "training.warmup_steps", "must not be negative")
        _check(self.grad_clip >= 0, "training.grad_clip", "must not be negative")
        _check(self.max_steps >= 0, "training.max_steps", "must not be negative")
        _check(0 <= self.threads <= 1024, "training.threads", "must be between 0 and 1024")


@dataclass(frozen=True)
class DilocoSection:
    outer_lr: float = 0.7  # OpenDiLoCo's outer Nesterov settings
    outer_momentum: float = 0.9
    overlap: bool = False  # average round t's pseudo-gradient while computing round t+1
    # Where the global parameters and the outer momentum live: "memory"; "file": a file in TMPDIR mapped
    # into memory, held by the page cache, off the process's resident set between rounds (2x the fp32
    # parameter bytes less RAM at the peak); "auto": "file" for a large model on the CPU, else "memory"
    outer_state: str = "auto"
    # Streaming DiLoCo: the parameters in this many contiguous fragments; step t averages fragment
    # t mod F alone (1/F of the bytes per round; set target_batch_size to 1/F of a plain run's)
    fragments: int = 1

    def __post_init__(self) -> None:
        _check(
            isinstance(self.fragments, int) and 1 <= self.fragments <= 4096,
            "diloco.fragments",
            "must be an integer from 1 to 4096",
        )
        _check(math.isfinite(self.outer_lr) and self.outer_lr > 0, "diloco.outer_lr", "must be positive")
        _check(0 <= self.outer_momentum < 1, "diloco.outer_momentum", "must be in [0, 1)")
        states = ", ".join(OUTER_STATES)
        _check(self.outer_state in OUTER_STATES, "diloco.outer_state", f"must be one of {states}")


@dataclass(frozen=True)
class AveragingSection:
    timeout: float = 30.0  # seconds one averaging round may take
    matchmaking_time: float = 3.0  # seconds a leader gathers a group
    # none, fp16, bf16, int8; diloco also topk0.5-q2 .. topk3-q4: a run file's text, parsed at load
    compression: Compression = Compression.NONE
    bandwidth: float = 0.0  # this host's MB/s, sets its share of the reduction; 0: measured in its rounds
    max_group_size: int = 64
    aggregation: Aggregation = Aggregation.MEAN  # or robust to hostile peers: trimmed_mean, centered_clip
    audit: bool = False  # commitments, attestations and an auditor per partition; offenders banned

    def __post_init__(self) -> None:
        _check(self.timeout > 0, "averaging.timeout", "must be positive")
        _check(self.matchmaking_time > 0, "averaging.matchmaking_time", "must be positive")
        _check(
            math.isfinite(self.bandwidth) and self.bandwidth >= 0,
            "averaging.bandwidth",
            "must be positive, or 0 to measure it",
        )
        _check(2 <= self.max_group_size <= 64, "averaging.max_group_size", "must be between 2 and 64")
        # parsed here, once: everything inside takes the typed values
        try:
            object.__setattr__(self, "compression", parse_compression(self.compression))
        except ValueError as e:
            raise ConfigError(f"averaging.compression: {e}") from None
        try:
            object.__setattr__(self, "aggregation", parse_aggregation(self.aggregation))
        except ValueError as e:
            raise ConfigError(f"averaging.aggregation: {e}") from None


@dataclass(frozen=True)
class ProgressSection:
    # seconds between reads of the swarm's records near the target (up to ttl / 2 while it is far off);
    # a record goes out when something changed that others cannot extrapolate, and every ttl / 2
    interval: float = 1.0
    ttl: float = 10.0  # seconds a record stays valid: a silent peer stops counting after this

    def __post_init__(self) -> None:
        _check(self.interval > 0, "progress.interval", "must be positive")
        _check(self.ttl > self.interval, "progress.ttl", "must be longer than progress.interval")


@dataclass(frozen=True)
class StateSyncSection:
    chunk_timeout: float = 30.0  # seconds a donor may go without delivering a chunk before it is dropped
    max_donors: int = 4  # donors a joiner downloads from at once
    serve: bool = True  # serve this peer's state to joiners

    def __post_init__(self) -> None:
        _check(self.chunk_timeout > 0, "statesync.chunk_timeout", "must be positive")
        _check(1 <= self.max_donors <= 16, "statesync.max_donors", "must be between 1 and 16")


@dataclass(frozen=True)
class CheckpointSection:
    every_steps: int = 50  # 0: no periodic checkpoints (one is still written on a clean stop)
    keep: int = 2

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must not be negative")
        _check(self.keep >= 1, "checkpoint.keep", "must be at least 1")


@dataclass(frozen=True)
class EvalSection:
    every_steps: int = 10  # validation loss every N global steps; 0: never
    batch_size: int = 16

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, "eval.every_steps", "must not be negative")
        _check(self.batch_size >= 1, "eval.batch_size", "must be at least 1")


@dataclass(frozen=True)
class RunConfig:
    """A whole run file."""

    run: RunSection = field(default_factory=RunSection)
    task: TaskSection = field(default_factory=TaskSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    diloco: DilocoSection = field(default_factory=DilocoSection)
    averaging: AveragingSection = field(default_factory=AveragingSection)
    progress: ProgressSection = field(default_factory=ProgressSection)
    statesync: StateSyncSection = field(default_factory=StateSyncSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self) -> None:
        mode = self.averaging.compression
        if mode.sparse and self.training.mode != "diloco":
            raise ConfigError(
                f"averaging.compression = {mode.value!r} needs training.mode = 'diloco' (whose error"
                " feedback keeps what top-k leaves out); use a dense compression for 'sync'"
            )
        if self.diloco.fragments > 1 and self.training.mode != "diloco":
            raise ConfigError(
                "diloco.fragments > 1 streams DiLoCo's outer rounds: it needs training.mode = 'diloco'"
            )
        problem = sparse_problem(mode, self.averaging.aggregation, self.averaging.audit)
        if problem:
            raise ConfigError(f"averaging: {problem}")

    def replace(self, section: str, **changes: Any) -> RunConfig:
        """A copy with some keys of one section changed (validated like the file's)."""
        names = [f.name for f in dataclasses.fields(self)]
        if section not in names:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(names)}")
        current = getattr(self, section)
        merged = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)} | changes
        return dataclasses.replace(self, **{section: _section(type(current), merged, section)})


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {what}")


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a run file."""
    try:
        text = Path(path).read_bytes().decode("utf-8")  # TOML is UTF-8, whatever the locale
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"config {path}: {e}") from None


def parse_config(data: Mapping[str, Any]) -> RunConfig:
    """Build a :class:`RunConfig` from a parsed TOML document."""
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    out = {}
    for name, table in data.items():
        if name not in sections:
            raise ConfigError(f"unknown section [{name}]; known: {', '.join(sections)}")
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{name}] must be a table")
        out[name] = _section(_type(sections[name]), table, name)
    return RunConfig(**out)


def _type(f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(RunConfig)
    return typing.cast(type, hints[f.name])


log = logging.getLogger(__name__)

RETIRED = {
    "averaging.ban_quorum": "a ban is adopted when its proof checks out, whatever the number of accusers",
}
"""Settings that older run files may hold and that no longer mean anything (ignored with a warning)."""


def _section(cls: type, table: Mapping[str, Any], name: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if f"{name}.{key}" in RETIRED:
            log.warning("%s.%s is ignored: %s", name, key, RETIRED[f"{name}.{key}"])
            continue
        if key not in fields:
            raise ConfigError(f"unknown key {name}.{key}; known: {', '.join(sorted(fields))}")
        values[key] = _coerce(value, hints[key], f"{name}.{key}")
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is not None and origin not in (types.UnionType,) and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a table")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, not {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, not {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, not {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be finite")
        return float(value)
    if hint is str or (isinstance(hint, type) and issubclass(hint, str)):
        # (a typed name, an enum of str such as Compression, is parsed by its section's __post_init__)
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, not {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported setting type")  # pragma: no cover (a new field's type)
