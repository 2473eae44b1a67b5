"""Peer addresses: one string that carries host, port and peer id.

Format (multiaddr style, familiar to libp2p and hivemind users)::

    /ip4/203.0.113.7/tcp/31337/p2p/<peer id>
    /ip6/2001:db8::1/tcp/31337/p2p/<peer id>
    /dns/node.example.org/tcp/31337/p2p/<peer id>      (also /dns4, /dns6)
    /ip4/198.51.100.2/tcp/31337/p2p/<relay id>/p2p-circuit/p2p/<peer id>   (through a relay: ``relay``)

The ``/p2p/<peer id>`` part is what makes dialing safe: the handshake proves that the remote holds the
key behind that id. An address without it can still be dialed (trust on first use), and the dialer
logs that the remote's id was not verified.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from dataclasses import dataclass

from ..identity import PeerID

_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class PeerAddress:
    """A dialable address: ``kind`` is ``ip4``, ``ip6`` or ``dns`` (``dns4``/``dns6`` accepted)."""

    kind: str
    host: str
    port: int
    peer_id: PeerID | None = None
    relay: PeerID | None = None  # a circuit address: host and port are the relay's, this its id

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Parse the multiaddr form (or ``host:port``, ``[v6]:port``); ValueError says what is wrong."""
        return _parse_cached(text) if cls is PeerAddress else cls._parse(text)

    @classmethod
    def _parse(cls, text: str) -> PeerAddress:
        text = text.strip()
        if not text.startswith("/"):
            return cls._parse_hostport(text)
        parts = text.split("/")[1:]
        if len(parts) == 9 and parts[4] == "p2p" and parts[6:8] == ["p2p-circuit", "p2p"]:
            via = cls._parse("/" + "/".join(parts[:6]))
            return cls(via.kind, via.host, via.port, PeerID.from_string(parts[8]), via.peer_id)
        if len(parts) not in (4, 6) or parts[2] != "tcp":
            raise ValueError(f"bad address {text!r}: expected /ip4|ip6|dns/HOST/tcp/PORT[/p2p/PEERID]")
        kind, host, _, port_s = parts[:4]
        peer_id = None
        if len(parts) == 6:
            if parts[4] != "p2p":
                raise ValueError(f"bad address {text!r}: expected /p2p/PEERID after the port")
            peer_id = PeerID.from_string(parts[5])
        return cls(_check_kind(kind, host, text), host, _parse_port(port_s, text), peer_id)

    @classmethod
    def _parse_hostport(cls, text: str) -> PeerAddress:
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\[\]]+):(\d+)", text)
        if not m:
            raise ValueError(f"bad address {text!r}: expected HOST:PORT or /ip4/HOST/tcp/PORT/p2p/ID")
        host = m.group(1) or m.group(3)
        port = _parse_port(m.group(2) or m.group(4), text)
        return cls(_guess_kind(host, text), host, port, None)

    @classmethod
    def for_host(cls, host: str, port: int, peer_id: PeerID | None = None) -> PeerAddress:
        return cls(_guess_kind(host, host), host, port, peer_id)

    def with_peer(self, peer_id: PeerID) -> PeerAddress:
        return PeerAddress(self.kind, self.host, self.port, peer_id, self.relay)

    def circuit_to(self, target: PeerID) -> PeerAddress:
        """``target`` through the relay at this address (which must carry the relay's id)."""
        if self.peer_id is None or self.relay is not None:
            raise ValueError("a circuit goes through a relay's own address, with its peer id")
        return PeerAddress(self.kind, self.host, self.port, target, self.peer_id)

    @property
    def relay_address(self) -> PeerAddress | None:
        """The relay's own address, for a circuit address."""
        return None if self.relay is None else PeerAddress(self.kind, self.host, self.port, self.relay)

    @functools.cached_property
    def _text(self) -> str:
        s = f"/{self.kind}/{self.host}/tcp/{self.port}"
        if self.relay is not None:
            s += f"/p2p/{self.relay}/p2p-circuit"
        if self.peer_id is not None:
            s += f"/p2p/{self.peer_id}"
        return s

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def plain(self) -> str:
        """The address without the peer's id (a relay's circuit keeps it: the relay's id says where)."""
        return str(PeerAddress(self.kind, self.host, self.port, None)) if self.relay is None else self._text


@functools.lru_cache(maxsize=8192)
def _parse_cached(text: str) -> PeerAddress:
    # Addresses arrive again and again in DHT answers; parsing (regex, ipaddress, base58) is not free.
    return PeerAddress._parse(text)


def _parse_port(s: str, text: str) -> int:
    if not (s.isascii() and s.isdigit()) or not 0 < int(s) < 65536:
        raise ValueError(f"bad address {text!r}: port must be 1-65535")
    return int(s)


def _check_kind(kind: str, host: str, text: str) -> str:
    if kind == "ip4":
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"bad address {text!r}: {host!r} is not an IPv4 address") from None
    elif kind == "ip6":
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bad address {text!r}: {host!r} is not an IPv6 address") from None
    elif kind in ("dns", "dns4", "dns6"):
        if not all(_DNS_LABEL.fullmatch(label) for label in host.rstrip(".").split(".")):
            raise ValueError(f"bad address {text!r}: {host!r} is not a DNS name")
    else:
        raise ValueError(f"bad address {text!r}: unknown protocol {kind!r} (ip4, ip6, dns)")
    return kind


def _guess_kind(host: str, text: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return _check_kind("dns", host, text)
    return "ip4" if ip.version == 4 else "ip6"


def outward_ip(family: int = socket.AF_INET) -> str | None:
    """The local address the OS would use to reach the outside, or None.

    A UDP socket's connect() only selects a route; it sends nothing.
    """
    probe = "198.18.0.1" if family == socket.AF_INET else "2001:db8::1"
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            ip: str = s.getsockname()[0]
            return ip
    except OSError:
        return None


def concrete_host(host: str) -> str:
    """A dialable host for a listener bound to ``host`` (a wildcard becomes the outward address)."""
    if host in ("0.0.0.0", ""):
        return outward_ip(socket.AF_INET) or "127.0.0.1"
    if host == "::":
        return outward_ip(socket.AF_INET6) or "::1"
    return host
