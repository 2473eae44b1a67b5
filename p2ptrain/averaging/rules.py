"""What a member checks in a leader's manifest before it takes part: the run's rules, not the leader's.

Theory of operation. A group's leader signs the manifest that every member then follows: the tensors,
the compression, the aggregation rule, whether the round is audited, the round's timeout, the members
and each one's partition. Leading is cheap (any peer that announces the earliest deadline leads), so a
hostile leader could otherwise sign a round that quietly drops the run's defences: a plain mean in a
run that aggregates with a trimmed mean, no audit in an audited run, every partition to itself. A member
therefore checks the signed manifest against what it expects itself (:class:`RoundRules`: the settings
of its own run and call) and refuses anything that differs, with the reason:

- the group key, the tensors' schema, the compression, the aggregation rule, the audit flag and the
  timeout must be exactly the member's own;
- the member must be listed with the address it offered (an honest leader never changes it);
- the partitions must be the ones the leader's rule gives for the listed bandwidths
  (``partition_bandwidths`` then ``partition_sizes``, over the dialable members not signed out: see
  ``Manifest.out``): so no member holds more than its bandwidth's share, and no listed bandwidth is
  above ``MAX_SPREAD`` times the group's lower median (a leader that signs members out gains nothing it
  could not have by admitting fewer joiners: a member signed out declines the round);
- no member is listed with more bandwidth than it announced itself (a signed DHT announcement the
  member saw; the rule only ever lowers an announced bandwidth, or fills in a typical one for a member
  that has not measured its own);
- origins (see ``robust``): none with the plain mean; no two members whose listed addresses lie in
  different subnets may share one (a leader cannot count honest peers of several subnets as one row),
  and members listed in one subnet share one (a leader cannot make one host's fresh keys many rows;
  a circuit address says nothing of its member's subnet). What a leader cannot prove, where its
  client-only joiners came from, the member takes on trust.

All of it is pure: :func:`check_manifest` raises :class:`RemoteProtocolError` saying what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import RemoteProtocolError
from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.admission import subnet_of
from . import sparse
from .bandwidth import partition_bandwidths
from .partition import partition_sizes
from .protocol import Manifest, TensorSpec


@dataclass(frozen=True)
class RoundRules:
    """What a member expects of any manifest for its round."""

    group_key: str
    schema: tuple[TensorSpec, ...]
    compression: str
    aggregation: str
    audit: bool
    timeout: float


def check_manifest(
    m: Manifest,
    rules: RoundRules,
    me: PeerID,
    my_addr: str,
    announced: Mapping[PeerID, float],
) -> None:
    """Raise :class:`RemoteProtocolError` unless ``m`` follows ``rules`` and the partition rule.

    ``announced``: the bandwidth each peer announced for itself, where this member saw it (its own
    included); a member announced with 0 has not measured its own yet."""
    for what, got, want in (
        ("group key", m.group_key, rules.group_key),
        ("compression", m.compression, rules.compression),
        ("aggregation", m.aggregation, rules.aggregation),
        ("audit", m.audit, rules.audit),
        ("timeout", m.timeout, rules.timeout),
    ):
        if got != want:
            raise RemoteProtocolError(f"the manifest's {what} is {got!r}, the run's is {want!r}")
    if m.schema != rules.schema:
        raise RemoteProtocolError("the manifest's tensors are not the ones this member averages")
    peers = m.peers()
    if me not in peers:
        raise RemoteProtocolError("the manifest does not list us")
    if m.members[peers.index(me)].addr != my_addr:
        raise RemoteProtocolError("the manifest lists us under another address than we offered")
    listed = [mm.bandwidth for mm in m.members]
    if partition_bandwidths(listed) != listed:
        raise RemoteProtocolError(f"the listed bandwidths {listed} do not follow the partition rule")
    try:
        align = sparse.BLOCK if m.settings.mode.sparse else 1  # (top-k partitions start on whole blocks)
        sizes = partition_sizes(m.total, listed, m.reduces(), align)
    except ValueError as e:
        raise RemoteProtocolError(f"the manifest's partitions: {e}") from None
    if list(m.sizes) != sizes:
        raise RemoteProtocolError(f"the partitions {list(m.sizes)} are not the bandwidths' shares {sizes}")
    if m.origins and m.aggregation == "mean":
        raise RemoteProtocolError("a plain mean counts every member: the manifest must list no origins")
    if m.aggregation != "mean":
        subnets: dict[int, str] = {}
        origins: dict[str, int] = {}
        for mm, o in zip(m.members, m.origins or range(len(m.members)), strict=True):
            subnet = listed_subnet(mm.addr)
            if subnet and subnets.setdefault(o, subnet) != subnet:
                raise RemoteProtocolError(
                    f"the manifest counts members of {subnets[o]} and {subnet} as one origin"
                )
            if subnet and origins.setdefault(subnet, o) != o:
                raise RemoteProtocolError(f"the manifest counts members of {subnet} as several origins")
    for peer, bw in zip(peers, listed, strict=True):
        own = announced.get(peer, 0.0)
        if own > 0 and bw > own:
            raise RemoteProtocolError(
                f"the manifest lists {peer.short()} at {bw:g} B/s, more than the {own:g} it announced"
            )


def listed_subnet(addr: str) -> str:
    """The subnet of a listed address ("" for a client-only member, a circuit, a name, or nonsense)."""
    try:
        a = PeerAddress.parse(addr) if addr else None
    except ValueError:
        return ""
    if a is None or a.relay is not None or a.kind not in ("ip4", "ip6"):
        return ""  # (a circuit address names its relay's host, not the member's)
    return subnet_of(a.host)


class SeenOrigins:
    """A reducer's own check of a robust manifest's origins (the leader's word on who shares a subnet).

    A client-only member lists no address, so no member can check its origin from the manifest: a
    hostile leader could give each of its fresh keys one of its own. Each of them must send its slices
    to the reducers, though, and a reducer sees where the connection comes from. So a reducer takes the
    slices of one subnet (as it sees it: /24, /64) from one origin only; a sender of another origin from
    that subnet is refused, as an over-weighted slice is (the round's decision leaves it out). A relayed
    call comes from the relay's address: it counts from where the relay said the sender dialed it, if
    this reducer chose that relay (a circuit into a reservation of its own); a circuit it dialed itself
    says nothing of the sender's subnet, and is not checked. A plain mean does not count origins, and
    is not checked."""

    def __init__(self, m: Manifest) -> None:
        self.robust = m.aggregation != "mean"
        self.of = list(m.origins) if m.origins else list(range(len(m.members)))
        self.by_subnet: dict[str, int] = {}

    def refusal(self, sender: int, host: str, relayed: bool, seen_at: str = "") -> str:
        """Why ``sender``'s slice, on a call from ``host`` (relayed: where this reducer's relay saw the
        sender, ``seen_at``), is refused ("" when it is not)."""
        if relayed:
            host = seen_at
        if not self.robust or not host:
            return ""
        subnet = subnet_of(host)
        first = self.by_subnet.setdefault(subnet, self.of[sender])
        if first != self.of[sender]:
            return f"it calls from {subnet}, where the manifest counts another origin's members"
        return ""
