"""Peer address parsing (pure)."""

from __future__ import annotations

import pytest

from p2ptrain.identity import Identity, PeerID
from p2ptrain.net.address import PeerAddress

PEER = Identity.from_seed(bytes(range(32))).peer_id
PID = str(PEER)


@pytest.mark.parametrize(
    ("text", "kind", "host", "port", "peer"),
    [
        ("/ip4/203.0.113.7/tcp/31337", "ip4", "203.0.113.7", 31337, None),
        (f"/ip4/203.0.113.7/tcp/31337/p2p/{PID}", "ip4", "203.0.113.7", 31337, PEER),
        ("/ip4/127.0.0.1/tcp/1", "ip4", "127.0.0.1", 1, None),
        ("/ip6/2001:db8::1/tcp/65535", "ip6", "2001:db8::1", 65535, None),
        (f"/ip6/::1/tcp/8000/p2p/{PID}", "ip6", "::1", 8000, PEER),
        ("/dns/node.example.org/tcp/443", "dns", "node.example.org", 443, None),
        (f"/dns/node.example.org/tcp/443/p2p/{PID}", "dns", "node.example.org", 443, PEER),
        ("/dns4/localhost/tcp/9000", "dns4", "localhost", 9000, None),
        (f"/dns4/a-b.c-d.example/tcp/9000/p2p/{PID}", "dns4", "a-b.c-d.example", 9000, PEER),
        ("/dns6/v6.example.net/tcp/9000", "dns6", "v6.example.net", 9000, None),
    ],
)
def test_parse_multiaddr(text: str, kind: str, host: str, port: int, peer: PeerID | None) -> None:
    addr = PeerAddress.parse(text)
    assert addr == PeerAddress(kind, host, port, peer)
    assert str(addr) == text
    assert PeerAddress.parse(str(addr)) == addr


def test_parse_strips_surrounding_whitespace() -> None:
    assert PeerAddress.parse("  /ip4/10.0.0.1/tcp/5\n") == PeerAddress("ip4", "10.0.0.1", 5)


@pytest.mark.parametrize(
    ("text", "kind", "host", "port"),
    [
        ("203.0.113.7:31337", "ip4", "203.0.113.7", 31337),
        ("localhost:8080", "dns", "localhost", 8080),
        ("node.example.org:1", "dns", "node.example.org", 1),
        ("[2001:db8::1]:31337", "ip6", "2001:db8::1", 31337),
        ("[::1]:80", "ip6", "::1", 80),
    ],
)
def test_parse_host_port(text: str, kind: str, host: str, port: int) -> None:
    addr = PeerAddress.parse(text)
    assert addr == PeerAddress(kind, host, port, None)
    # The canonical form is the multiaddr, and it parses back to the same address.
    assert str(addr) == f"/{kind}/{host}/tcp/{port}"
    assert PeerAddress.parse(str(addr)) == addr


def test_for_host_and_with_peer() -> None:
    assert PeerAddress.for_host("::1", 5) == PeerAddress("ip6", "::1", 5)
    assert PeerAddress.for_host("10.1.2.3", 5) == PeerAddress("ip4", "10.1.2.3", 5)
    assert PeerAddress.for_host("example.com", 5, PEER) == PeerAddress("dns", "example.com", 5, PEER)
    addr = PeerAddress.parse("1.2.3.4:5").with_peer(PEER)
    assert str(addr) == f"/ip4/1.2.3.4/tcp/5/p2p/{PID}"
    with pytest.raises(ValueError, match="not a DNS name"):
        PeerAddress.for_host("bad host", 5)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        # ports
        ("/ip4/1.2.3.4/tcp/0", "port must be 1-65535"),
        ("/ip4/1.2.3.4/tcp/65536", "port must be 1-65535"),
        ("/ip4/1.2.3.4/tcp/-1", "port must be 1-65535"),
        ("/ip4/1.2.3.4/tcp/http", "port must be 1-65535"),
        ("/ip4/1.2.3.4/tcp/", "port must be 1-65535"),
        ("/ip4/1.2.3.4/tcp/\u0668\u0660", "port must be 1-65535"),  # Arabic-Indic digits
        ("/ip4/1.2.3.4/tcp/\u00b2", "port must be 1-65535"),  # superscript two
        ("1.2.3.4:0", "port must be 1-65535"),
        ("1.2.3.4:99999", "port must be 1-65535"),
        ("[::1]:70000", "port must be 1-65535"),
        ("1.2.3.4:\u0668\u0660", "port must be 1-65535"),
        # hosts
        ("/ip4/1.2.3/tcp/80", "is not an IPv4 address"),
        ("/ip4/256.1.1.1/tcp/80", "is not an IPv4 address"),
        ("/ip4/::1/tcp/80", "is not an IPv4 address"),
        ("/ip4/example.com/tcp/80", "is not an IPv4 address"),
        ("/ip6/1.2.3.4/tcp/80", "is not an IPv6 address"),
        ("/ip6/2001:db8::g/tcp/80", "is not an IPv6 address"),
        ("/dns/-bad.example/tcp/80", "is not a DNS name"),
        ("/dns/bad-.example/tcp/80", "is not a DNS name"),
        ("/dns/under_score.example/tcp/80", "is not a DNS name"),
        ("/dns/a..b/tcp/80", "is not a DNS name"),
        ("/dns//tcp/80", "is not a DNS name"),
        ("/dns/" + "a" * 64 + ".example/tcp/80", "is not a DNS name"),
        ("/dns/evil\n.example/tcp/80", "is not a DNS name"),  # a newline must not sneak into a host
        ("evil\n:80", "is not a DNS name"),
        ("bad host:80", "is not a DNS name"),
        ("[1:2]:80", "is not a DNS name"),
        # protocols and shape
        ("/udp/1.2.3.4/tcp/80", "unknown protocol 'udp'"),
        ("/ip7/1.2.3.4/tcp/80", "unknown protocol 'ip7'"),
        ("/ip4/1.2.3.4/udp/80", "expected /ip4|ip6|dns/HOST/tcp/PORT"),
        ("/ip4/1.2.3.4", "expected /ip4|ip6|dns/HOST/tcp/PORT"),
        ("/ip4/1.2.3.4/tcp/80/", "expected /ip4|ip6|dns/HOST/tcp/PORT"),
        ("/ip4/1.2.3.4/tcp/80/p2p", "expected /ip4|ip6|dns/HOST/tcp/PORT"),
        (f"/ip4/1.2.3.4/tcp/80/p2p/{PID}/extra", "expected /ip4|ip6|dns/HOST/tcp/PORT"),
        (f"/ip4/1.2.3.4/tcp/80/ipfs/{PID}", "expected /p2p/PEERID"),
        ("/", "expected /ip4|ip6|dns/HOST/tcp/PORT"),
        ("", "expected HOST:PORT"),
        ("1.2.3.4", "expected HOST:PORT"),
        ("1.2.3.4:", "expected HOST:PORT"),
        ("2001:db8::1:80", "expected HOST:PORT"),  # bare v6 needs brackets
        ("[zz::1]:80", "expected HOST:PORT"),
        # peer ids
        ("/ip4/1.2.3.4/tcp/80/p2p/0OIl", "not a peer id: invalid base58"),
        ("/ip4/1.2.3.4/tcp/80/p2p/abc", "not a peer id: decodes to"),
        (f"/ip4/1.2.3.4/tcp/80/p2p/{PID}z", "not a peer id: decodes to"),
        ("/ip4/1.2.3.4/tcp/80/p2p/", "not a peer id: decodes to 0 bytes"),
    ],
)
def test_bad_addresses(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        PeerAddress.parse(text)
    assert reason in str(info.value)
    if "peer id" not in reason:
        assert str(info.value).startswith("bad address ")


def test_a_circuit_address_names_the_relay_and_the_target() -> None:
    relay = Identity.from_seed(bytes([7]) * 32).peer_id
    text = f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{PID}"
    addr = PeerAddress.parse(text)
    assert (addr.host, addr.port, addr.peer_id, addr.relay) == ("198.51.100.2", 4001, PEER, relay)
    assert str(addr) == text
    assert addr.relay_address == PeerAddress.parse(f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}")
    assert addr.relay_address is not None and addr.relay_address.circuit_to(PEER) == addr
    assert PeerAddress.parse(f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}").relay_address is None
    with pytest.raises(ValueError, match="through a relay's own address"):
        addr.circuit_to(relay)
    for bad in (
        f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}/p2p-circuit/p2p/nonsense",
        f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}/p2p-circuit/x/{PID}",
        f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}/p2p-circuit",
    ):
        with pytest.raises(ValueError):
            PeerAddress.parse(bad)


def test_a_contact_says_its_id_once_and_comes_back_the_same() -> None:
    """A DHT contact's address leaves out the id its ``peer`` field says (most of a node lookup's
    bytes); a relay's circuit says it whole (the relay's and the peer's); the contact read back is the
    one sent, every kind. Random ids, hosts, ports and relays (seeded)."""
    import random

    from p2ptrain.dht.protocol import ContactMsg
    from p2ptrain.dht.routing import Contact

    rng = random.Random(4)
    hosts = [("ip4", "198.18.0.9"), ("ip6", "2001:db8::7"), ("dns", "node.example.org"), ("dns4", "a.b")]
    for _ in range(200):
        me, relay = (Identity.from_seed(rng.randbytes(32)).peer_id for _ in range(2))
        kind, host = rng.choice(hosts)
        addr = PeerAddress(kind, host, rng.randrange(1, 65536), me)
        if rng.random() < 0.3:
            addr = PeerAddress(kind, host, addr.port, relay).circuit_to(me)
        msg = ContactMsg.of(Contact(me, addr))
        assert msg.to_contact() == Contact(me, addr)
        assert (str(me) in msg.addr) == (str(relay) in msg.addr) == (addr.relay is not None)
