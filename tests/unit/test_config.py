"""Run configuration: TOML into frozen dataclasses, every refusal a ConfigError naming ``section.key``."""

from __future__ import annotations

import dataclasses
import logging
import math
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.averaging.compression import Compression
from p2ptrain.averaging.robust import Aggregation
from p2ptrain.config import (
    AveragingSection,
    CheckpointSection,
    DilocoSection,
    EvalSection,
    NodeSection,
    ProgressSection,
    RunConfig,
    RunSection,
    StateSyncSection,
    TaskSection,
    TrainingSection,
    load_config,
    parse_config,
    with_flags,
)
from p2ptrain.errors import ConfigError
from p2ptrain.net.address import PeerAddress
from p2ptrain.pipeline.codec import Rounding
from p2ptrain.pipeline.settings import PipelineSection

SECTIONS = (
    "run",
    "task",
    "training",
    "diloco",
    "averaging",
    "progress",
    "statesync",
    "checkpoint",
    "eval",
    "pipeline",
    "node",
)

# ---- defaults ----------------------------------------------------------------------------------


def test_empty_document_gives_the_defaults() -> None:
    assert parse_config({}) == RunConfig()


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("")
    assert load_config(path) == RunConfig()


def test_empty_sections_give_the_defaults() -> None:
    assert parse_config({name: {} for name in SECTIONS}) == RunConfig()


DEFAULTS = {
    "run.id": "tiny-gpt",
    "run.seed": 0,
    "run.authority": "",
    "run.id_work": 0,
    "task.name": "tiny-gpt",
    "task.options": {},
    "training.mode": "sync",
    "training.batch_size": 16,
    "training.target_batch_size": 256,
    "training.lr": 1e-3,
    "training.weight_decay": 0.01,
    "training.warmup_steps": 10,
    "training.grad_clip": 1.0,
    "training.max_steps": 0,
    "training.threads": 0,
    "diloco.outer_lr": 0.7,
    "diloco.outer_momentum": 0.9,
    "diloco.overlap": False,
    "diloco.outer_state": "auto",
    "diloco.fragments": 1,
    "averaging.timeout": 30.0,
    "averaging.matchmaking_time": 3.0,
    "averaging.compression": Compression.NONE,  # parsed at load: the typed value
    "averaging.bandwidth": 0.0,
    "averaging.max_group_size": 64,
    "averaging.aggregation": Aggregation.MEAN,
    "averaging.audit": False,
    "progress.interval": 1.0,
    "progress.ttl": 10.0,
    "progress.buckets": 1,
    "progress.regions": 1,
    "statesync.chunk_timeout": 30.0,
    "statesync.max_donors": 4,
    "statesync.replay_steps": 4,
    "statesync.serve": True,
    "checkpoint.every_steps": 50,
    "checkpoint.keep": 2,
    "eval.every_steps": 10,
    "eval.batch_size": 16,
    "pipeline.stages": (),
    "pipeline.micro_batch": 4,
    "pipeline.compression": Compression.INT8,
    "pipeline.check_fraction": 0.0,
    "pipeline.timeout": 10.0,
    "pipeline.retries": 3,
    "pipeline.max_abs": 1e4,
    "pipeline.local_steps": 8,
    "pipeline.rank": 0,
    "pipeline.rounding": Rounding.NEAREST,
    "node.listen": (("0.0.0.0", 31337),),
    "node.announce": None,
    "node.source_address": "",
    "node.join": (),
    "node.relay": True,
    "node.identity": None,
    "node.data_dir": None,
    "node.status_file": None,
    "node.metrics_port": None,
    "node.certificate": None,
    "node.device": "cpu",
    "node.devices": (),
    "node.local_workers": 0,
    "node.local_timeout": 30.0,
    "node.shard": 1,
    "node.wait_peers": 1,
    "node.metrics_file": None,
    "node.tracker": "",
}


@pytest.mark.parametrize(("key", "default"), DEFAULTS.items(), ids=list(DEFAULTS))
def test_default_value(key: str, default: Any) -> None:
    section, name = key.split(".")
    value = getattr(getattr(RunConfig(), section), name)
    assert value == default
    assert type(value) is type(default)


def test_every_setting_has_its_default_listed() -> None:
    """A new setting must be added to DEFAULTS (and so to the tests)."""
    config = RunConfig()
    keys = {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, s.name))
    }
    assert keys == set(DEFAULTS)
    assert tuple(f.name for f in dataclasses.fields(config)) == SECTIONS


def test_sections_are_frozen() -> None:
    config = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training = TrainingSection()  # type: ignore[misc]


# ---- a full file -------------------------------------------------------------------------------

JOIN = PeerAddress.parse("/ip4/203.0.113.7/tcp/31337/p2p/5BRcxtqkfCAn8yUekBzrpDoRqFtY2xSGqJqHTvS8nSXf")

FULL_TOML = """\
[run]
id = "wan-diloco"
seed = 1234

[task]
name = "mypkg.tasks:make"
options = { vocab = 256, layers = 4, name = "x", nested = { deep = true } }

[training]
mode = "diloco"
batch_size = 8
target_batch_size = 4096
lr = 3e-4
weight_decay = 0
warmup_steps = 100
grad_clip = 0.5
max_steps = 1000
threads = 4

[diloco]
outer_lr = 0.5
outer_momentum = 0.0
overlap = true

[averaging]
timeout = 120
matchmaking_time = 7.5
compression = "int8"
bandwidth = 12.5
max_group_size = 8

[progress]
interval = 2.0
ttl = 30

[statesync]
chunk_timeout = 120
max_donors = 2
serve = false
replay_steps = 8

[checkpoint]
every_steps = 0
keep = 5

[eval]
every_steps = 0
batch_size = 64

[pipeline]
stages = [0, 2]
micro_batch = 2
compression = "none"
check_fraction = 0.1
timeout = 5.0
retries = 2
max_abs = 100.0

[node]
listen = ["127.0.0.1:4001", "[::1]:4001"]
announce = "node.example.org:31337"
source_address = "192.0.2.7"
join = ["/ip4/203.0.113.7/tcp/31337/p2p/5BRcxtqkfCAn8yUekBzrpDoRqFtY2xSGqJqHTvS8nSXf"]
relay = false
identity = "keys/node.key"
data_dir = "/var/lib/p2ptrain"
status_file = "status.json"
metrics_port = 9100
certificate = "node.cert"
device = "cuda:0"
devices = ["cuda:0", "cuda:1"]
local_workers = 1
local_timeout = 60
wait_peers = 2
metrics_file = "metrics.jsonl"
tracker = "tensorboard"
"""

FULL = RunConfig(
    run=RunSection(id="wan-diloco", seed=1234),
    task=TaskSection(
        name="mypkg.tasks:make",
        options={"vocab": 256, "layers": 4, "name": "x", "nested": {"deep": True}},
    ),
    training=TrainingSection(
        mode="diloco",
        batch_size=8,
        target_batch_size=4096,
        lr=3e-4,
        weight_decay=0.0,
        warmup_steps=100,
        grad_clip=0.5,
        max_steps=1000,
        threads=4,
    ),
    diloco=DilocoSection(outer_lr=0.5, outer_momentum=0.0, overlap=True),
    averaging=AveragingSection(
        timeout=120.0, matchmaking_time=7.5, compression="int8", bandwidth=12.5, max_group_size=8
    ),
    progress=ProgressSection(interval=2.0, ttl=30.0),
    statesync=StateSyncSection(chunk_timeout=120.0, max_donors=2, serve=False, replay_steps=8),
    checkpoint=CheckpointSection(every_steps=0, keep=5),
    eval=EvalSection(every_steps=0, batch_size=64),
    pipeline=PipelineSection(
        stages=(0, 2),
        micro_batch=2,
        compression=Compression.NONE,
        check_fraction=0.1,
        timeout=5.0,
        retries=2,
        max_abs=100.0,
    ),
    node=NodeSection(
        listen=(("127.0.0.1", 4001), ("::1", 4001)),
        announce=("node.example.org", 31337),
        source_address="192.0.2.7",
        join=(JOIN,),
        relay=False,
        identity=Path("keys/node.key"),
        data_dir=Path("/var/lib/p2ptrain"),
        status_file=Path("status.json"),
        metrics_port=9100,
        certificate=Path("node.cert"),
        device="cuda:0",
        devices=("cuda:0", "cuda:1"),
        local_workers=1,
        local_timeout=60.0,
        wait_peers=2,
        metrics_file=Path("metrics.jsonl"),
        tracker="tensorboard",
    ),
)


def test_full_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(FULL_TOML)
    config = load_config(path)
    assert config == FULL
    assert config == load_config(str(path)) == parse_config(tomllib.loads(FULL_TOML))


def test_full_file_sets_every_key() -> None:
    """FULL differs from the defaults in every section, so no key silently fell back to its default."""
    for name in SECTIONS:
        assert getattr(FULL, name) != getattr(RunConfig(), name), name


def test_integers_become_floats_for_float_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(FULL_TOML)
    config = load_config(path)
    for value in (
        config.training.weight_decay,
        config.averaging.timeout,
        config.progress.ttl,
        config.diloco.outer_momentum,
    ):
        assert type(value) is float


def test_task_options_are_copied_into_a_plain_dict() -> None:
    options = {"a": 1}
    config = parse_config({"task": {"options": types.MappingProxyType(options)}})
    options["a"] = 2  # the caller's mapping changing later does not change the config
    assert config.task.options == {"a": 1}
    assert type(config.task.options) is dict


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        # structure
        pytest.param({"trainig": {}}, ["[trainig]", "unknown section", *SECTIONS], id="unknown-section"),
        pytest.param({"training": 5}, ["[training] must be a table"], id="section-not-table"),
        pytest.param({"training": [1, 2]}, ["[training] must be a table"], id="section-array"),
        pytest.param(
            {"training": {"bach_size": 16}},
            ["unknown key training.bach_size", "known:", "batch_size", "target_batch_size", "lr"],
            id="unknown-key",
        ),
        pytest.param(
            {"eval": {"every": 1}},
            ["unknown key eval.every", "every_steps", "batch_size"],
            id="unknown-key-eval",
        ),
        # types
        pytest.param(
            {"training": {"batch_size": "16"}}, ["training.batch_size must be an integer"], id="str-for-int"
        ),
        pytest.param(
            {"training": {"batch_size": True}}, ["training.batch_size must be an integer"], id="bool-for-int"
        ),
        pytest.param(
            {"training": {"batch_size": 16.0}}, ["training.batch_size must be an integer"], id="float-for-int"
        ),
        pytest.param({"run": {"seed": [1]}}, ["run.seed must be an integer"], id="array-for-int"),
        pytest.param({"training": {"lr": "0.1"}}, ["training.lr must be a number"], id="str-for-float"),
        pytest.param({"training": {"lr": True}}, ["training.lr must be a number"], id="bool-for-float"),
        pytest.param({"training": {"lr": {"a": 1}}}, ["training.lr must be a number"], id="table-for-float"),
        pytest.param({"training": {"lr": math.nan}}, ["training.lr must be finite"], id="nan"),
        pytest.param({"averaging": {"timeout": math.inf}}, ["averaging.timeout must be finite"], id="inf"),
        pytest.param(
            {"training": {"weight_decay": -math.inf}},
            ["training.weight_decay must be finite"],
            id="minus-inf",
        ),
        pytest.param({"diloco": {"overlap": 1}}, ["diloco.overlap must be true or false"], id="int-for-bool"),
        pytest.param(
            {"diloco": {"overlap": "yes"}}, ["diloco.overlap must be true or false"], id="str-for-bool"
        ),
        pytest.param({"training": {"mode": 1}}, ["training.mode must be a string"], id="int-for-str"),
        pytest.param({"run": {"id": ["a"]}}, ["run.id must be a string"], id="array-for-str"),
        pytest.param({"task": {"options": "x"}}, ["task.options must be a table"], id="str-for-table"),
        pytest.param({"task": {"options": [1]}}, ["task.options must be a table"], id="array-for-table"),
        # ranges: training
        pytest.param({"training": {"mode": "async"}}, ["training.mode", "sync", "diloco"], id="mode"),
        pytest.param({"training": {"mode": "SYNC"}}, ["training.mode"], id="mode-case"),
        pytest.param({"training": {"batch_size": 0}}, ["training.batch_size", "at least 1"], id="batch-size"),
        pytest.param(
            {"training": {"target_batch_size": 0}}, ["training.target_batch_size"], id="target-batch"
        ),
        pytest.param({"training": {"lr": 0}}, ["training.lr", "positive"], id="lr-zero"),
        pytest.param({"training": {"lr": -1e-3}}, ["training.lr", "positive"], id="lr-negative"),
        pytest.param({"training": {"weight_decay": -0.1}}, ["training.weight_decay"], id="weight-decay"),
        pytest.param({"training": {"warmup_steps": -1}}, ["training.warmup_steps"], id="warmup"),
        pytest.param({"training": {"grad_clip": -1}}, ["training.grad_clip"], id="grad-clip"),
        pytest.param({"training": {"max_steps": -1}}, ["training.max_steps"], id="max-steps"),
        pytest.param({"training": {"threads": -1}}, ["training.threads", "0 and 1024"], id="threads-low"),
        pytest.param({"training": {"threads": 1025}}, ["training.threads", "0 and 1024"], id="threads-high"),
        # ranges: diloco
        pytest.param({"diloco": {"outer_lr": 0}}, ["diloco.outer_lr", "positive"], id="outer-lr"),
        pytest.param(
            {"diloco": {"outer_momentum": 1}}, ["diloco.outer_momentum", "[0, 1)"], id="momentum-one"
        ),
        pytest.param({"diloco": {"outer_momentum": -0.1}}, ["diloco.outer_momentum"], id="momentum-negative"),
        pytest.param(
            {"diloco": {"outer_state": "disk"}},
            ["diloco.outer_state", "auto, memory, file"],
            id="outer-state",
        ),
        # ranges: averaging
        pytest.param({"averaging": {"timeout": 0}}, ["averaging.timeout", "positive"], id="timeout"),
        pytest.param(
            {"averaging": {"matchmaking_time": -1}}, ["averaging.matchmaking_time"], id="matchmaking"
        ),
        pytest.param({"averaging": {"bandwidth": -1}}, ["averaging.bandwidth"], id="bandwidth"),
        pytest.param({"averaging": {"bandwidth": float("inf")}}, ["averaging.bandwidth"], id="bandwidth-inf"),
        pytest.param(
            {"averaging": {"max_group_size": 1}}, ["averaging.max_group_size", "2 and 256"], id="group-1"
        ),
        pytest.param({"averaging": {"max_group_size": 257}}, ["averaging.max_group_size"], id="group-257"),
        pytest.param(
            {"averaging": {"compression": "int4"}},
            ["averaging.compression", "int4", "none", "fp16", "bf16", "int8"],
            id="compression",
        ),
        pytest.param({"averaging": {"compression": ""}}, ["averaging.compression"], id="compression-empty"),
        # ranges: progress, checkpoint, eval
        pytest.param({"progress": {"interval": 0}}, ["progress.interval", "positive"], id="interval"),
        pytest.param({"progress": {"ttl": 1.0}}, ["progress.ttl", "progress.interval"], id="ttl-equal"),
        pytest.param({"progress": {"interval": 5, "ttl": 4}}, ["progress.ttl"], id="ttl-shorter"),
        pytest.param({"progress": {"interval": 20}}, ["progress.ttl"], id="interval-past-default-ttl"),
        pytest.param({"progress": {"buckets": 3}}, ["progress.buckets", "power of 2"], id="buckets-3"),
        pytest.param({"progress": {"buckets": 0}}, ["progress.buckets", "power of 2"], id="buckets-0"),
        pytest.param(
            {"progress": {"regions": 3, "buckets": 4}}, ["progress.regions", "power of 2"], id="regions-3"
        ),
        pytest.param(
            {"progress": {"regions": 2}}, ["progress.regions", "progress.buckets (1)"], id="regions-past"
        ),
        pytest.param(
            {"progress": {"regions": 4, "buckets": 4}}, ["progress.regions", "never mix"], id="regions-all"
        ),
        pytest.param(
            {"training": {"mode": "diloco"}, "progress": {"regions": 2, "buckets": 4}},
            ["progress.regions", "training.mode = 'sync'"],
            id="regions-diloco",
        ),
        pytest.param({"checkpoint": {"every_steps": -1}}, ["checkpoint.every_steps"], id="checkpoint-every"),
        pytest.param({"checkpoint": {"keep": 0}}, ["checkpoint.keep", "at least 1"], id="checkpoint-keep"),
        pytest.param({"eval": {"every_steps": -1}}, ["eval.every_steps"], id="eval-every"),
        pytest.param({"eval": {"batch_size": 0}}, ["eval.batch_size", "at least 1"], id="eval-batch"),
    ],
)
def test_refused(data: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message


def test_a_retired_key_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Run files written for an older version still load: ban_quorum meant something once."""
    with caplog.at_level(logging.WARNING):
        config = parse_config({"averaging": {"ban_quorum": 2, "audit": True}})
    assert config.averaging.audit
    assert "averaging.ban_quorum is ignored" in caplog.text


def test_unknown_key_lists_every_known_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"averaging": {"compresion": "int8"}})
    known = str(info.value).split("known:", 1)[1]
    assert [k.strip() for k in known.split(",")] == sorted(
        f.name for f in dataclasses.fields(AveragingSection)
    )


@pytest.mark.parametrize(
    ("data", "key", "value"),
    [
        pytest.param({"training": {"threads": 0}}, "training.threads", 0, id="threads-0"),
        pytest.param({"training": {"threads": 1024}}, "training.threads", 1024, id="threads-1024"),
        pytest.param({"training": {"batch_size": 1}}, "training.batch_size", 1, id="batch-1"),
        pytest.param({"training": {"lr": 1}}, "training.lr", 1.0, id="int-for-float"),
        pytest.param({"training": {"grad_clip": 0}}, "training.grad_clip", 0.0, id="grad-clip-off"),
        pytest.param({"training": {"weight_decay": 0.0}}, "training.weight_decay", 0.0, id="no-weight-decay"),
        pytest.param({"diloco": {"outer_momentum": 0}}, "diloco.outer_momentum", 0.0, id="momentum-0"),
        pytest.param(
            {"diloco": {"outer_momentum": 0.999}}, "diloco.outer_momentum", 0.999, id="momentum-near-1"
        ),
        pytest.param({"averaging": {"max_group_size": 2}}, "averaging.max_group_size", 2, id="group-2"),
        pytest.param({"averaging": {"max_group_size": 64}}, "averaging.max_group_size", 64, id="group-64"),
        pytest.param(
            {"averaging": {"compression": "bf16"}}, "averaging.compression", Compression.BF16, id="bf16"
        ),
        pytest.param(
            {"averaging": {"compression": "INT8"}},
            "averaging.compression",
            Compression.INT8,
            id="case-insensitive",
        ),
        pytest.param({"progress": {"ttl": 1.001}}, "progress.ttl", 1.001, id="ttl-just-longer"),
        pytest.param(
            {"progress": {"interval": 0.01, "ttl": 0.02}}, "progress.interval", 0.01, id="fast-progress"
        ),
        pytest.param({"run": {"seed": -(2**63)}}, "run.seed", -(2**63), id="seed-toml-min"),
        pytest.param({"task": {"options": {}}}, "task.options", {}, id="empty-options"),
    ],
)
def test_accepted(data: dict[str, Any], key: str, value: Any) -> None:
    section, name = key.split(".")
    got = getattr(getattr(parse_config(data), section), name)
    assert got == value
    assert type(got) is type(value)


# ---- files -------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config") as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "No such file" in str(info.value)
    assert info.value.__suppress_context__


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config") as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("[training\nlr = 1\n", id="unclosed-table"),
        pytest.param("[training]\nlr = \n", id="missing-value"),
        pytest.param("[training]\nlr = 1\nlr = 2\n", id="duplicate-key"),
        pytest.param("[training]\n[training]\n", id="duplicate-table"),
        pytest.param("lr: 1\n", id="yaml"),
    ],
)
def test_invalid_toml(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="is not valid TOML") as info:
        load_config(path)
    assert f"config {path} is not valid TOML" in str(info.value)
    assert "line" in str(info.value)  # where, from tomllib
    assert info.value.__suppress_context__


def test_invalid_value_in_file_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[training]\nlr = nan\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config {path}: training.lr must be finite"


def test_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[run]\nid = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


# ---- replace -----------------------------------------------------------------------------------


def test_replace_changes_one_section() -> None:
    before = RunConfig()
    after = before.replace("training", lr=0.5, mode="diloco")
    assert (after.training.lr, after.training.mode) == (0.5, "diloco")
    assert after.training.batch_size == before.training.batch_size
    assert before == RunConfig()  # unchanged
    for name in SECTIONS:
        if name != "training":
            assert getattr(after, name) == getattr(before, name)


def test_replace_keeps_earlier_changes() -> None:
    config = FULL.replace("training", lr=0.25)
    assert dataclasses.replace(config.training, lr=FULL.training.lr) == FULL.training
    assert config.replace("task", name="other").task.options == FULL.task.options


def test_replace_coerces_int_to_float() -> None:
    lr = RunConfig().replace("training", lr=1).training.lr
    assert lr == 1.0 and type(lr) is float


@pytest.mark.parametrize(
    ("section", "changes", "fragments"),
    [
        pytest.param("training", {"batch_size": 0}, ["training.batch_size"], id="range"),
        pytest.param("training", {"batch_size": True}, ["training.batch_size must be an integer"], id="bool"),
        pytest.param("training", {"lr": "fast"}, ["training.lr must be a number"], id="type"),
        pytest.param("training", {"lr": math.inf}, ["training.lr must be finite"], id="inf"),
        pytest.param("training", {"bach_size": 1}, ["unknown key training.bach_size"], id="unknown-key"),
        pytest.param("progress", {"interval": 20}, ["progress.ttl"], id="against-unchanged-key"),
        pytest.param("averaging", {"compression": "zip"}, ["averaging.compression"], id="compression"),
        pytest.param("task", {"options": 3}, ["task.options must be a table"], id="options"),
    ],
)
def test_replace_validates(section: str, changes: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig().replace(section, **changes)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("section", ["nosuch", "replace"])
def test_replace_unknown_section(section: str) -> None:
    with pytest.raises(ConfigError, match=section):
        RunConfig().replace(section, x=1)


# ---- [node]: this host's node, and the one rule for its flags ------------------------------------


@pytest.mark.parametrize(
    ("table", "fragments"),
    [
        pytest.param({"listen": []}, ["node.listen", "at least one"], id="listen-empty"),
        pytest.param({"listen": "0.0.0.0:1"}, ["node.listen must be an array"], id="listen-not-array"),
        pytest.param({"listen": ["nowhere"]}, ["node.listen", "HOST:PORT"], id="listen-no-port"),
        pytest.param({"listen": [4001]}, ["node.listen must be a string"], id="listen-int"),
        pytest.param({"announce": "h:70000"}, ["node.announce", "out of range"], id="announce-port"),
        pytest.param({"join": ["203.0.113.7:31337"]}, ["node.join", "full address"], id="join-bare"),
        pytest.param({"join": ["/ip4/x"]}, ["node.join"], id="join-malformed"),
        pytest.param({"relay": "no"}, ["node.relay must be true or false"], id="relay-str"),
        pytest.param({"data_dir": ""}, ["node.data_dir must not be empty"], id="data-dir-empty"),
        pytest.param({"data_dir": 1}, ["node.data_dir must be a string"], id="data-dir-int"),
        pytest.param({"metrics_port": 65536}, ["node.metrics_port"], id="metrics-port"),
        pytest.param({"metrics_port": "9100"}, ["node.metrics_port must be an integer"], id="metrics-str"),
        pytest.param({"devices": "cuda:0"}, ["node.devices must be an array"], id="devices-str"),
        pytest.param({"devices": [""]}, ["node.devices"], id="devices-empty-name"),
        pytest.param({"local_workers": -1}, ["node.local_workers"], id="local-workers"),
        pytest.param({"local_timeout": 0}, ["node.local_timeout", "positive"], id="local-timeout"),
        pytest.param({"shard": 0}, ["node.shard", "at least 1"], id="shard"),
        pytest.param({"shard": 2, "local_workers": 1}, ["node.shard", "exclude"], id="shard-and-workers"),
        pytest.param({"wait_peers": 0}, ["node.wait_peers", "at least 1"], id="wait-peers"),
        pytest.param({"tracker": "wandb"}, ["node.tracker", "tensorboard", "mlflow"], id="tracker"),
        pytest.param({"run_id": "x"}, ["unknown key node.run_id"], id="run-id-is-the-run's"),
    ],
)
def test_node_section_refused(table: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"node": table})
    for fragment in fragments:
        assert fragment in str(info.value)


def test_a_flag_given_wins_over_the_run_file_which_wins_over_the_default() -> None:
    """The one rule: flag given > run file > default; None is a flag left out."""
    file = parse_config({"node": {"listen": ["127.0.0.1:4001"], "data_dir": "from-file", "wait_peers": 3}})
    node = with_flags(file.node, listen=(("0.0.0.0", 5000),), data_dir=None, device=None, tracker="mlflow")
    assert node.listen == (("0.0.0.0", 5000),)  # given: the flag's
    assert node.data_dir == Path("from-file") and node.wait_peers == 3  # left out: the file's
    assert node.device == "cpu" and node.metrics_port is None  # in neither: the default
    assert node.tracker == "mlflow"
    assert with_flags(file.node) is file.node  # no flag given: the file's section as it is
    assert with_flags(NodeSection(), relay=False).relay is False  # (no run file: over the defaults)


def test_a_repeatable_flag_given_replaces_the_files_list() -> None:
    file = parse_config({"node": {"join": [str(JOIN)], "listen": ["127.0.0.1:1", "127.0.0.1:2"]}})
    other = PeerAddress.parse(str(JOIN).replace("203.0.113.7", "198.51.100.9"))
    node = with_flags(file.node, join=(other,))
    assert node.join == (other,) and node.listen == (("127.0.0.1", 1), ("127.0.0.1", 2))


def test_flags_are_validated_like_the_file() -> None:
    with pytest.raises(ConfigError, match=r"node\.wait_peers"):
        with_flags(NodeSection(), wait_peers=0)
    with pytest.raises(ConfigError, match=r"training\.mode"):
        RunConfig().with_flags("training", mode="fast")


def test_run_config_with_flags_applies_the_rule_to_one_section() -> None:
    config = parse_config({"training": {"mode": "diloco", "threads": 2}})
    flagged = config.with_flags("training", mode=None, threads=4)
    assert flagged.training.mode == "diloco" and flagged.training.threads == 4
    assert config.with_flags("averaging", bandwidth=None) == config
    with pytest.raises(ConfigError, match=r"unknown section \[nodes\]"):
        config.with_flags("nodes", listen=None)


def test_the_node_section_is_not_part_of_the_runs_fingerprint(tmp_path: Path) -> None:
    """[node] is about one host: two run files that differ only there are one run."""
    import torch

    from p2ptrain.training.optimizer.bookkeeping import run_fingerprint

    plain = tmp_path / "plain.toml"
    plain.write_text('[run]\nid = "fp"\n[training]\nmode = "diloco"\n')
    hosted = tmp_path / "hosted.toml"
    hosted.write_text(plain.read_text() + FULL_TOML[FULL_TOML.index("[node]") :])
    a, b = load_config(plain), load_config(hosted)
    assert a != b and a.node == NodeSection() and b.node == FULL.node
    model = torch.nn.Linear(3, 2)
    assert run_fingerprint(a, model) == run_fingerprint(b, model)
    assert run_fingerprint(a, model) != run_fingerprint(a.replace("run", id="other"), model)


# ---- top-k is for private swarms -----------------------------------------------------------------

TOPK_RUN = '[training]\nmode = "diloco"\n[averaging]\ncompression = "topk1-q2"\n'


@pytest.mark.parametrize("authority", ["", "   "], ids=["empty", "blank"])
def test_topk_in_an_open_swarm_is_refused_with_what_to_do(tmp_path: Path, authority: str) -> None:
    """Top-k rounds are neither audited nor robust: in an open swarm any stranger that reduces a partition
    could serve wrong sums within every member's bounds, round after round. Before, a run file took it
    (the README said 'private swarms' only); now it is refused, saying why and what to do instead."""
    path = tmp_path / "open.toml"
    path.write_text(f'[run]\nauthority = "{authority}"\n' + TOPK_RUN)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    for fragment in ("averaging.compression", "topk1-q2", "private", "run.authority", "audit", "int8"):
        assert fragment in message, message
    # the same rule for settings built in code, and for every top-k mode
    for mode in (m for m in Compression if m.sparse):
        with pytest.raises(ConfigError, match=r"run\.authority"):
            RunConfig().replace("training", mode="diloco").replace("averaging", compression=mode.value)


def test_topk_in_a_private_swarm_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "private.toml"
    path.write_text('[run]\nauthority = "2x7VjQ4y"\n' + TOPK_RUN)
    config = load_config(path)
    assert config.averaging.compression is Compression.TOPK1_Q2 and config.run.authority
    # and dense compressions stay open to anyone
    assert parse_config({"averaging": {"compression": "int8", "audit": True}}).run.authority == ""


def test_the_authority_flag_completes_a_top_k_run_file_before_it_is_checked(tmp_path: Path) -> None:
    """A top-k run file without an authority is refused (an open swarm), but ``--authority`` on the
    command line makes it a private run: the flag takes the file's place before the file is validated."""
    path = tmp_path / "topk.toml"
    path.write_text('[training]\nmode = "diloco"\n[averaging]\ncompression = "topk1-q2"\n')
    with pytest.raises(ConfigError, match="is for private swarms"):
        load_config(path)
    with pytest.raises(ConfigError, match="is for private swarms"):
        load_config(path, {"run": {"authority": None}})  # a flag left out changes nothing
    assert load_config(path, {"run": {"authority": "KEY"}}).run.authority == "KEY"
