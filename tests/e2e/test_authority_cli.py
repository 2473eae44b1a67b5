"""End to end: a private swarm made and run only through the CLI (``p2ptrain authority``, ``node``).

What is proved here: ``authority init`` makes a 0600 key and prints its public key; ``authority issue``
writes certificates and prints their expiry; ``authority show`` prints a certificate's fields and checks
its issuer; two ``p2ptrain node`` processes with ``--authority``/``--certificate`` connect, while a third
without a certificate is refused, with one log line on each side that names the ``membership`` reason;
and a certificate without ``--authority`` is a one-line error. Each process imports torch, so commands
that do not depend on each other run side by side.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.processes import CLI, NodeProc, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TIMEOUT = 60.0


def run_all(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Run CLI commands side by side; their results in order."""
    procs = [
        subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args in commands
    ]
    out = []
    try:
        for args, proc in zip(commands, procs, strict=True):
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            out.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    finally:  # a timeout: none is left running, and no pipe left open (a later test's warnings)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    return out


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_private_swarm_through_the_cli(tmp_path: Path, nodes: Callable[..., NodeProc]) -> None:
    key, a_key, b_key = tmp_path / "authority.key", tmp_path / "a.key", tmp_path / "b.key"
    init, made_a, made_b, no_authority = run_all(
        ["authority", "init", "--out", str(key)],
        ["keygen", "--out", str(a_key)],
        ["keygen", "--out", str(b_key)],
        ["--log-level", "warning", "node", "--data-dir", str(tmp_path / "x"), "--certificate", "x.cert"],
    )
    assert init.returncode == 0, init.stderr
    authority = init.stdout.strip()
    assert 40 <= len(authority) <= 44 and authority.isalnum()
    assert key.stat().st_mode & 0o777 == 0o600
    assert f"# authority public key: {authority}" in key.read_text()
    peer_a, peer_b = made_a.stdout.strip(), made_b.stdout.strip()
    assert no_authority.returncode == 2
    assert one_line(no_authority) == (
        "p2ptrain node: --certificate needs --authority (the public key of the run's authority)"
    )

    a_cert, b_cert = tmp_path / "a.cert", tmp_path / "b.cert"
    issue = ["authority", "issue", "--key", str(key), "--peer"]
    issue_a, issue_b = run_all(
        [*issue, peer_a, "--expires", "30d", "--out", str(a_cert)],
        [*issue, peer_b, "--expires", "12h", "--run", "e2e", "--out", str(b_cert)],
    )
    assert issue_a.returncode == 0, issue_a.stderr
    assert f"peer {peer_a} in any run of this authority, expires 20" in issue_a.stdout
    assert issue_b.returncode == 0, issue_b.stderr
    assert "in run 'e2e'" in issue_b.stdout and "UTC" in issue_b.stdout

    # Two members connect; an outsider (no certificate) is refused.
    member = ["--authority", authority, "--certificate"]
    a = nodes("a", "--identity", str(a_key), *member, str(a_cert))
    addr_a = a.address()
    b = nodes("b", "--identity", str(b_key), *member, str(b_cert), "--join", addr_a)
    c = nodes("c", "--join", addr_a)
    shown, wrong_issuer = run_all(
        ["authority", "show", str(b_cert), "--authority", authority],
        ["authority", "show", str(a_cert), "--authority", peer_a],  # a peer id is not the authority's key
    )
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(":", 1) for line in shown.stdout.strip().splitlines())
    assert fields["peer"].strip() == peer_b
    assert fields["run"].strip() == "e2e"
    assert fields["authority"].strip() == authority
    assert fields["signature"].strip() == "verified (issued by this authority)"
    assert fields["state"].strip().startswith("valid for 0.5 more days")
    assert wrong_issuer.returncode == 1
    assert "issued by another authority" in one_line(wrong_issuer)

    wait_until("a and b to connect", lambda: peer_b in a.connected() and peer_a in b.connected())
    refusal = "has no membership certificate (this run is private"
    wait_until("a to refuse c", lambda: refusal in a.stderr())
    wait_until("c to hear why", lambda: refusal in c.stderr())
    on_a = [ln.split(": ", 1)[1] for ln in a.stderr().splitlines() if "refused handshake from" in ln]
    assert on_a
    assert all(ln.startswith("refused handshake from 127.0.0.1:") for ln in on_a)
    assert all("(membership): peer " in ln and refusal in ln for ln in on_a)
    on_c = [ln for ln in c.stderr().splitlines() if "refused" in ln and refusal in ln]
    assert "remote refused the handshake (membership)" in on_c[0]
    assert a.connected() == [peer_b]
    assert c.connected() == []
    assert c.proc.wait(timeout=60) == 2  # its only join address refused it for good: it stops
    assert c.stop() == 2
    assert "cannot join the swarm: join " in c.stderr() and "(membership)" in c.stderr().splitlines()[-1]
    for node in (b, a):
        assert node.stop() == 0
