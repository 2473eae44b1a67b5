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
from typing import Any, TypeVar

from .averaging.compression import Compression, parse_compression
from .averaging.protocol import MAX_GROUP, sparse_problem
from .averaging.robust import Aggregation, parse_aggregation
from .errors import ConfigError
from .idwork import MAX_WORK_BITS
from .net.address import PeerAddress
from .net.handshake import MAX_RUN_ID
from .nodebase import parse_announce, parse_join_address, parse_listen
from .pipeline.settings import PipelineSection

MODES = ("sync", "diloco")
OUTER_STATES = ("auto", "memory", "file")
TRACKERS = ("", "tensorboard", "mlflow")
S = TypeVar("S")


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
    # A training run's group holds every peer on the step up to this (one group a step: its majority
    # must fit, or two groups of a step could both commit: past 2x this, see the docs' swarms at scale).
    # At most MAX_GROUP (256); 64 by default (measured at 64 simulated peers: a cap of 256 stalled one
    # run of two, 64 stalled none)
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
        _check(
            2 <= self.max_group_size <= MAX_GROUP,
            "averaging.max_group_size",
            f"must be between 2 and {MAX_GROUP}",
        )
        # parsed here, once: everything inside takes the typed values
        try:
            object.__setattr__(self, "compression", parse_compression(self.compression))
        except ValueError as e:
            raise ConfigError(f"averaging.compression: {e}") from None
        try:
            object.__setattr__(self, "aggregation", parse_aggregation(self.aggregation))
        except ValueError as e:
            raise ConfigError(f"averaging.aggregation: {e}") from None


# the most keys a run's progress records spread over (a reader keeps the last read of each: see
# ``dht.known``); 64 keys of 64 to 1,600 records each hold 4,096 to 102,400 peers
MAX_BUCKETS = 64


@dataclass(frozen=True)
class ProgressSection:
    # seconds between reads of the swarm's records near the target (up to ttl / 2 while it is far off);
    # a record goes out when something changed that others cannot extrapolate, and every ttl / 2
    interval: float = 1.0
    ttl: float = 10.0  # seconds a record stays valid: a silent peer stops counting after this
    # DHT keys the records are spread over, a power of 2 that every peer of the run shares (one: the
    # run's one progress key); each peer publishes under its bucket's, and reads them all, so that no
    # key's replicas serve every record (about one key per 64 peers the run expects). Each step's
    # matchmaking announcements and the run's ban records are spread the same way (``dht.spread``)
    buckets: int = 1
    # regions a step's swarm splits into, a power of 2 below ``buckets`` (1: one group a step, as before):
    # each region's peers form their own group, held to a majority of the region's peers on the step,
    # and a round averages its members' states along with their gradients, so that the regions, paired
    # anew each step, hold one state after a turn of steps (sync mode; see the docs' swarms at scale)
    regions: int = 1

    def __post_init__(self) -> None:
        _check(self.interval > 0, "progress.interval", "must be positive")
        _check(self.ttl > self.interval, "progress.ttl", "must be longer than progress.interval")
        _check(
            1 <= self.buckets <= MAX_BUCKETS and self.buckets & (self.buckets - 1) == 0,
            "progress.buckets",
            f"must be a power of 2 from 1 to {MAX_BUCKETS}",
        )
        _check(
            1 <= self.regions <= self.buckets and self.regions & (self.regions - 1) == 0,
            "progress.regions",
            f"must be a power of 2 from 1 to progress.buckets ({self.buckets})",
        )
        _check(
            self.regions == 1 or self.regions < self.buckets,
            "progress.regions",
            "must be fewer than progress.buckets: a region pairs at least two buckets each step, or"
            " the regions never mix",
        )


@dataclass(frozen=True)
class StateSyncSection:
    chunk_timeout: float = 30.0  # seconds a donor may go without delivering a chunk before it is dropped
    max_donors: int = 4  # donors a joiner downloads from at once
    serve: bool = True  # serve this peer's state to joiners
    # steps whose committed results each peer keeps and serves: a peer this many steps behind replays
    # them instead of downloading the state (0: always download)
    replay_steps: int = 4

    def __post_init__(self) -> None:
        _check(self.chunk_timeout > 0, "statesync.chunk_timeout", "must be positive")
        _check(1 <= self.max_donors <= 16, "statesync.max_donors", "must be between 1 and 16")
        _check(0 <= self.replay_steps <= 64, "statesync.replay_steps", "must be between 0 and 64")


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
class NodeSection:
    """What this host's node is started with: the ``p2ptrain node`` flags a host would otherwise type on
    every start (where it listens, whom it joins, its data folder, its metrics port, its devices).

    One rule says which value a node takes, for every key: **a flag given on the command line, else this
    section's value in the run file, else the default below.** A repeatable flag (``--listen``,
    ``--join``) that is given replaces the section's whole list; ``--no-relay`` sets ``relay = false``.
    The rule is :func:`with_flags` (``RunConfig.with_flags("node", ...)``), and nothing else applies it.
    Paths are read as the flags' are: relative to the folder the node is started in.

    The section is about one host, not the run: peers of one run may each hold their own, or none.
    It is not part of the run's fingerprint (``training.optimizer.bookkeeping.run_fingerprint``), and
    the run's id and authority stay in ``[run]`` (``--run-id`` and ``--authority`` override those).
    """

    # HOST:PORT addresses to listen on (port 0: any free one)
    listen: tuple[tuple[str, int], ...] = (("0.0.0.0", 31337),)
    # "HOST[:PORT]" to put in the join address (behind NAT, in containers, behind a relay)
    announce: tuple[str, int | None] | None = None
    source_address: str = ""  # outgoing connections leave from this local address; "": the system's choice
    join: tuple[PeerAddress, ...] = ()  # peers' full addresses, /ip4/HOST/tcp/PORT/p2p/PEER_ID
    relay: bool = True  # relay for peers behind NATs (with limits on circuits and bytes)
    identity: Path | None = None  # key file; none: the one kept in the data directory
    data_dir: Path | None = None  # none: $XDG_DATA_HOME/p2ptrain (unless an identity file is given)
    status_file: Path | None = None  # JSON status, rewritten every second
    metrics_port: int | None = None  # the live page, Prometheus /metrics and /healthz over HTTP here
    certificate: Path | None = None  # this node's membership certificate (a private run)
    device: str = "cpu"  # cpu, cuda, cuda:N
    devices: tuple[str, ...] = ()  # one device per local worker, this one first; (): from device
    local_workers: int = 0  # more data-parallel workers on this host (its other GPUs, CPU processes)
    local_timeout: float = 30.0  # seconds a local collective may take
    shard: int = 1  # ranks of this host's sharded site (FSDP2; docs/sharded-sites.md); 1: not a site
    wait_peers: int = 1  # start training once this many peers are in the run
    metrics_file: Path | None = None  # one JSON line of metrics per global step
    tracker: str = ""  # also log the metrics to tensorboard or mlflow

    def __post_init__(self) -> None:
        # parsed here, once (from the run file's text; a flag's value comes parsed already)
        listen = tuple(_parsed(parse_listen, x, "node.listen") for x in self.listen)
        _check(bool(listen), "node.listen", "must name at least one HOST:PORT")
        object.__setattr__(self, "listen", listen)
        if isinstance(self.announce, str):
            object.__setattr__(self, "announce", _parsed(parse_announce, self.announce, "node.announce"))
        join = tuple(_parsed(parse_join_address, x, "node.join") for x in self.join)
        object.__setattr__(self, "join", join)
        for key in ("identity", "data_dir", "status_file", "certificate", "metrics_file"):
            value = getattr(self, key)
            if value is not None:
                _check(bool(str(value).strip()), f"node.{key}", "must not be empty")
                object.__setattr__(self, key, Path(value))
        port = self.metrics_port
        _check(port is None or 0 <= port < 65536, "node.metrics_port", "must be between 0 and 65535")
        _check(bool(self.device.strip()), "node.device", "must not be empty")
        _check(all(d.strip() for d in self.devices), "node.devices", "must not hold an empty name")
        _check(self.local_workers >= 0, "node.local_workers", "must not be negative")
        _check(self.shard >= 1, "node.shard", "must be at least 1")
        ok = self.shard == 1 or not self.local_workers
        _check(ok, "node.shard", "and node.local_workers exclude each other (a site's ranks are its workers)")
        ok = math.isfinite(self.local_timeout) and self.local_timeout > 0
        _check(ok, "node.local_timeout", "must be positive")
        _check(self.wait_peers >= 1, "node.wait_peers", "must be at least 1")
        trackers = ", ".join(t for t in TRACKERS if t)
        _check(self.tracker in TRACKERS, "node.tracker", f"must be one of {trackers} (or empty)")


def _parsed(parse: Any, value: Any, key: str) -> Any:
    """``parse(value)`` for the run file's text; a value already parsed (a flag's) as it is."""
    if not isinstance(value, str):
        return value
    try:
        return parse(value)
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"{key}: {e}") from None


@dataclass(frozen=True)
class RunConfig:
    """A whole run file, parsed once into typed frozen settings.

    Every peer of a run uses the same run file (except ``[node]``, this host's own settings). Build one
    with [`load_config`][p2ptrain.config.load_config]; ``RunConfig()`` is the built-in default, the
    same as ``configs/tiny-gpt.toml``. The keys are described in that file and on the run files page.

    Attributes:
        run: ``[run]``: the run id, the seed of the initial weights, a private run's authority, and the
            bits of proof of work every peer id must carry.
        task: ``[task]``: the task's name (built-in or ``module:callable``) and its options.
        training: ``[training]``: the mode (``sync`` or ``diloco``), batch sizes, learning rate and its
            warm-up, gradient clipping.
        diloco: ``[diloco]``: the outer step, overlap, streaming fragments, where the outer state lives.
        averaging: ``[averaging]``: timeouts, matchmaking, compression and aggregation (typed values:
            ``Compression``, ``Aggregation``), audits, bandwidth.
        progress: ``[progress]``: how progress records are published and read.
        statesync: ``[statesync]``: how a joiner downloads the swarm's state.
        checkpoint: ``[checkpoint]``: how often checkpoints are written and how many are kept.
        eval: ``[eval]``: how often the validation loss is measured.
        pipeline: ``[pipeline]``: the model split into stages served by different peers (empty
            ``stages``: no pipeline; see the pipelines page).
        node: ``[node]``: this host's settings, not the run's.

    Raises:
        p2ptrain.errors.ConfigError: A combination that cannot work: top-k compression or streaming
            fragments outside DiLoCo mode, top-k with a robust rule or audits, or top-k in an open
            swarm (no ``run.authority``).
    """

    run: RunSection = field(default_factory=RunSection)
    task: TaskSection = field(default_factory=TaskSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    diloco: DilocoSection = field(default_factory=DilocoSection)
    averaging: AveragingSection = field(default_factory=AveragingSection)
    progress: ProgressSection = field(default_factory=ProgressSection)
    statesync: StateSyncSection = field(default_factory=StateSyncSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    node: NodeSection = field(default_factory=NodeSection)  # this host's, not the run's (see its rule)

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
        if self.progress.regions > 1 and self.training.mode != "sync":
            raise ConfigError(
                "progress.regions > 1 averages each round's states along with its gradients: it needs"
                " training.mode = 'sync' for now (DiLoCo's global state and outer momentum are not"
                " averaged across regions)"
            )
        problem = sparse_problem(mode, self.averaging.aggregation, self.averaging.audit)
        if problem:
            raise ConfigError(f"averaging: {problem}")
        if mode.sparse and not self.run.authority.strip():
            raise ConfigError(
                f"averaging.compression = {mode.value!r} is for private swarms, and run.authority is empty"
                " (an open swarm): top-k rounds cannot be audited and take no robust rule, so any stranger"
                " that reduces a partition could serve wrong sums round after round unseen. Set"
                " run.authority to your swarm authority's public key (`p2ptrain authority init`; members"
                " need its certificates), or, in an open swarm, use a dense compression (int8) with"
                " averaging.audit = true"
            )

    def replace(self, section: str, **changes: Any) -> RunConfig:
        """A copy with some keys of one section changed, validated like the file's.

        Args:
            section: The section's name (``training``, ``averaging``, ...).
            **changes: The keys to change and their new values.

        Returns:
            The new settings; this object is unchanged.

        Raises:
            p2ptrain.errors.ConfigError: An unknown section or key, or a value the file would refuse.
        """
        names = [f.name for f in dataclasses.fields(self)]
        if section not in names:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(names)}")
        current = getattr(self, section)
        merged = {f.name: getattr(current, f.name) for f in dataclasses.fields(current)} | changes
        return dataclasses.replace(self, **{section: _section(type(current), merged, section)})

    def with_flags(self, section: str, **flags: Any) -> RunConfig:
        """A copy with the command line's flags applied to one section.

        The one rule for the command line over a run file: a flag given (not None) wins, else the
        section's value; the result is validated like the file's.

        Args:
            section: The section's name.
            **flags: The flags' values, None for a flag left out.

        Returns:
            The new settings; this object is unchanged.

        Raises:
            p2ptrain.errors.ConfigError: An unknown section or key, or a value the file would refuse.
        """
        names = [f.name for f in dataclasses.fields(self)]
        if section not in names:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(names)}")
        return dataclasses.replace(self, **{section: with_flags(getattr(self, section), **flags)})


def with_flags(section: S, **flags: Any) -> S:
    """The one rule for the command line over a run file: a flag given wins, else the section's value
    (the run file's, else its default). A flag is given when its value is not None (argparse's value
    for a flag left out); the result is validated like the file's. ``section`` is one section's value,
    e.g. ``with_flags(NodeSection(), listen=...)`` for a node started without a run file."""
    given = {key: value for key, value in flags.items() if value is not None}
    if not given:
        return section
    current = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    names = {_type(f): f.name for f in dataclasses.fields(RunConfig)}
    return typing.cast(S, _section(type(section), current | given, names.get(type(section), "?")))


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {what}")


def load_config(path: str | Path, flags: Mapping[str, Mapping[str, Any]] | None = None) -> RunConfig:
    """Read and validate a run file.

    Args:
        path: The TOML run file (UTF-8).
        flags: Command-line values that take the place of the file's before it is validated, by section
            and key (None: a flag left out), for the combinations a flag completes: ``--authority`` makes
            a top-k run, which an open swarm refuses, a private one.

    Returns:
        The run's settings, every value typed and checked.

    Raises:
        p2ptrain.errors.ConfigError: The file cannot be read or is not valid TOML, or a section, key or
            value is unknown, of the wrong type or out of range; the message names ``section.key`` and
            what was expected, so a typo never silently falls back to a default.
    """
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
    for name, given in (flags or {}).items():
        given = {key: value for key, value in given.items() if value is not None}
        if given:
            table = data.get(name, {})
            data[name] = {**table, **given} if isinstance(table, Mapping) else table
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
    if origin is types.UnionType:  # X | None: a key the file leaves out is None (TOML has no null)
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        if len(options) == 1:
            return _coerce(value, options[0], key)
        raise ConfigError(f"{key}: unsupported setting type")  # pragma: no cover (a new field's type)
    if origin is tuple and typing.get_args(hint)[1:] == (Ellipsis,):  # an array of one kind of value
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be an array, not {value!r}")
        return tuple(_coerce(v, typing.get_args(hint)[0], key) for v in value)
    if origin is tuple or hint is PeerAddress:
        # a value written as text (HOST:PORT, an address): parsed by its section's __post_init__
        if not isinstance(value, str | tuple | PeerAddress):
            raise ConfigError(f"{key} must be a string, not {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{key} must be a string (a path), not {value!r}")
        return value
    if origin is not None and issubclass(origin, Mapping):
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
