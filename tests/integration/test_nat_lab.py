"""The NAT lab (``simulations.labs.natlab``), with real ``p2ptrain node`` processes behind real MASQUERADE
routers: a home node that nobody can dial prints an address through the public peer, and a second home
user who pastes only that address gets into the swarm (the first home node through the relay, then the
public peer); the two home nodes then punch a hole and connect directly (endpoint-independent routers),
or stay relayed (symmetric ones).

Runs only where the lab can be built (root, iproute2, iptables, network namespaces); skipped elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simulations.labs.natlab import PUBLIC, NatLab, _node, relay_join, unavailable
from simulations.labs.netns import list_namespaces, read_line

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("symmetric", [False, True], ids=["endpoint-independent", "symmetric"])
def test_a_home_user_joins_through_another_home_users_relayed_address(tmp_path: Path, symmetric) -> None:
    report = relay_join(tmp_path, timeout=240.0, symmetric=symmetric)
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log")}
    assert report["home1_relayed"], (report, logs)
    assert report["home1_address"].startswith(f"/ip4/{PUBLIC}/tcp/4001/p2p/"), report
    assert report["home2_joined_s"] is not None and report["home2_met_public_s"] is not None, (report, logs)
    assert "/p2p-circuit/" in report["home2_address"], report  # it is behind a NAT too
    assert report["home2_punch"] == ("relayed" if symmetric else "direct"), (report, logs)
    assert report["ok"]


@pytest.mark.timeout(300)
def test_average_behind_a_nat_prints_its_relayed_address(tmp_path: Path) -> None:
    """``p2ptrain average`` prints what others can dial, as ``node`` does (before: its LAN address)."""
    with NatLab(1) as lab:
        public = _node(lab, lab.public, tmp_path, "public", "--listen", f"{PUBLIC}:4001")
        p_addr = read_line(public, 120).strip()
        argv = [sys.executable, "-m", "p2ptrain", "average", "--run-id", "natlab", "--listen", "0.0.0.0:4001"]
        argv += ["--join", p_addr, "--rounds", "1", "--timeout", "60", "--data-dir", str(tmp_path / "home")]
        quiet = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True}
        home = lab.popen_in(lab.home_ns[0], argv, **quiet)
        printed = read_line(home, 120).strip()
        assert printed.startswith(f"/ip4/{PUBLIC}/tcp/4001/p2p/") and "/p2p-circuit/p2p/" in printed, printed
        for proc in (home, public):
            proc.terminate()
            proc.wait(60)


@pytest.mark.timeout(120)
def test_the_lab_leaves_nothing_behind() -> None:
    with NatLab(1) as lab:
        names = list(lab._created)
        assert all(n in list_namespaces() for n in names)
    assert not any(n in list_namespaces() for n in names)
