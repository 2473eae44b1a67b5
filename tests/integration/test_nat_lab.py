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
@pytest.mark.parametrize(
    ("symmetric", "router"),
    [(False, "drop"), (True, "drop"), (True, "reset")],
    ids=["endpoint-independent", "symmetric", "symmetric-reset"],
)
def test_a_home_user_joins_through_another_home_users_relayed_address(
    tmp_path: Path, symmetric, router
) -> None:
    """(Endpoint-independent routers that answer with a reset: ``test_nat_reset``.)"""
    report = relay_join(tmp_path, timeout=240.0, symmetric=symmetric, router=router)
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


def _syn_from_outside(lab: NatLab, to: str) -> str:
    """What a SYN from the public peer to ``to``:4001 gets: "reset", "dropped" or "connected"."""
    probe = (
        "import socket\n"
        "s = socket.socket(); s.settimeout(3)\n"
        "try:\n"
        f"    s.connect(({to!r}, 4001)); print('connected')\n"
        "except ConnectionRefusedError: print('reset')\n"
        "except TimeoutError: print('dropped')\n"
    )
    done = lab.popen_in(lab.public, [sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
    out, _ = done.communicate(timeout=60)
    return out.strip()


@pytest.mark.timeout(180)
def test_routers_of_the_resetting_kind_answer_a_strangers_syn_with_a_reset() -> None:
    """``router="reset"``: a SYN from outside to the router's own address gets a reset (as from most home
    routers); ``router="drop"``: it is dropped silently. Neither lets it through to the home peer."""
    for router, expected in (("reset", "reset"), ("drop", "dropped")):
        with NatLab(1, router=router) as lab:
            listener = lab.popen_in(
                lab.home_ns[0],
                [
                    sys.executable,
                    "-c",
                    "import socket,time; s=socket.create_server(('0.0.0.0', 4001)); time.sleep(60)",
                ],
            )
            try:
                assert _syn_from_outside(lab, lab.router_address(1)) == expected, router
            finally:
                listener.kill()
