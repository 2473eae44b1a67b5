"""End to end: real ``p2ptrain`` processes, driven only through the CLI, files and the network."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.processes import CLI, TIMEOUT, NodeProc, wait_until

pytestmark = pytest.mark.e2e


def run_cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_keygen_and_id(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    made = run_cli("keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    shown = run_cli("id", str(key))
    assert shown.returncode == 0 and shown.stdout.strip() == made.stdout.strip()

    again = run_cli("keygen", "--out", str(key))
    assert again.returncode != 0 and "refusing to overwrite" in again.stderr

    key.chmod(0o644)
    refused = run_cli("id", str(key))
    assert refused.returncode != 0
    assert "chmod 600" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_two_nodes_join_ping_and_stop(nodes: Callable[..., NodeProc], tmp_path: Path) -> None:
    key = tmp_path / "a.key"
    assert run_cli("keygen", "--out", str(key)).returncode == 0
    peer_a = run_cli("id", str(key)).stdout.strip()
    a = nodes("a", "--identity", str(key))
    addr_a = a.address()
    assert addr_a.endswith(f"/p2p/{peer_a}")

    b = nodes("b", "--join", addr_a)
    addr_b = b.address()
    peer_b = addr_b.rsplit("/", 1)[1]
    wait_until("a to list b", lambda: peer_b in ((a.status() or {}).get("connected_peers") or []))
    wait_until("b to list a", lambda: peer_a in ((b.status() or {}).get("connected_peers") or []))
    assert "joined the swarm through" in b.stderr()
    assert "connected (it dialed)" in a.stderr()

    ping = run_cli("ping", addr_b, "--run-id", "e2e", "--count", "2")
    assert ping.returncode == 0, ping.stderr
    assert f"connected to {peer_b}" in ping.stdout and "2 pings" in ping.stdout

    # A restarted node keeps its id: b's key lives in its data directory.
    assert (b.folder / "identity.key").exists()

    assert b.stop() == 0
    assert a.stop() == 0
    final_a, final_b = a.status(), b.status()
    assert final_a is not None and final_a["state"] == "stopped"
    assert final_b is not None and final_b["state"] == "stopped"
    assert "shutting down" in a.stderr()


def test_node_keeps_identity_across_restarts(nodes: Callable[..., NodeProc]) -> None:
    first = nodes("n")
    peer1 = first.address().rsplit("/", 1)[1]
    assert first.stop() == 0
    second = nodes("n")
    assert second.address().rsplit("/", 1)[1] == peer1
    assert "created a new identity" in first.stderr() and "created a new identity" not in second.stderr()
    assert second.stop() == 0


@pytest.mark.parametrize("command", ["ping", "peers"])
@pytest.mark.parametrize("case", ["unreachable", "wrong_peer", "wrong_run"])
def test_ping_failures_have_one_line_reasons(
    case: str, command: str, nodes: Callable[..., NodeProc], tmp_path: Path
) -> None:
    """(``peers`` said "no answer from ADDR" when the node answered and refused the run id.)"""
    a = nodes("a")
    addr = a.address()
    prefix, _peer = addr.rsplit("/p2p/", 1)
    if case == "unreachable":
        port = int(prefix.rsplit("/", 1)[1])
        target, run_id, expect = (
            f"/ip4/127.0.0.1/tcp/{port + 1 if port < 65535 else 1}",
            "e2e",
            "cannot reach",
        )
    elif case == "wrong_peer":
        other = run_cli("keygen", "--out", str(tmp_path / "x.key")).stdout.strip()
        target, run_id, expect = f"{prefix}/p2p/{other}", "e2e", "(peer_id)"
    else:
        target, run_id, expect = addr, "another-run", "(run_id)"
    result = run_cli(command, target, "--run-id", run_id, "--timeout", "5")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], result.stderr
    if case != "unreachable":
        wait_until("the listener to log the refusal", lambda: "refused handshake" in a.stderr())
    assert a.stop() == 0


def test_busy_port_is_a_clear_error(nodes: Callable[..., NodeProc]) -> None:
    a = nodes("a")
    port = a.address().split("/tcp/")[1].split("/")[0]
    clash = run_cli("node", "--listen", f"127.0.0.1:{port}", "--data-dir", str(a.folder / "clash"))
    assert clash.returncode != 0
    assert clash.stderr.strip().splitlines()[-1].startswith("p2ptrain node: cannot listen on 127.0.0.1:")
    assert a.stop() == 0


@pytest.mark.parametrize("join", ["127.0.0.1:31337", "/ip4/127.0.0.1/tcp/31337"])
def test_a_join_address_without_a_peer_id_is_refused(join: str, tmp_path: Path) -> None:
    """(It was accepted with a warning, and the node joined whoever answered there: another swarm, or
    itself on its own default port.)"""
    result = run_cli("node", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--join", join)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"p2ptrain node: --join {join}: give the full address the peer printed"), last
    assert "Traceback" not in result.stderr


def test_peers_lists_a_swarm_joined_through_a_chain(nodes: Callable[..., NodeProc]) -> None:
    """Three nodes; the third joined only through the second; `peers` from the third lists all three."""
    a = nodes("a")
    b = nodes("b", "--join", a.address())
    c = nodes("c", "--join", b.address())
    addr_c = c.address()
    ids = {n.address().rsplit("/", 1)[1] for n in (a, b, c)}

    def members_seen_by_c() -> set[str]:
        members = (c.status() or {}).get("members") or []
        return {m["peer_id"] for m in members}

    wait_until("c's status to list all three members", lambda: members_seen_by_c() == ids)
    assert "swarm: 3 peer(s) known" in c.stderr()

    listed = run_cli("peers", addr_c, "--run-id", "e2e", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert {r["peer_id"] for r in rows} == ids
    assert all(r["reachable"] and r["addresses"][0].endswith(r["peer_id"]) for r in rows)

    table = run_cli("peers", addr_c, "--run-id", "e2e")
    assert table.returncode == 0 and all(i in table.stdout for i in ids)
    for n in (c, b, a):
        assert n.stop() == 0
