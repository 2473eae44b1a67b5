"""Command-line values parsed without starting anything."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from p2ptrain.cli import UsageError, _announce, build_parser


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
    from p2ptrain.cli import _node_config, build_parser
    from p2ptrain.node import Node

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
