"""Priced identities (issue: open swarms, "identities cost something"), over the in-memory network on
the real clock (the work is done in a thread).

What is proved here: a host in a run that asks for id work refuses a dialer whose id carries none (the
hostile dialer that finishes anyway is refused with the reason); an honest dialer that lacks the work is
told how much the listener asks, does it once, and gets in; and a node started with the work connects
at once; DHT records count only when their authors' ids carry the work. Without the setting, nothing
changes (the rest of the suite).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.dht.protocol import STORE, StoreReq, encode_entries
from p2ptrain.dht.records import key_id, make_entry, owned_subkey
from p2ptrain.errors import P2PError
from p2ptrain.identity import Identity
from p2ptrain.idwork import find_work, work_bits
from p2ptrain.net import HostConfig, MemoryNetwork
from p2ptrain.net import handshake as hs
from tests.harness.identities import identity

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
    from p2ptrain.node import id_work as _id_work

    me = Identity.from_seed(bytes([9]) * 32)
    nonce = _id_work(me, BITS, tmp_path)
    assert work_bits(me.peer_id, nonce) >= BITS
    assert (tmp_path / "identity.work").read_text().strip() == nonce.hex()
    (tmp_path / "identity.work").write_text(find_work(me.peer_id, BITS, start=1 << 40).hex())
    assert _id_work(me, BITS, tmp_path) != nonce  # read back, not searched again
    (tmp_path / "identity.work").write_text("not hex")
    assert work_bits(me.peer_id, _id_work(me, BITS, tmp_path)) >= BITS  # a broken file: found anew


# ---- DHT records: every author pays for its id ------------------------------------------------------


@asynccontextmanager
async def _worked_swarm(n: int) -> AsyncIterator[list[Node]]:
    """``n`` nodes of a run that asks for ``BITS`` of id work, the others joining through the first."""
    net = MemoryNetwork(seed=5)
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i in range(n):
            config = NodeConfig(
                run_id="worked",
                listen=((f"w{i}", 4000),),
                join=(nodes[0].addresses[0],) if nodes else (),
                host=HostConfig(id_work=BITS),
            )
            node = Node(identity(f"w{i}"), config, transport=net.transport(f"w{i}"), clock=trio.current_time)
            nodes.append(await nursery.start(node.run))
        for node in nodes:
            await node.dht.bootstrapped.wait()
        yield nodes
        nursery.cancel_scope.cancel()


async def test_records_by_authors_without_id_work_are_refused_even_when_a_worked_peer_relays_them() -> None:
    """The handshake prices the id of the peer that sends a STORE, not of the authors of the entries it
    carries: one worked id could fill keys with the entries of a thousand fresh keys. In a run that
    asks for id work every entry is signed and carries its author's nonce; stores and readers check it."""
    with trio.fail_after(60):
        async with _worked_swarm(3) as (w0, w1, w2):
            fresh = identity("fresh")  # a key generated a moment ago: no work on it
            borrowed = w1.host.work  # (a worked peer's nonce: bound to that peer's id, not to this one)
            now = trio.current_time()
            entries = [
                make_entry(b"k", b"unsigned", now + 60, subkey=b"a"),
                make_entry(b"k", b"no work", now + 60, subkey=b"b", signer=fresh),
                make_entry(b"k", b"borrowed", now + 60, subkey=b"c", signer=fresh, cert=borrowed or b""),
                make_entry(
                    b"k", b"relayed", now + 60, subkey=b"d", signer=w0.identity, cert=w0.host.work or b""
                ),
            ]
            conn = await w1.host.connect(w2.addresses[0])
            resp = await conn.call(STORE, StoreReq(None), body=encode_entries(entries), timeout=10)
            assert resp.stored == 1  # the worked author's entry, relayed by another peer
            assert "unsigned record" in resp.refused[0]
            assert (
                f"the id {fresh.peer_id} carries 0 bits of work, this run asks for {BITS}" in resp.refused[1]
            )
            assert "this run asks for" in resp.refused[2]
            assert [e.value for e in w2.dht.records.get(key_id(b"k"), now)] == [b"relayed"]

            # a replica that does not check (a modified client) serves them anyway: readers drop them
            w2.dht.records.membership = None
            w2.dht.records.put(entries[1], now, None)
            got = await w0.dht.get(b"k")
            assert [v.value for v in got.values()] == [b"relayed"]

            # the nodes' own writes carry their work and are kept
            assert await w1.dht.store(b"mine", b"v", ttl=60, subkey=owned_subkey(w1.peer_id), sign=True)
            assert [v.value for v in (await w0.dht.get(b"mine")).values()] == [b"v"]
