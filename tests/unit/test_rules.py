"""A member's checks of a leader's manifest (``averaging.rules``), table-driven.

What is proved here: the manifest an honest leader builds passes; a manifest that changes any rule of
the run (group key, tensors, compression, aggregation, audit, timeout), lists the member under another
address, hands out partitions other than the bandwidths' shares, lists bandwidths outside the partition
rule, or lists a member above the bandwidth it announced is refused, and the error says which.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from p2ptrain.averaging.bandwidth import MAX_SPREAD, partition_bandwidths
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, TensorSpec
from p2ptrain.averaging.rules import RoundRules, SeenOrigins, check_manifest
from p2ptrain.errors import RemoteProtocolError
from p2ptrain.identity import Identity

PEERS = [Identity.from_seed(hashlib.blake2b(bytes([i]), digest_size=32).digest()).peer_id for i in range(4)]
ADDRS = ["/ip4/198.18.0.1/tcp/1", "/ip4/198.18.1.2/tcp/1", "", "/ip4/198.18.3.4/tcp/1"]  # 2: client-only
ANNOUNCED = {PEERS[0]: 40.0, PEERS[1]: 10.0, PEERS[2]: 0.0, PEERS[3]: 20.0}
SCHEMA = (TensorSpec((1000,), "float32"), TensorSpec((7,), "float32"))
RULES = RoundRules("diloco-5", SCHEMA, "fp16", "trimmed_mean", True, 60.0)


def honest() -> Manifest:
    """What a leader (PEERS[0]) builds from its members' join requests."""
    bandwidths = partition_bandwidths([ANNOUNCED[p] for p in PEERS])
    return Manifest(
        round_id=bytes(16),
        group_key=RULES.group_key,
        members=tuple(MemberMsg(p.digest, a, b) for p, a, b in zip(PEERS, ADDRS, bandwidths, strict=True)),
        sizes=tuple(partition_sizes(1007, bandwidths, [bool(a) for a in ADDRS])),
        schema=SCHEMA,
        compression=RULES.compression,
        timeout=RULES.timeout,
        aggregation=RULES.aggregation,
        audit=RULES.audit,
    )


def check(m: Manifest, me: int = 1, announced: dict | None = None) -> None:
    check_manifest(m, RULES, PEERS[me], ADDRS[me], ANNOUNCED if announced is None else announced)


def listed(m: Manifest, bandwidths: list[float]) -> Manifest:
    members = tuple(dataclasses.replace(mm, bandwidth=b) for mm, b in zip(m.members, bandwidths, strict=True))
    sizes = partition_sizes(m.total, bandwidths, [bool(mm.addr) for mm in members])
    return dataclasses.replace(m, members=members, sizes=tuple(sizes))


def test_an_honest_leaders_manifest_passes_for_every_member() -> None:
    honest().check()
    for me in range(4):
        check(honest(), me)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"aggregation": "mean"}, "aggregation is 'mean'"),
        ({"audit": False}, "audit is False"),
        ({"compression": "int8"}, "compression"),
        ({"timeout": 3600.0}, "timeout"),
        ({"group_key": "diloco-6"}, "group key"),
        ({"schema": (TensorSpec((1007,), "float32"),)}, "tensors"),
    ],
    ids=["aggregation", "audit", "compression", "timeout", "group-key", "schema"],
)
def test_a_manifest_that_changes_a_rule_of_the_run_is_refused(change: dict, why: str) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        check(dataclasses.replace(honest(), **change))


def test_every_partition_to_the_leader_is_refused() -> None:
    m = dataclasses.replace(honest(), sizes=(1007, 0, 0, 0))
    m.check()  # (internally consistent: only the rule catches it)
    with pytest.raises(RemoteProtocolError, match="not the bandwidths' shares"):
        check(m)


def test_a_leader_listed_far_above_the_others_is_refused() -> None:
    m = listed(honest(), [1e15, 10.0, 10.0, 20.0])  # partitions consistent with the inflated bandwidth
    with pytest.raises(RemoteProtocolError, match="do not follow the partition rule"):
        check(m, announced={})
    capped = listed(
        honest(), [MAX_SPREAD * 10.0, 10.0, 10.0, 20.0]
    )  # within the rule: only what was announced
    check(capped, announced={})
    with pytest.raises(RemoteProtocolError, match="more than the 40 it announced"):
        check(capped)


def test_a_member_listed_under_another_address_or_not_at_all_is_refused() -> None:
    m = honest()
    moved = dataclasses.replace(
        m,
        members=(
            m.members[0],
            dataclasses.replace(m.members[1], addr="/ip4/198.18.9.9/tcp/1"),
            *m.members[2:],
        ),
    )
    with pytest.raises(RemoteProtocolError, match="another address"):
        check(moved)
    other = Identity.from_seed(bytes(32)).peer_id
    with pytest.raises(RemoteProtocolError, match="does not list us"):
        check_manifest(m, RULES, other, "", ANNOUNCED)


def test_the_partition_rule_is_its_own_image() -> None:
    """What lets a member check a leader's bandwidths: applying the rule to its output changes nothing."""
    for raw in ([0.0, 0.0, 10.0, 1.0], [0.0, 100.0, 1.0], [1e15, 3.0, 0.0, 7.0, 2.0], [0.0, 0.0], [5.0]):
        out = partition_bandwidths(raw)
        assert partition_bandwidths(out) == out, raw


def test_origins_may_not_merge_members_of_different_subnets() -> None:
    """Origins are the leader's word on who shares a subnet; a member still refuses one that counts
    members listed in different subnets as one (and any origins in a plain mean)."""
    m = same_subnet(honest())  # every listed address in 198.18.0.0/24; member 2 is client-only
    check_in_subnet(dataclasses.replace(m, origins=(0, 0, 0, 0)))
    check_in_subnet(dataclasses.replace(m, origins=(0, 0, 2, 0)))  # (the client-only one: the leader's word)
    far = dataclasses.replace(m.members[3], addr="/ip4/198.18.7.4/tcp/1")
    moved = dataclasses.replace(m, members=(*m.members[:3], far), origins=(0, 0, 0, 0))
    with pytest.raises(RemoteProtocolError, match=r"198\.18\.7\.0/24"):
        check_in_subnet(moved)
    mean = dataclasses.replace(honest(), aggregation="mean", origins=(0, 1, 2, 3))
    with pytest.raises(RemoteProtocolError, match="no origins"):
        check_manifest(mean, dataclasses.replace(RULES, aggregation="mean"), PEERS[1], ADDRS[1], ANNOUNCED)


def same_subnet(m: Manifest) -> Manifest:
    """``m`` with its listed addresses moved into 198.18.0.0/24 (the member checking is PEERS[1])."""
    moved = tuple(
        dataclasses.replace(mm, addr=f"/ip4/198.18.0.{i + 1}/tcp/1" if mm.addr else "")
        for i, mm in enumerate(m.members)
    )
    return dataclasses.replace(m, members=moved)


def check_in_subnet(m: Manifest) -> None:
    check_manifest(m, RULES, PEERS[1], "/ip4/198.18.0.2/tcp/1", ANNOUNCED)


@pytest.mark.parametrize("origins", [(), (0, 1, 2, 3), (0, 1, 1, 1), (0, 0, 2, 3)])
def test_origins_may_not_split_members_of_one_subnet(origins: tuple[int, ...]) -> None:
    """A hostile leader listed one host's fresh keys (one /24) as origins of their own, so that a robust
    rule counted each as a row: members listed in one subnet must share one origin (no origins at all
    say every member is its own). Circuit addresses name the relay's host and are not counted."""
    m = same_subnet(honest())
    with pytest.raises(RemoteProtocolError, match=r"198\.18\.0\.0/24 as several origins"):
        check_in_subnet(dataclasses.replace(m, origins=origins))
    check_in_subnet(dataclasses.replace(m, origins=(0, 0, 2, 0)))
    relay = "/ip4/198.18.0.9/tcp/1/p2p/" + str(PEERS[0])
    circuits = tuple(
        dataclasses.replace(mm, addr=f"{relay}/p2p-circuit/p2p/{p}") if i in (0, 3) else mm
        for i, (mm, p) in enumerate(zip(m.members, PEERS, strict=True))
    )
    check_in_subnet(dataclasses.replace(m, members=circuits, origins=(0, 1, 2, 3)))


@pytest.mark.parametrize("origins", [(0, 1, 2), (0, 0, 3, 3), (1, 1, 2, 3), (0, 1, 0, 2)])
def test_origins_out_of_canonical_form_are_refused(origins: tuple[int, ...]) -> None:
    with pytest.raises(RemoteProtocolError, match="origins"):
        dataclasses.replace(honest(), origins=origins).check()


def test_a_relayed_sender_counts_from_where_the_reducers_own_relay_saw_it() -> None:
    """A hostile leader's client-only keys called a reducer that sits behind a NAT through its relay:
    every call came from the relay's address and went unchecked, so each key could be an origin of its
    own. A relay this reducer holds a reservation with says where the dialer came from: the second key
    of that subnet under another origin is refused, as on a direct call."""
    seen = SeenOrigins(honest())  # trimmed_mean, each member its own origin
    relay = "198.18.200.1"
    assert seen.refusal(2, relay, True, "198.19.7.10") == ""
    assert "198.19.7.0/24" in seen.refusal(3, relay, True, "198.19.7.11")
    assert seen.refusal(1, relay, True, "198.19.8.1") == ""  # another subnet behind the same relay
    assert seen.refusal(0, relay, True, "") == ""  # a circuit this reducer dialed: unknown, unchecked
    assert "198.19.8.0/24" in seen.refusal(0, "198.19.8.200", False)  # a direct call from that subnet
    plain = SeenOrigins(dataclasses.replace(honest(), aggregation="mean"))
    assert plain.refusal(2, relay, True, "198.19.7.10") == plain.refusal(3, relay, True, "198.19.7.11") == ""
