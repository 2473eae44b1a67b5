"""Pulls (``DHT.get(via=...)``): a reader first asks a fellow reader of the key for the newer entries it
holds, then the replicas, naming everything it then holds. The invariant: **a fellow reader changes what
the replicas send, never what a read returns**, whatever it answers. Over the in-memory network, on the
virtual clock."""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.dht import DHTConfig, key_id, owned_subkey
from p2ptrain.dht.protocol import PULL, PullReq, PullResp, encode_entries
from p2ptrain.dht.records import make_entry
from p2ptrain.net.rpc import CallContext, Reply
from tests.harness.dht import open_swarm
from tests.integration.test_dht_lean_reads import count_entries

KEY = b"run/pulls/progress"
# Few replicas, so that the readers below are not replicas themselves (a replica holds what is stored)
CONFIG = DHTConfig(k=8, replication=3, get_quorum=3)
AUTHORS = 6
pytestmark = pytest.mark.timeout(180)


async def swarm_of(swarm, n: int):  # type: ignore[no-untyped-def]
    return [await swarm.start(f"p{i}", [swarm.nodes[0].address] if swarm.nodes else []) for i in range(n)]


async def publish(authors, version: str, ttl: float = 600) -> dict[bytes, bytes]:  # type: ignore[no-untyped-def]
    """Each of ``authors`` stores a new version of its entry (a virtual second later than the last:
    of two versions with one expiry, the merge keeps the larger value, not the later one)."""
    await trio.sleep(1)
    out = {}
    for a in authors:
        sub, value = owned_subkey(a.host.peer_id), f"{a.name}-{version}".encode()
        assert await a.dht.store(KEY, value, ttl=ttl, subkey=sub, sign=True) >= 1
        out[sub] = value
    return out


def readers_of(nodes, authors):  # type: ignore[no-untyped-def]
    """Nodes that hold no replica of the key (a replica's reads start from what was stored there)."""
    kid = key_id(KEY)
    return [n for n in nodes if n not in authors and not n.dht.records.get(kid, trio.current_time())]


async def test_a_fellow_reader_that_read_the_changes_spares_the_replicas(autojump_clock: object) -> None:
    with trio.fail_after(300):
        async with open_swarm(CONFIG) as swarm:
            nodes = await swarm_of(swarm, 12)
            authors = nodes[:AUTHORS]
            await publish(authors, "0")
            reader, fellow, twin = readers_of(nodes, authors)[:3]
            for n in (reader, fellow, twin):
                assert len(await n.dht.get(KEY)) == AUTHORS
            truth = await publish(authors, "1")
            assert {s: e.value for s, e in (await fellow.dht.get(KEY)).items()} == truth

            brought = count_entries(reader.dht)
            got = await reader.dht.get(KEY, via=[fellow.address])
            assert {s: e.value for s, e in got.items()} == truth
            assert brought and sum(brought) == 0, brought  # every changed entry came from the fellow
            assert fellow.host.sent_by_method().get("dht.pull", 0) > 0

            brought = count_entries(twin.dht)  # the same read without a fellow: the replicas send all
            got = await twin.dht.get(KEY)
            assert {s: e.value for s, e in got.items()} == truth
            assert sum(brought) >= AUTHORS, brought  # (a lookup's replicas, asked at once, each send all)

            # A reader whose fellow read nothing newer still reads every change from the replicas.
            truth = await publish(authors, "2")
            brought = count_entries(reader.dht)
            got = await reader.dht.get(KEY, via=[twin.address])
            assert {s: e.value for s, e in got.items()} == truth
            assert sum(brought) >= AUTHORS, brought  # (a lookup's replicas, asked at once, each send all)


async def test_a_pull_refreshes_the_subkeys_the_last_read_brought_and_no_other(
    autojump_clock: object,
) -> None:
    """Between reads of the replicas, pulls keep a reader's view whole: a record whose entry here
    expired before its next version came is refreshed by the next pull (the last read brought its
    subkey), while a subkey no read brought comes only through the replicas."""
    with trio.fail_after(300):
        async with open_swarm(CONFIG) as swarm:
            nodes = await swarm_of(swarm, 12)
            authors, newcomer = nodes[:AUTHORS], nodes[AUTHORS]
            await publish(authors, "0", ttl=10)
            reader, fellow = readers_of(nodes, nodes[: AUTHORS + 1])[:2]
            assert len(await reader.dht.get(KEY)) == AUTHORS
            await trio.sleep(10)  # every entry the reader holds expired
            assert not reader.dht.held(KEY)
            truth = await publish(authors, "1", ttl=10)
            truth |= await publish([newcomer], "1", ttl=10)
            assert {s: e.value for s, e in (await fellow.dht.get(KEY)).items()} == truth

            assert await reader.dht.pull(KEY, [fellow.address]) == AUTHORS
            held = {s: e.value for s, e in reader.dht.held(KEY).items()}
            assert held == {s: v for s, v in truth.items() if s != owned_subkey(newcomer.host.peer_id)}
            got = await reader.dht.get(KEY)  # the newcomer's subkey: from the replicas
            assert {s: e.value for s, e in got.items()} == truth


ATTACKS = ("honest", "silent", "stale", "forged", "new_subkey", "unowned", "other_key", "far", "hang", "junk")


@pytest.mark.parametrize("seed", [0, 1])
async def test_whatever_a_fellow_reader_answers_a_read_returns_the_replicas_latest(
    autojump_clock: object, seed: int
) -> None:
    """A hostile fellow reader answers each pull with a random mix of: nothing, old genuine versions,
    entries of the authors' subkeys signed by itself, a subkey of its own, unowned entries, another
    key's entries, expiries past any store's limit, undecodable bytes, or no answer at all (or the
    truth). Every read still returns exactly the latest version the replicas hold of every author's
    entry, and nothing else."""
    rng = random.Random(seed)
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            nodes = await swarm_of(swarm, 12)
            authors = nodes[:AUTHORS]
            truth = await publish(authors, "0")
            readers = readers_of(nodes, authors)
            reader, liar = readers[0], readers[1]
            seen: list = []  # every genuine entry the liar read, old versions too
            for n in (reader, liar):
                got = await n.dht.get(KEY)
                seen.extend(got.values())
            attacks: list[str] = []

            async def answer(ctx: CallContext, req: PullReq) -> Reply[PullResp]:
                now, me = trio.current_time(), liar.host.identity
                mine = owned_subkey(me.peer_id)
                out: list = []
                for attack in attacks:
                    if attack == "honest":
                        out += list((liar.dht.held(KEY)).values())
                    elif attack == "stale":
                        out += rng.sample(seen, min(len(seen), 8))
                    elif attack == "forged":
                        out += [make_entry(KEY, b"forged", now + 500, subkey=sub, signer=me) for sub in truth]
                    elif attack == "new_subkey":
                        out.append(make_entry(KEY, b"mine", now + 500, subkey=mine, signer=me))
                    elif attack == "unowned":
                        out.append(make_entry(KEY, b"anyone's", now + 500, subkey=b"free"))
                    elif attack == "other_key":
                        out.append(make_entry(b"other", b"x", now + 500, subkey=mine, signer=me))
                    elif attack == "far":
                        out.append(make_entry(KEY, b"forever", now + 10**7, subkey=mine, signer=me))
                    elif attack == "hang":
                        await trio.sleep(3600)
                    elif attack == "junk":
                        return Reply(PullResp(), b"\xc1not msgpack")
                return Reply(PullResp(), encode_entries(out))

            liar.host.registry.replace(PULL, answer)
            for step in range(1, 25):
                changed = rng.sample(authors, rng.randint(0, AUTHORS))
                truth |= await publish(changed, str(step))
                if rng.random() < 0.5:  # the liar keeps reading: its old genuine versions pile up
                    seen.extend((await liar.dht.get(KEY)).values())
                attacks[:] = rng.sample(ATTACKS, rng.randint(1, 3))
                got = await reader.dht.get(KEY, via=[liar.address])
                assert {s: e.value for s, e in got.items()} == truth, (step, attacks)
                assert reader.dht.held(KEY).keys() == truth.keys(), (step, attacks)
