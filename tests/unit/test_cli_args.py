"""Command-line values parsed without starting anything."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from p2ptrain.node import NodeConfig
from p2ptrain.cli import build_parser
from p2ptrain.cli.common import UsageError, node_config, node_settings
from p2ptrain.cli.common import announce_flag as _announce


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, (None, None)),
        ("203.0.113.7", ("203.0.113.7", None)),
        ("203.0.113.7:4001", ("203.0.113.7", 4001)),
        ("node.example.org:31337", ("node.example.org", 31337)),
        ("[2001:db8::1]:31337", ("2001:db8::1", 31337)),
        ("2001:db8::1", ("2001:db8::1", None)),
        ("[2001:db8::1]", ("2001:db8::1", None)),
    ],
)
def test_announce_is_a_host_and_an_optional_port(
    text: str | None, expected: tuple[str | None, int | None]
) -> None:
    assert _announce(text) == expected


def test_announce_port_out_of_range_is_refused() -> None:
    with pytest.raises(UsageError, match="out of range"):
        _announce("203.0.113.7:70000")


def test_a_node_relays_unless_told_not_to() -> None:
    from p2ptrain.node import Node

    def _node_config(args: argparse.Namespace) -> NodeConfig:
        return node_config(node_settings(args), run_id="default", authority=None)

    on = _node_config(build_parser().parse_args(["node", "--identity", "k"]))
    off = _node_config(build_parser().parse_args(["node", "--identity", "k", "--no-relay"]))
    assert on.relay and not off.relay
    from p2ptrain.identity import Identity

    identity = Identity.generate()
    assert Node(identity, on).host.relay.config.enabled
    assert not Node(identity, off).host.relay.config.enabled


@pytest.mark.parametrize(
    "argv",
    [
        ["ping", "ADDR", "--log-level", "debug"],
        ["node", "--log-level", "debug", "--listen", "127.0.0.1:0"],
        ["--log-level", "debug", "status", "ADDR"],
    ],
)
def test_log_level_is_taken_before_or_after_the_command(argv: list[str]) -> None:
    """(It worked only before the command: ``p2ptrain node --log-level debug`` was an error.)"""
    assert build_parser().parse_args(argv).log_level == "debug"


@pytest.mark.parametrize("command", ["ping", "peers", "status"])
def test_the_tools_options_say_what_they_do(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for option in ("--run-id", "--timeout"):
        action = next(a for a in sub._actions if option in a.option_strings)
        assert action.help, f"{command} {option} has no help text"
    run_id = next(a for a in sub._actions if "--run-id" in a.option_strings)
    assert "[run] id" in str(run_id.help)  # where a training node's run id comes from


def test_the_light_commands_start_without_the_training_stack() -> None:
    """``p2ptrain id``, ``keygen``, ``ping``, ``peers``, ``status`` load the command line and the network
    only: importing torch took seconds on every call (and in every test that runs one)."""
    probe = (
        "import sys, p2ptrain, p2ptrain.cli; p2ptrain.cli.build_parser();"
        " print(sorted(m for m in ('torch', 'p2ptrain.node') if m in sys.modules),"
        " sorted(set(p2ptrain.__all__) - set(dir(p2ptrain))))"  # (what a shell completes: lazy names too)
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr


def test_the_package_still_offers_its_whole_api() -> None:
    import p2ptrain

    for name in p2ptrain.__all__:
        assert getattr(p2ptrain, name) is not None, name
    assert p2ptrain.Node.__module__ == "p2ptrain.node"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        p2ptrain.Nope  # noqa: B018


def test_a_run_files_node_section_starts_the_node_unless_a_flag_says_otherwise(tmp_path: Path) -> None:
    """``p2ptrain node --config RUN.toml``: the run file's [node] keys apply, a flag given wins, and
    the flags' own checks keep their messages."""
    from p2ptrain.cli.train import run_config
    from p2ptrain.identity import Identity

    peer = Identity.generate().peer_id
    run = tmp_path / "run.toml"
    run.write_text(
        '[run]\nid = "from-file"\nauthority = "file-key"\n'
        f'[node]\nlisten = ["127.0.0.1:4001"]\njoin = ["/ip4/127.0.0.1/tcp/4002/p2p/{peer}"]\n'
        f'data_dir = "{tmp_path / "d"}"\nmetrics_port = 9100\nwait_peers = 3\ndevice = "cpu:0"\n'
    )
    args = build_parser().parse_args(["node", "--config", str(run), "--listen", "0.0.0.0:5000", "--no-relay"])
    config = run_config(args)
    settings = node_settings(args, config.node, training=True)
    assert settings.listen == (("0.0.0.0", 5000),) and not settings.relay  # the flags'
    assert [str(a.peer_id) for a in settings.join] == [str(peer)]  # the file's
    assert settings.data_dir == tmp_path / "d" and settings.metrics_port == 9100
    assert settings.wait_peers == 3 and settings.device == "cpu:0"
    assert settings.local_timeout == 30.0 and settings.tracker == ""  # neither: the defaults
    assert config.run.authority == "file-key"  # no --authority: the run file's
    flagged = build_parser().parse_args(["node", "--config", str(run), "--authority", "flag-key"])
    assert run_config(flagged).run.authority == "flag-key"
    bare = build_parser().parse_args(["node", "--join", "127.0.0.1:4002"])
    with pytest.raises(UsageError, match=r"--join 127\.0\.0\.1:4002: give the full address"):
        node_settings(bare)
    with pytest.raises(UsageError, match="--wait-peers must be at least 1"):
        node_settings(build_parser().parse_args(["node", "--task", "t", "--wait-peers", "0"]), training=True)
    with pytest.raises(UsageError, match="--metrics-port 70000: out of range"):
        node_settings(build_parser().parse_args(["node", "--metrics-port", "70000"]))


def test_a_bootstrap_node_ignores_the_training_flags_as_before() -> None:
    """(--device and the other training flags mean nothing without a run file; they were never read.)"""
    args = build_parser().parse_args(["node", "--wait-peers", "0", "--local-workers", "-1"])
    assert node_settings(args) == node_settings(build_parser().parse_args(["node"]))


def test_a_bootstrap_node_of_a_spread_run_takes_its_peer_lists_buckets(tmp_path: Path) -> None:
    """A node without a run file announces itself and reads the peer list under the run's bucket keys
    (``--buckets``: the run's progress.buckets); left out, the one key of a run that does not spread it.
    A training node's come from its run file, so the flag is refused there."""
    from p2ptrain.cli.node import _bootstrap_node

    def bootstrap(*flags: str) -> NodeConfig:
        args = build_parser().parse_args(["node", "--data-dir", str(tmp_path), *flags])
        return _bootstrap_node(args).config

    assert bootstrap("--buckets", "8").peer_list_buckets == 8
    assert bootstrap().peer_list_buckets == 1
    with pytest.raises(UsageError, match="--buckets must be a power of 2"):
        bootstrap("--buckets", "6")
    from p2ptrain.cli.node import cmd_node

    with pytest.raises(UsageError, match=r"a training node's is its run's progress\.buckets"):
        cmd_node(build_parser().parse_args(["node", "--task", "t", "--buckets", "4"]))
