"""Scenario files: a swarm to replay on one machine, read from TOML into frozen dataclasses (pure).

A scenario says who the peers are (how fast each computes, its access link), what they train (a run
file of ``configs/`` with overrides), what happens to them over time (kills, restarts, late joins, cuts,
partitions, link changes) and what must hold at the end (checks). ``python -m simulations run FILE``
replays it with real ``p2ptrain node`` processes (``simulations.replay.runner``). The format::

    [scenario]
    name = "churn"                 # default: the file's name
    description = "..."
    duration = 600                 # seconds from the first process's start to the stop signal
    emulation = "userspace"        # "userspace" (the WAN switch, no root), "netns" (root, tc tbf), "hosts"
                                   # (a loopback address per peer, unshaped), "none" (all on 127.0.0.1)
    run = "configs/tiny-gpt.toml"  # the run file, relative to the repository (or absolute)
    mode = "diloco"                # optional: training.mode of the run
    seed = 1                       # optional: run.seed, and the emulator's jitter and cuts
    wait_peers = 4                 # optional: the peers started at 0 s start training together
                                   #   (default: how many start at 0 s; 1: no waiting)

    [run_overrides.training]       # any section of a run file; merged key by key into the run file
    target_batch_size = 512
    [run_overrides.task.options]
    n_layer = 2

    [defaults]                     # every peer's profile unless its [[peers]] entry says otherwise
    count = 8                      # optional: the number of peers ([[peers]] entries first, then copies
                                   #   of the defaults)
    slowdown = 1.0                 # compute this many times slower than this machine (>= 1)
    up_mbit = 1000.0               # upload and download, Mbit/s ("inf" or absent: unshaped)
    down_mbit = 1000.0
    latency_ms = 1.0               # one-way latency of the access link: a path is the sum of its two ends
    jitter_ms = 0.0
    cuts_per_min = 0.0             # "loss": random connection resets per minute (see below)
    start_at = 0.0                 # seconds: a peer starting later is a late joiner

    [[peers]]                      # peer 0, 1, ... in order; "count = 3" makes three alike
    name = "us-east"
    up_mbit = 1000.0
    adversary = "scale"            # optional, [[peers]] only: a hostile peer (p2ptrain node --adversary):
                                   #   nan, scale, random, inflate, garbage-reducer; restarts keep it

    [[events]]                     # kill, restart, start, stop, cut, partition, link
    at = 60.0
    action = "kill"                # SIGKILL (restart: the same data directory, --resume)
    peer = 2
    [[events]]
    at = 70.0
    action = "partition"
    peer = 3
    seconds = 10.0                 # partition only
    [[events]]
    at = 80.0
    action = "link"                # change a link live (userspace only): any of the profile's link keys
    peer = 1
    up_mbit = 10.0

    [churn]                        # optional: a kill every ``every`` s from ``start`` to ``stop``, round
    every = 15.0                   #   robin over ``peers``, each restarted ``restart_after`` s later
    restart_after = 10.0           #   (0: never)
    start = 30.0
    stop = 580.0                   # default: duration - restart_after
    peers = [2, 3, 4, 5, 6, 7]

    [checks]                       # what the report judges (pass / fail)
    identical = true               # peers on the same global step hold the same parameters
    continues = true               # after every failure the swarm takes a global step within recovery_s
    recovery_s = 60.0
    rejoin = true                  # every (re)started peer reaches the swarm's step within catch_up_s
    catch_up_s = 90.0
    utilization_min = 0.9          # every peer's compute utilization (peers never killed)
    utilization_modes = ["diloco"] # ... judged in these modes only (otherwise reported)
    rss_growth_max = 0.2           # RSS at the end within 20% of RSS after warm-up (peers never killed)
    warmup_s = 60.0
    min_steps = 10                 # the swarm reached at least this global step
    loss_decreases = true          # the validation loss fell, and never rose by more than loss_jump_max
    loss_jump_max = 0.25           #   (relative) from one evaluation to the next
    no_crashes = true              # no process exited except by the scenario's own kills and stops
    offenders_named = false        # every adversary is accused by name in some honest peer's node.log

Hostile peers. A peer with ``adversary`` runs the honest node with one attack switched on (see
``p2ptrain.testing.adversary``): its slices NaN, multiplied by 100 or replaced by noise, its sample count
inflated a hundredfold, or the partitions it reduces garbled. The others are the *honest* peers:
``identical`` and ``loss_decreases`` are judged over them only (an adversary may hold other parameters,
or be banned and train alone), and ``offenders_named`` asks that for every adversary at least one honest
peer's log accuses it by its short peer id (``simulations.replay.report`` says which log lines count). At
least one peer must be honest. Robust aggregation and audits are run-file settings
(``[run_overrides.averaging] aggregation = "trimmed_mean"``, ``audit = true``).

Packet loss cannot be emulated over TCP without root (and this kernel has no netem): ``cuts_per_min``
stands for it, as random connection resets, the failure a lossy path ends in. In ``netns`` mode links
are shaped by ``tc tbf``, which has rates but no latency: latency, jitter and cuts are not emulated there,
and cut, partition and link events are refused. Every problem is reported as a
:class:`ScenarioError` that names the key (``peers[2].up_mbit must be positive``).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from p2ptrain.config import MODES, RunConfig, parse_config
from p2ptrain.errors import ConfigError
from p2ptrain.testing.adversary import ADVERSARIES

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS_DIR = REPO_ROOT / "simulations" / "scenarios"
EMULATIONS = ("userspace", "netns", "hosts", "none")
ACTIONS = ("kill", "restart", "start", "stop", "cut", "partition", "link")
SWITCH_ACTIONS = ("cut", "partition", "link")  # need the userspace switch
LINK_KEYS = ("up_mbit", "down_mbit", "latency_ms", "jitter_ms", "cuts_per_min")
PROFILE_KEYS = ("slowdown", *LINK_KEYS, "start_at")
MAX_PEERS = 64
MAX_DURATION = 24 * 3600.0


class ScenarioError(ConfigError):
    """A scenario file is invalid; the message names the key."""


@dataclass(frozen=True)
class PeerSpec:
    """One simulated peer: its compute speed, its access link, when it first starts (None: by an event)."""

    index: int
    name: str
    slowdown: float = 1.0
    up_mbit: float = math.inf
    down_mbit: float = math.inf
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    cuts_per_min: float = 0.0
    start_at: float | None = 0.0
    adversary: str | None = None  # an attack this peer runs (p2ptrain.testing.adversary); None: honest

    @property
    def link(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in LINK_KEYS}


@dataclass(frozen=True)
class Event:
    at: float
    action: str
    peer: int
    seconds: float = 0.0  # partition
    link: Mapping[str, float] = field(default_factory=dict)  # link: the profile keys changed
    origin: str = ""  # where it came from: "events[3]", "churn", "peers[4].start_at"

    def describe(self) -> str:
        extra = f" for {self.seconds:g} s" if self.action == "partition" else ""
        if self.action == "link":
            extra = " " + ", ".join(f"{k}={v:g}" for k, v in self.link.items())
        return f"{self.at:g} s: {self.action} peer {self.peer}{extra}"


@dataclass(frozen=True)
class Checks:
    identical: bool = True
    continues: bool = False
    recovery_s: float = 60.0
    rejoin: bool = False
    catch_up_s: float = 90.0
    utilization_min: float | None = None
    utilization_modes: tuple[str, ...] = MODES
    rss_growth_max: float | None = None
    warmup_s: float = 60.0
    min_steps: int | None = None
    loss_decreases: bool = False
    loss_jump_max: float = 0.25
    no_crashes: bool = True
    offenders_named: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    duration: float
    emulation: str
    run: str  # the run file as written in the scenario
    run_overrides: Mapping[str, Any]
    mode: str | None
    seed: int | None
    wait_peers: int
    peers: tuple[PeerSpec, ...]
    events: tuple[Event, ...]  # sorted by time, then by where they were written
    checks: Checks
    source: str = "<string>"
    dropped_events: tuple[Event, ...] = ()  # past a shortened duration
    written_duration: float | None = None  # the file's duration, when --duration changed it

    def min_steps(self) -> int | None:
        """checks.min_steps, scaled down with a shortened duration (a smoke run is judged fairly)."""
        m, written = self.checks.min_steps, self.written_duration
        if m is None or written is None or self.duration >= written:
            return m
        return math.ceil(m * self.duration / written)

    @property
    def initial_peers(self) -> list[int]:
        return [p.index for p in self.peers if p.start_at == 0]

    @property
    def adversaries(self) -> dict[int, str]:
        """Peer index -> the attack it runs (the hostile peers)."""
        return {p.index: p.adversary for p in self.peers if p.adversary}

    def run_path(self, repo_root: Path = REPO_ROOT) -> Path:
        path = Path(self.run)
        return path if path.is_absolute() else repo_root / path

    def not_emulated(self) -> list[str]:
        """What the scenario asks for that its emulation mode cannot do (said in the report)."""
        notes = []
        links = [p for p in self.peers if any(v != PeerSpec(0, "").link[k] for k, v in p.link.items())]
        if self.emulation in ("none", "hosts") and links:
            notes.append(
                f"emulation '{self.emulation}': every link is plain loopback (no rates, latency or cuts)"
            )
        if self.emulation == "netns":
            if any(p.latency_ms or p.jitter_ms for p in self.peers):
                notes.append("netns (tc tbf): latency and jitter are not emulated, only rates")
            if any(p.cuts_per_min for p in self.peers):
                notes.append("netns: cuts_per_min (loss) is not emulated")
        if self.emulation == "userspace" and any(p.cuts_per_min for p in self.peers):
            notes.append(
                "loss is emulated as random connection cuts (cuts_per_min): packet loss itself needs "
                "root and netem, which this kernel lacks"
            )
        return notes

    def with_changes(
        self,
        *,
        duration: float | None = None,
        mode: str | None = None,
        emulation: str | None = None,
        adversaries: Sequence[str | None] | None = None,
    ) -> Scenario:
        """The scenario shortened, in another mode or emulation, or with other attacks (``adversaries``:
        one kind or None per peer); validated again. Events at or past a shorter duration are dropped
        (kept in ``dropped_events``)."""
        out = self
        if adversaries is not None:
            _check(
                len(adversaries) == len(out.peers),
                "adversaries",
                f"must give one kind (or none) per peer: {len(out.peers)}, not {len(adversaries)}",
            )
            for i, kind in enumerate(adversaries):
                _check_adversary(kind, f"peers[{i}].adversary")
            _check(not all(adversaries), "adversaries", "leave no honest peer: at least one must be honest")
            pairs = zip(out.peers, adversaries, strict=True)
            out = replace(out, peers=tuple(replace(p, adversary=k or None) for p, k in pairs))
        if mode is not None:
            _check(mode in MODES, "--mode", f"must be one of {', '.join(MODES)}")
            out = replace(out, mode=mode)
        if emulation is not None:
            _check(emulation in EMULATIONS, "--emulation", f"must be one of {', '.join(EMULATIONS)}")
            _check_emulation(emulation, out.events, out.peers)
            out = replace(out, emulation=emulation)
        if duration is not None:
            _check(0 < duration <= MAX_DURATION, "--duration", f"must be in (0, {MAX_DURATION:g}] s")
            keep = tuple(e for e in out.events if e.at < duration)
            dropped = out.dropped_events + tuple(e for e in out.events if e.at >= duration)
            written = out.written_duration if out.written_duration is not None else out.duration
            out = replace(
                out, duration=float(duration), events=keep, dropped_events=dropped, written_duration=written
            )
        return out


# ---- parsing ---------------------------------------------------------------------------------------

TOP = ("scenario", "run_overrides", "defaults", "peers", "events", "churn", "checks")
SCENARIO_KEYS = ("name", "description", "duration", "emulation", "run", "mode", "seed", "wait_peers")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (the run file it names must exist and merge cleanly)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ScenarioError(f"cannot read scenario {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(f"scenario {path} is not UTF-8 text: {e.reason}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"scenario {path} is not valid TOML: {e}") from None
    try:
        scenario = parse_scenario(data, default_name=path.stem, source=str(path))
        merged_run(scenario, read_run_file(scenario.run_path()))
    except ConfigError as e:
        raise ScenarioError(f"scenario {path}: {e}") from None
    return scenario


def parse_scenario(
    data: Mapping[str, Any], *, default_name: str = "scenario", source: str = "<string>"
) -> Scenario:
    """Build a :class:`Scenario` from a parsed TOML document (no file is read)."""
    _known(data, TOP, "", "table")
    head = _table(data, "scenario", required=True)
    _known(head, SCENARIO_KEYS, "scenario.")
    duration = _number(head, "duration", "scenario.", required=True)
    _check(0 < duration <= MAX_DURATION, "scenario.duration", f"must be in (0, {MAX_DURATION:g}] seconds")
    emulation = _string(head, "emulation", "scenario.", "userspace")
    _check(emulation in EMULATIONS, "scenario.emulation", f"must be one of {', '.join(EMULATIONS)}")
    run = _string(head, "run", "scenario.", "configs/tiny-gpt.toml")
    _check(run.endswith(".toml"), "scenario.run", "must name a .toml run file")
    mode = head.get("mode")
    if mode is not None:
        _check(isinstance(mode, str) and mode in MODES, "scenario.mode", f"must be one of {', '.join(MODES)}")
    seed = _integer(head, "seed", "scenario.")
    overrides = _run_overrides(data.get("run_overrides", {}))
    peers = _peers(data)
    events = _events(data.get("events", []), peers, duration) + _churn(data.get("churn"), peers, duration)
    explicit = {e.peer for e in events if e.action == "start"}
    for p in peers:
        if p.index in explicit:
            _check(not p.start_at, f"peers[{p.index}].start_at", "and a start event both start this peer")
        elif p.start_at:
            _check(p.start_at < duration, f"peers[{p.index}].start_at", "must be before scenario.duration")
            events.append(Event(p.start_at, "start", p.index, origin=f"peers[{p.index}].start_at"))
    peers = [replace(p, start_at=None) if p.index in explicit or p.start_at else p for p in peers]
    events.sort(key=lambda e: e.at)  # stable: at one time, in the order written
    _check_timeline(peers, events)
    _check_emulation(emulation, events, peers)
    initial = [p.index for p in peers if p.start_at == 0]
    wait = _integer(head, "wait_peers", "scenario.")
    if wait is None:
        wait = len(initial)
    _check(
        1 <= wait <= len(initial),
        "scenario.wait_peers",
        f"must be between 1 and {len(initial)} (the peers started at 0 s)",
    )
    name = _string(head, "name", "scenario.", default_name)
    _check(
        bool(name) and all(c.isalnum() or c in "-_." for c in name),
        "scenario.name",
        "must be letters, digits, - _ .",
    )
    return Scenario(
        name=name,
        description=_string(head, "description", "scenario.", ""),
        duration=duration,
        emulation=emulation,
        run=run,
        run_overrides=overrides,
        mode=mode,
        seed=seed,
        wait_peers=wait,
        peers=tuple(peers),
        events=tuple(events),
        checks=_checks(data.get("checks", {})),
        source=source,
    )


def _run_overrides(table: Any) -> dict[str, Any]:
    """Sections and keys must exist; the values are checked once merged into the run file (an override
    may be valid only with the run file's other values, say progress.interval with its progress.ttl)."""
    _check(isinstance(table, Mapping), "run_overrides", "must be a table of run-file sections")
    sections = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    for name, section in table.items():
        _check(
            name in sections,
            f"run_overrides.{name}",
            f"is not a run-file section; known: {', '.join(sections)}",
        )
        _check(isinstance(section, Mapping), f"run_overrides.{name}", "must be a table")
        keys = [f.name for f in dataclasses.fields(getattr(RunConfig(), name))]
        for key in section:
            _check(
                key in keys,
                f"run_overrides.{name}.{key}",
                f"is not a key of [{name}]; known: {', '.join(keys)}",
            )
    return {k: dict(v) for k, v in table.items()}


def _profile(table: Mapping[str, Any], where: str, base: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key in PROFILE_KEYS:
        if key in table:
            out[key] = _number(table, key, where)
    _check_profile(out, where)
    return out


def _check_adversary(kind: Any, where: str) -> str | None:
    """None (honest) or one of the known attacks; the error names the key and the kinds."""
    if kind is None:
        return None
    _check(
        isinstance(kind, str) and kind in ADVERSARIES,
        where,
        f"must be one of {', '.join(ADVERSARIES)}, not {kind!r}",
    )
    return str(kind)


def _check_profile(p: Mapping[str, Any], where: str) -> None:
    _check(p["slowdown"] >= 1 and math.isfinite(p["slowdown"]), f"{where}slowdown", "must be a number >= 1")
    for key in ("up_mbit", "down_mbit"):
        _check(p[key] > 0, f"{where}{key}", "must be positive (inf: unshaped)")
    for key in ("latency_ms", "jitter_ms", "cuts_per_min", "start_at"):
        _check(0 <= p[key] < math.inf, f"{where}{key}", "must be finite and >= 0")
    _check(
        p["jitter_ms"] <= p["latency_ms"] or p["jitter_ms"] == 0,
        f"{where}jitter_ms",
        "must not exceed latency_ms",
    )


def _peers(data: Mapping[str, Any]) -> list[PeerSpec]:
    defaults = _table(data, "defaults")
    _check(
        "adversary" not in defaults,
        "defaults.adversary",
        "is for [[peers]] entries only (a scenario needs honest peers too)",
    )
    _known(defaults, (*PROFILE_KEYS, "count"), "defaults.")
    base: dict[str, Any] = dict(
        slowdown=1.0,
        up_mbit=math.inf,
        down_mbit=math.inf,
        latency_ms=0.0,
        jitter_ms=0.0,
        cuts_per_min=0.0,
        start_at=0.0,
    )
    base = _profile(defaults, "defaults.", base)
    count = _integer(defaults, "count", "defaults.")
    entries = data.get("peers", [])
    _check(isinstance(entries, list), "peers", "must be an array of tables ([[peers]])")
    profiles: list[tuple[str, dict[str, Any]]] = []
    for k, entry in enumerate(entries):
        where = f"peers[{k}]."
        _check(isinstance(entry, Mapping), f"peers[{k}]", "must be a table")
        _known(entry, (*PROFILE_KEYS, "count", "name", "adversary"), where)
        copies = _integer(entry, "count", where)
        copies = 1 if copies is None else copies
        _check(1 <= copies <= MAX_PEERS, f"{where}count", f"must be between 1 and {MAX_PEERS}")
        profile = _profile(entry, where, base)
        if "adversary" in entry:
            profile["adversary"] = _check_adversary(entry["adversary"], f"{where}adversary")
        name = _string(entry, "name", where, "")
        for c in range(copies):
            profiles.append((f"{name}-{c}" if name and copies > 1 else name, profile))
    if count is not None:
        _check(1 <= count <= MAX_PEERS, "defaults.count", f"must be between 1 and {MAX_PEERS}")
        _check(len(profiles) <= count, "defaults.count", f"is {count} but [[peers]] lists {len(profiles)}")
        profiles += [("", base)] * (count - len(profiles))
    _check(bool(profiles), "peers", "none: give [[peers]] entries or defaults.count")
    _check(len(profiles) <= MAX_PEERS, "peers", f"at most {MAX_PEERS}")
    _check(
        not all(p.get("adversary") for _, p in profiles),
        "peers",
        "are all adversaries: at least one must be honest (without adversary)",
    )
    return [
        PeerSpec(index=i, name=name or f"peer-{i}", **profile) for i, (name, profile) in enumerate(profiles)
    ]


EVENT_KEYS = ("at", "action", "peer", "seconds", *LINK_KEYS)


def _events(entries: Any, peers: Sequence[PeerSpec], duration: float) -> list[Event]:
    _check(isinstance(entries, list), "events", "must be an array of tables ([[events]])")
    out = []
    for k, entry in enumerate(entries):
        where = f"events[{k}]."
        _check(isinstance(entry, Mapping), f"events[{k}]", "must be a table")
        _known(entry, EVENT_KEYS, where)
        at = _number(entry, "at", where, required=True)
        _check(0 <= at < duration, f"{where}at", f"must be in [0, scenario.duration = {duration:g})")
        action = _string(entry, "action", where, None)
        _check(action in ACTIONS, f"{where}action", f"must be one of {', '.join(ACTIONS)}")
        peer = _integer(entry, "peer", where)
        _check(peer is not None, f"{where}peer", "is required")
        assert peer is not None
        _check(0 <= peer < len(peers), f"{where}peer", f"must be a peer index, 0 to {len(peers) - 1}")
        seconds = _number(entry, "seconds", where, required=action == "partition")
        if action == "partition":
            _check(seconds > 0, f"{where}seconds", "must be positive")
        else:
            _check("seconds" not in entry, f"{where}seconds", "is for partition events only")
        link = {key: _number(entry, key, where) for key in LINK_KEYS if key in entry}
        if action == "link":
            _check(bool(link), f"events[{k}]", f"a link event changes at least one of {', '.join(LINK_KEYS)}")
            merged = {**peers[peer].link, **link, "slowdown": 1.0, "start_at": 0.0}
            _check_profile(merged, where)
        else:
            _check(not link, f"{where}{next(iter(link), '')}", "is for link events only")
        out.append(Event(at, action, peer, seconds, link, origin=f"events[{k}]"))
    return out


CHURN_KEYS = ("every", "restart_after", "start", "stop", "peers")


def _churn(table: Any, peers: Sequence[PeerSpec], duration: float) -> list[Event]:
    if table is None:
        return []
    _check(isinstance(table, Mapping), "churn", "must be a table")
    _known(table, CHURN_KEYS, "churn.")
    every = _number(table, "every", "churn.", required=True)
    _check(every > 0, "churn.every", "must be positive")
    restart_after = _number(table, "restart_after", "churn.", 0.0)
    _check(0 <= restart_after < math.inf, "churn.restart_after", "must be finite and >= 0 (0: never restart)")
    start = _number(table, "start", "churn.", every)
    stop = _number(table, "stop", "churn.", duration - restart_after)
    _check(0 <= start < duration, "churn.start", "must be in [0, scenario.duration)")
    _check(start <= stop <= duration, "churn.stop", "must be between churn.start and scenario.duration")
    victims = table.get("peers", list(range(len(peers))))
    _check(
        isinstance(victims, list)
        and bool(victims)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in victims),
        "churn.peers",
        "must be a non-empty array of peer indexes",
    )
    for v in victims:
        _check(0 <= v < len(peers), "churn.peers", f"{v} is not a peer index (0 to {len(peers) - 1})")
    if restart_after:
        _check(
            restart_after < every * len(victims),
            "churn.restart_after",
            "must be shorter than a round of churn.peers (every x their number): a peer is killed "
            "again only once it is back",
        )
    out, k, at = [], 0, start
    while at <= stop + 1e-9:
        victim = victims[k % len(victims)]
        out.append(Event(round(at, 6), "kill", victim, origin="churn"))
        if restart_after and at + restart_after < duration:
            out.append(Event(round(at + restart_after, 6), "restart", victim, origin="churn"))
        k += 1
        at = start + k * every
    return out


def _check_timeline(peers: Sequence[PeerSpec], events: Sequence[Event]) -> None:
    """Replay each peer's life: a peer is started once, killed or stopped only while running, restarted
    only when down."""
    state = {p.index: "running" if p.start_at == 0 else "unstarted" for p in peers}
    for e in events:
        where = e.origin or "events"
        now = state[e.peer]
        if e.action == "start":
            _check(now == "unstarted", where, f"starts peer {e.peer} at {e.at:g} s, which was started before")
            state[e.peer] = "running"
        elif e.action in ("kill", "stop"):
            _check(
                now == "running",
                where,
                f"{e.action}s peer {e.peer} at {e.at:g} s, which is not running then ({now})",
            )
            state[e.peer] = "down"
        elif e.action == "restart":
            _check(
                now == "down", where, f"restarts peer {e.peer} at {e.at:g} s, which is not down then ({now})"
            )
            state[e.peer] = "running"
        else:
            _check(now != "unstarted", where, f"{e.action} of peer {e.peer} at {e.at:g} s, before it started")
    _check(any(p.start_at == 0 for p in peers), "peers", "none starts at 0 s")


def _check_emulation(emulation: str, events: Sequence[Event], peers: Sequence[PeerSpec]) -> None:
    if emulation == "userspace":
        return
    for e in events:
        _check(
            e.action not in SWITCH_ACTIONS,
            f"{e.origin}.action",
            f"'{e.action}' needs scenario.emulation = 'userspace' (this one is '{emulation}')",
        )


CHECK_KEYS = {
    "identical": bool,
    "continues": bool,
    "recovery_s": float,
    "rejoin": bool,
    "catch_up_s": float,
    "utilization_min": float,
    "utilization_modes": list,
    "rss_growth_max": float,
    "warmup_s": float,
    "min_steps": int,
    "loss_decreases": bool,
    "loss_jump_max": float,
    "no_crashes": bool,
    "offenders_named": bool,
}


def _checks(table: Any) -> Checks:
    _check(isinstance(table, Mapping), "checks", "must be a table")
    _known(table, tuple(CHECK_KEYS), "checks.")
    values: dict[str, Any] = {}
    for key, kind in CHECK_KEYS.items():
        if key not in table:
            continue
        where = f"checks.{key}"
        if kind is bool:
            _check(isinstance(table[key], bool), where, f"must be true or false, not {table[key]!r}")
            values[key] = table[key]
        elif kind is float:
            values[key] = _number(table, key, "checks.")
            _check(0 <= values[key] < math.inf, where, "must be finite and >= 0")
        elif kind is int:
            values[key] = _integer(table, key, "checks.")
            _check(values[key] >= 0, where, "must not be negative")
        else:
            modes = table[key]
            _check(
                isinstance(modes, list) and all(m in MODES for m in modes),
                where,
                f"must be a list of {', '.join(MODES)}",
            )
            values[key] = tuple(modes)
    if "utilization_min" in values:
        _check(0 < values["utilization_min"] <= 1, "checks.utilization_min", "must be in (0, 1]")
    return Checks(**values)


# ---- the run file ----------------------------------------------------------------------------------


def read_run_file(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ScenarioError(f"scenario.run: cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ScenarioError(f"scenario.run: {path} is not a valid TOML file: {e}") from None


def merged_run(scenario: Scenario, base: Mapping[str, Any]) -> dict[str, Any]:
    """The run file with the scenario's overrides, mode and seed merged in; validated as a run file."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for section, values in scenario.run_overrides.items():
        target = out.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, Mapping) and isinstance(target.get(key), Mapping):
                target[key] = {**target[key], **value}
            else:
                target[key] = value
    if scenario.mode is not None:
        out.setdefault("training", {})["mode"] = scenario.mode
    if scenario.seed is not None:
        out.setdefault("run", {})["seed"] = scenario.seed
    try:
        parse_config(out)
    except ConfigError as e:
        raise ScenarioError(f"the run file with run_overrides: {e}") from None
    return out


def to_toml(data: Mapping[str, Any]) -> str:
    """A run file's tables as TOML text (sections of scalars, nested tables such as task.options)."""
    lines: list[str] = []

    def emit(prefix: str, table: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
        if scalars or not any(isinstance(v, Mapping) for v in table.values()):
            lines.append(f"[{prefix}]")
            lines.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
            lines.append("")
        for k, v in table.items():
            if isinstance(v, Mapping):
                emit(f"{prefix}.{_key(k)}", v)

    for section, table in data.items():
        _check(isinstance(table, Mapping), section, "must be a table")
        emit(_key(section), table)
    return "\n".join(lines)


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "-_" for c in k) else _value(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ScenarioError(f"cannot write {v!r} to a run file")


# ---- small validators ------------------------------------------------------------------------------


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ScenarioError(f"{key} {what}")


def _known(table: Mapping[str, Any], keys: Sequence[str], where: str, kind: str = "key") -> None:
    for key in table:
        if key not in keys:
            label = f"[{key}]" if kind == "table" else f"{where}{key}"
            raise ScenarioError(f"unknown {kind} {label}; known: {', '.join(keys)}")


def _table(data: Mapping[str, Any], name: str, *, required: bool = False) -> Mapping[str, Any]:
    if name not in data:
        _check(not required, f"[{name}]", "is required")
        return {}
    _check(isinstance(data[name], Mapping), f"[{name}]", "must be a table")
    return data[name]  # type: ignore[no-any-return]


def _number(
    table: Mapping[str, Any], key: str, where: str, default: float = 0.0, *, required: bool = False
) -> float:
    if key not in table:
        _check(not required, f"{where}{key}", "is required")
        return default
    value = table[key]
    _check(
        isinstance(value, int | float) and not isinstance(value, bool),
        f"{where}{key}",
        f"must be a number, not {value!r}",
    )
    _check(not math.isnan(value), f"{where}{key}", "must be a number, not nan")
    return float(value)


def _integer(table: Mapping[str, Any], key: str, where: str) -> int | None:
    if key not in table:
        return None
    value = table[key]
    _check(
        isinstance(value, int) and not isinstance(value, bool),
        f"{where}{key}",
        f"must be an integer, not {value!r}",
    )
    return int(value)


def _string(table: Mapping[str, Any], key: str, where: str, default: str | None) -> Any:
    if key not in table:
        return default
    value = table[key]
    _check(isinstance(value, str), f"{where}{key}", f"must be a string, not {value!r}")
    return value
