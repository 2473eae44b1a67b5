"""Hole punching behind home routers that answer a stranger's SYN with a reset (``NatLab(router="reset")``,
real ``p2ptrain node`` processes behind real MASQUERADE routers).

Such a router answers a SYN addressed to itself that no entry of its own expects with a TCP reset, and
the reset, passing the other router, closes the entry that router's own host's attempt had opened. Before,
the two home peers dialed each other from their listening ports, the answering peer 50 ms first: its SYN
reached the other router before that one had an entry for it, was reset, and so was every later attempt
(both sides redialed in step): "hole punch with ... failed: staying relayed", every time. So when the
public peer (their only relay) left, the homes lost each other. Now each side's first SYN has a low TTL
(it opens its own router's entry and dies on the way), the dialer tells the peer to dial only once its own
dial is out, and the SYNs' retransmissions meet (``p2ptrain.net.punch``).

Runs only where the lab can be built (root, iproute2, iptables, network namespaces); skipped elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simulations.labs.natlab import NatLab, relay_join, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _logs(tmp_path: Path) -> dict[str, str]:
    return {p.name: p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.log")}


@pytest.mark.timeout(600)
def test_home_peers_behind_resetting_routers_punch_to_each_other(tmp_path: Path) -> None:
    """1 public + 2 home peers; home 2 joins through home 1's relayed address, then the two punch. (Before:
    "staying relayed".)"""
    report = relay_join(tmp_path, timeout=240.0, router="reset")
    assert report["home1_relayed"] and report["home2_joined_s"] is not None, (report, _logs(tmp_path))
    assert report["home2_punch"] == "direct", (report, _logs(tmp_path))
    assert report["ok"]


@pytest.mark.timeout(600)
def test_home_peers_stay_connected_directly_when_the_public_peer_leaves(tmp_path: Path) -> None:
    """After the punch the public peer (the homes' only relay) stops: the two homes still hold their
    direct connection 30 s later. (Before: they had only the relay, and lost each other with it.)"""
    report = relay_join(tmp_path, timeout=240.0, router="reset", leave_s=30.0)
    assert report["home2_punch"] == "direct", (report, _logs(tmp_path))
    assert report["homes_direct_after_public_left_s"] is not None, (report, _logs(tmp_path))
    assert report["ok"]


# Dials the other home's router from port 4001 with a primed (low-TTL) first SYN, as a punch does, and
# says whether the connected socket is left signalled in error (what epoll reports at once).
_PRIMED = """
import select, sys, trio
from p2ptrain.net.transport import TcpTransport
async def main():
    await trio.sleep(float(sys.argv[2]))
    with trio.fail_after(30):
        stream = await TcpTransport().connect_primed(sys.argv[1], 4001, local_port=4001, ttl=2)
    ep = select.epoll()
    ep.register(stream.socket.fileno(), select.EPOLLIN)
    print("error" if any(ev & select.EPOLLERR for _, ev in ep.poll(0.2)) else "clean", flush=True)
    await trio.sleep(1.0)  # (the other side reads its own before this one closes)
trio.run(main)
"""


@pytest.mark.timeout(120)
def test_a_punched_socket_is_not_left_signalled_in_error() -> None:
    """The dead first SYN's ICMP "time exceeded" is queued on the dialing socket's error queue; while it
    stays there epoll reports the socket in error for good, and a reader waiting for data wakes at once
    with nothing to read: before, each home peer's event loop spun on its punched connection, taking a
    core for the connection's life (training at half speed, rounds 1.36-1.54x slower than all-public in
    the NAT lab). The primed dial reads the queue off before handing the connection out."""
    with NatLab(2, router="reset") as lab:
        procs = [
            lab.popen_in(
                lab.home_ns[i],
                [sys.executable, "-c", _PRIMED, lab.router_address(2 - i), str(0.3 * i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in (0, 1)
        ]
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["clean", "clean"], outs
