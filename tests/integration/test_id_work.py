"""Priced identities (issue: open swarms, "identities cost something"), over the in-memory network on
the real clock (the work is done in a thread).

What is proved here: a host in a run that asks for id work refuses a dialer whose id carries none (the
hostile dialer that finishes anyway is refused with the reason); an honest dialer that lacks the work is
told how much the listener asks, does it once, and gets in; and a node started with the work connects
at once. Without the setting, nothing changes (the rest of the suite).
"""

from __future__ import annotations

import pytest
import trio

from p2ptrain.errors import P2PError
from p2ptrain.idwork import find_work, work_bits
from p2ptrain.net import HostConfig
from p2ptrain.net import handshake as hs

BITS = 12


async def test_a_dialer_without_the_work_does_it_once_and_gets_in(mem_cluster, kit) -> None:
    with trio.fail_after(60):
        server = await mem_cluster.start(config=HostConfig(id_work=BITS))
        assert work_bits(server.host.peer_id, server.host.work) >= BITS  # found at start
        tool = await mem_cluster.start("198.18.1.1")  # a command-line tool: no run file, no work
        assert tool.host.work is None
        conn = await tool.host.connect(server.address)
        assert (await conn.call(kit.ECHO, kit.Text("in"))).text == "in"
        assert work_bits(tool.host.peer_id, tool.host.work) >= BITS  # done on demand, kept


async def test_a_dialer_that_ignores_the_price_is_refused(
    mem_cluster, kit, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(hs.InitiatorHandshake, "_check_own_work", lambda self, needs: None)
    with trio.fail_after(60):
        server = await mem_cluster.start(config=HostConfig(id_work=BITS))
        careless = await mem_cluster.start("198.18.1.2")
        with pytest.raises(P2PError):
            conn = await careless.host.connect(server.address)
            await conn.call(kit.ECHO, kit.Text("in"))
    assert "dialer's id carries 0 bits of work, this run asks for 12" in caplog.text


def test_a_node_finds_its_id_work_once_and_keeps_it_with_its_key(tmp_path) -> None:
    from p2ptrain.identity import Identity
    from p2ptrain.train_cli import _id_work

    me = Identity.from_seed(bytes([9]) * 32)
    nonce = _id_work(me, BITS, tmp_path)
    assert work_bits(me.peer_id, nonce) >= BITS
    assert (tmp_path / "identity.work").read_text().strip() == nonce.hex()
    (tmp_path / "identity.work").write_text(find_work(me.peer_id, BITS, start=1 << 40).hex())
    assert _id_work(me, BITS, tmp_path) != nonce  # read back, not searched again
    (tmp_path / "identity.work").write_text("not hex")
    assert work_bits(me.peer_id, _id_work(me, BITS, tmp_path)) >= BITS  # a broken file: found anew
