"""A private run, end to end in one trio run: Nodes over the in-memory network on the virtual clock.

What is proved here: members with certificates from the run's authority form the DHT, see each other in
the peer list and average exactly; a node without a certificate (open, or private without one of its
own) cannot join: both sides log the ``membership`` refusal and no record of it appears anywhere; a
record written by a non-member and relayed by a member is refused on STORE, and one served by a
careless replica is dropped by the reader; a member whose certificate expires loses its connections
and its records, and cannot come back; and a round whose manifest names a non-member cannot reach it
and leaves it out as unreachable: the members commit without it, it aborts with its tensors untouched.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.authority import issue_certificate
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.averaging.averager import schema_of
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, SignedManifest
from p2ptrain.dht.peers import list_members
from p2ptrain.dht.protocol import STORE, StoreReq, encode_entries
from p2ptrain.dht.records import Entry, key_id, make_entry
from p2ptrain.errors import ConfigError, HandshakeRefused, RoundAborted
from p2ptrain.identity import Identity
from p2ptrain.net import MemoryNetwork
from tests.harness.identities import identity

RUN = "private"
PORT = 4000
DAY = 86400.0
AUTH = Identity.from_seed(b"\x0a" * 32)
OTHER_AUTH = Identity.from_seed(b"\x0b" * 32)
HOST_LOG, NODE_LOG, DHT_LOG = "p2ptrain.net.host", "p2ptrain.node", "p2ptrain.dht.service"


def cert(name: str, *, expires: float = DAY, by: Identity = AUTH, run: str = RUN) -> bytes:
    return issue_certificate(by, identity(name).peer_id, not_before=0.0, expires=expires, run=run)


@dataclass
class Swarm:
    net: MemoryNetwork
    nursery: trio.Nursery
    nodes: dict[str, Node]

    async def start(
        self,
        name: str,
        *,
        certificate: bytes | None = None,
        private: bool = True,
        join: str | None = None,
        avg: AveragerConfig | None = None,
        authority: bytes = AUTH.public_key,
    ) -> Node:
        config = NodeConfig(
            run_id=RUN,
            listen=((name, PORT),),
            join=(self.nodes[join].addresses[0],) if join else (),
            averaging=avg or AveragerConfig(),
            authority=authority if private else None,
            certificate=certificate,
            members_interval=2.0,
        )
        node = Node(identity(name), config, transport=self.net.transport(name), clock=trio.current_time)
        self.nodes[name] = await self.nursery.start(node.run)
        return node


@asynccontextmanager
async def private_swarm(n: int, avg: AveragerConfig | None = None) -> AsyncIterator[Swarm]:
    """``n`` certified members, m0 first and the others joining through it, all bootstrapped."""
    async with trio.open_nursery() as nursery:
        swarm = Swarm(MemoryNetwork(seed=9), nursery, {})
        for i in range(n):
            await swarm.start(f"m{i}", certificate=cert(f"m{i}"), join="m0" if i else None, avg=avg)
        for node in swarm.nodes.values():
            await node.dht.bootstrapped.wait()
        yield swarm
        nursery.cancel_scope.cancel()


async def wait_members(node: Node, count: int) -> None:
    """Until the node's view of the peer list (refreshed every ``members_interval``) has ``count``."""
    while True:
        if len(node.members) == count:
            return
        await trio.sleep(0.5)


def authored_by(swarm: Swarm, who: Identity) -> list[Entry]:
    """Every record held anywhere in the swarm that ``who`` signed."""
    return [
        e
        for node in swarm.nodes.values()
        for e in node.dht.records.contents()
        if e.public_key == who.public_key
    ]


def messages(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and text in r.getMessage()]


# ---- members ------------------------------------------------------------------------------------


async def test_members_form_the_dht_see_each_other_and_average(autojump_clock):
    avg = AveragerConfig(target_size=3, min_size=3, matchmaking_time=3.0)
    async with private_swarm(3, avg) as swarm:
        nodes = list(swarm.nodes.values())
        with trio.fail_after(120):
            for node in nodes:
                await wait_members(node, 3)
            inputs = [[torch.full((100,), float(i))] for i in range(3)]
            results: list[RoundResult | None] = [None] * 3

            async def one(i: int) -> None:
                results[i] = await nodes[i].average(inputs[i], timeout=20.0)

            async with trio.open_nursery() as n:
                for i in range(3):
                    n.start_soon(one, i)
        for r in results:
            assert isinstance(r, RoundResult)
            assert len(r.contributors) == 3
        for t in inputs:
            assert torch.equal(t[0], torch.full((100,), 1.0))
        # Every record a member wrote carries its certificate (others can check it after any relay).
        for node in nodes:
            mine = authored_by(swarm, node.identity)
            assert mine
            assert all(e.cert == node.config.certificate for e in mine)
        for node in nodes:
            conns = node.host.connections()
            assert conns
            assert all(c.peer in {m.peer_id for m in nodes} for c in conns)


# ---- non-members --------------------------------------------------------------------------------


@pytest.mark.parametrize("private", [False, True], ids=["open-node", "private-without-cert"])
async def test_a_node_without_a_certificate_cannot_join(autojump_clock, caplog, private):
    caplog.set_level(logging.INFO)
    async with private_swarm(2) as swarm:
        with trio.fail_after(120):
            for node in swarm.nodes.values():
                await wait_members(node, 2)
            outsider = await swarm.start("outsider", private=private, join="m0")
            await trio.sleep(30)
        stranger = identity("outsider")
        # The listener refused it, and said why; the outsider's log has the same reason.
        refused = messages(caplog, HOST_LOG, "(membership)")
        assert any(m.startswith("refused handshake from outsider") for m in refused), refused
        reason = f"peer {stranger.peer_id} has no membership certificate"
        assert any(reason in m for m in refused)
        join_refused = messages(caplog, NODE_LOG, "refused")
        assert any("remote refused the handshake (membership)" in m and reason in m for m in join_refused)
        # It is nowhere: no connection, no record, not in any peer list.
        assert not outsider.dht.bootstrapped.is_set()
        assert outsider.host.connections() == []
        for node in swarm.nodes.values():
            assert stranger.peer_id not in {c.peer for c in node.host.connections()}
            assert stranger.peer_id not in {m.peer_id for m in node.members}
        assert authored_by(swarm, stranger) == []


async def test_a_member_refuses_to_dial_a_listener_without_a_certificate(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    async with private_swarm(1) as swarm:
        outsider = await swarm.start("outsider", private=False)
        with trio.fail_after(30), pytest.raises(HandshakeRefused) as info:
            await swarm.nodes["m0"].host.connect(outsider.addresses[0])
        assert info.value.code == "membership"
        assert not info.value.by_remote
        assert messages(caplog, HOST_LOG, "refused to connect (membership)")
        assert messages(caplog, HOST_LOG, "refused our handshake (membership)")  # the outsider's side


async def test_members_of_another_private_swarm_with_the_same_run_id_are_refused(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    async with private_swarm(1) as swarm:
        foreigner = await swarm.start(
            "foreigner", certificate=cert("foreigner", by=OTHER_AUTH), authority=OTHER_AUTH.public_key
        )
        with trio.fail_after(30), pytest.raises(HandshakeRefused) as info:
            await foreigner.host.connect(swarm.nodes["m0"].addresses[0])
        assert info.value.code == "membership"
        assert "another authority" in info.value.reason
        assert messages(caplog, HOST_LOG, "refused our handshake (membership)")  # m0's side
        assert foreigner.host.connections() == []


def test_a_node_refuses_to_start_with_an_unusable_certificate():
    for certificate, reason in [
        (cert("m0", run="another-run"), "is for run 'another-run'"),
        (cert("someone-else"), "is for peer"),
        (cert("m0", by=OTHER_AUTH), "another authority"),
        (b"junk", "malformed"),
    ]:
        config = NodeConfig(run_id=RUN, authority=AUTH.public_key, certificate=certificate)
        with pytest.raises(ConfigError, match=reason):
            Node(identity("m0"), config, transport=MemoryNetwork().transport("m0"), clock=lambda: 10.0)
    config = NodeConfig(run_id=RUN, certificate=cert("m0"))
    with pytest.raises(ConfigError, match="needs the run's authority"):
        Node(identity("m0"), config, transport=MemoryNetwork().transport("m0"))


# ---- records --------------------------------------------------------------------------------------


async def test_records_written_by_non_members_are_refused_even_when_a_member_relays_them(
    autojump_clock, caplog
):
    caplog.set_level(logging.INFO, logger=DHT_LOG)
    async with private_swarm(3) as swarm:
        relay, holder = swarm.nodes["m1"], swarm.nodes["m2"]
        carol, member = identity("carol"), swarm.nodes["m0"].identity
        now = trio.current_time()
        entries = [
            make_entry(b"k", b"unsigned", now + 60, subkey=b"a"),
            make_entry(b"k", b"no cert", now + 60, subkey=b"b", signer=carol),
            make_entry(b"k", b"borrowed", now + 60, subkey=b"c", signer=carol, cert=cert("m1")),
            make_entry(
                b"k", b"foreign", now + 60, subkey=b"d", signer=carol, cert=cert("carol", by=OTHER_AUTH)
            ),
            make_entry(b"k", b"relayed", now + 60, subkey=b"e", signer=member, cert=cert("m0")),
        ]
        with trio.fail_after(30):
            conn = await relay.host.connect(holder.addresses[0])
            resp = await conn.call(STORE, StoreReq(None), body=encode_entries(entries), timeout=10)
        assert resp.stored == 1  # only the member's own entry, relayed by another member
        assert len(resp.refused) == 4
        assert "unsigned record" in resp.refused[0]
        assert f"peer {carol.peer_id} has no membership certificate" in resp.refused[1]
        assert f"author {carol.peer_id}: membership certificate is for peer" in resp.refused[2]
        assert "another authority" in resp.refused[3]
        assert [e.value for e in holder.dht.records.get(key_id(b"k"), now)] == [b"relayed"]
        assert messages(caplog, DHT_LOG, f"refused 4 record(s) from {relay.peer_id.short()}")
        assert authored_by(swarm, carol) == []


async def test_readers_drop_non_member_records_a_careless_replica_serves(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger=DHT_LOG)
    async with private_swarm(3) as swarm:
        reader = swarm.nodes["m0"]
        carol = identity("carol")
        now = trio.current_time()
        bad = make_entry(b"key", b"forged", now + 60, signer=carol)
        for node in swarm.nodes.values():
            if node is not reader:  # replicas that do not check (as a modified client would not)
                node.dht.records.membership = None
                node.dht.records.put(bad, now, None)
        with trio.fail_after(30):
            got = await reader.dht.get(b"key", quorum=2)
        assert got == {}
        assert messages(caplog, DHT_LOG, "has no membership certificate")


# ---- expiry ---------------------------------------------------------------------------------------


async def test_a_member_whose_certificate_expires_is_dropped_and_cannot_come_back(autojump_clock, caplog):
    caplog.set_level(logging.INFO)
    async with private_swarm(2) as swarm:
        with trio.fail_after(600):
            short = await swarm.start("short", certificate=cert("short", expires=100.0), join="m0")
            await short.dht.bootstrapped.wait()
            await wait_members(swarm.nodes["m0"], 3)
            assert trio.current_time() < 100.0
            await trio.sleep(100.0 - trio.current_time())
            await trio.sleep(30)
            # Its connections were closed at expiry, its records are no longer served or listed.
            m0, m1 = swarm.nodes["m0"], swarm.nodes["m1"]
            assert all(c.peer != short.peer_id for n in (m0, m1) for c in n.host.connections())
            members = await list_members(m1.dht, RUN)
            assert short.peer_id not in {m.peer_id for m in members}
        assert messages(caplog, HOST_LOG, "its membership certificate expired")
        refused = messages(caplog, HOST_LOG, "(membership)")
        assert any("membership certificate expired on 1970-01-01 00:01:40 UTC" in m for m in refused), refused


# ---- rounds -------------------------------------------------------------------------------------


async def test_a_manifest_naming_a_non_member_ends_cleanly(autojump_clock, caplog):
    caplog.set_level(logging.INFO)
    async with private_swarm(2) as swarm:
        outsider = await swarm.start("outsider", private=True)  # a private node without a certificate
        group = [swarm.nodes["m0"], swarm.nodes["m1"], outsider]
        tensors = [[torch.full((90,), float(i))] for i in range(3)]
        originals = [[t.clone() for t in ts] for ts in tensors]
        schema = schema_of(tensors[0])
        manifest = Manifest(
            round_id=b"\x07" * 16,
            group_key="test",
            members=tuple(MemberMsg(n.peer_id.digest, str(n.addresses[0]), 1.0) for n in group),
            sizes=tuple(partition_sizes(90, [1.0] * 3, [True] * 3)),
            schema=schema,
            compression="none",
            timeout=20.0,
        )
        signed = SignedManifest.sign(group[0].identity, manifest)  # a leader naming a non-member
        outcomes: list[RoundResult | RoundAborted | None] = [None] * 3

        async def one(i: int) -> None:
            try:
                outcomes[i] = await group[i].averager.run_round(signed, tensors[i])
            except RoundAborted as e:
                outcomes[i] = e

        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                for i in range(3):
                    n.start_soon(one, i)
        assert isinstance(outcomes[2], RoundAborted)  # the non-member reaches nobody
        assert torch.equal(tensors[2][0], originals[2][0])
        # The members cannot reach it either: it is left out as unreachable, they commit without it.
        for o in outcomes[:2]:
            assert isinstance(o, RoundResult), outcomes
            assert o.contributors == [group[0].peer_id, group[1].peer_id]
            assert outsider.peer_id in o.excluded
        assert torch.equal(tensors[0][0], torch.full((90,), 0.5))
        assert torch.equal(tensors[1][0], tensors[0][0])
        assert messages(caplog, HOST_LOG, "refused to connect (membership)")
