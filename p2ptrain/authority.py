"""Private swarms: a swarm authority, membership certificates, and the rule that admits members.

Theory of operation: open swarms (the default) admit any peer that knows the run id. A private run
names a *swarm authority*: an Ed25519 key pair (made with ``p2ptrain authority init``, kept offline like
any CA key) whose public key every member is configured with. The authority issues each member a
*membership certificate*: a :class:`~p2ptrain.identity.SignedEnvelope` in the domain
``p2ptrain/membership-cert`` over a msgpack map ``{peer, run, not_before, expires, serial}``. A
certificate is self-contained: anyone holding the authority's public key can check it offline, so no
certificate server is needed and relayed data can carry its author's certificate.

A node of a private run (:class:`Membership`) admits a peer, or a DHT record's author, only if it shows
a certificate that (checked in this order, each with its own reason) is well formed and small, was
issued by this run's authority, carries a valid signature, names that peer, names this run (or ``""``:
any run of this authority), and is valid at ``now``: ``not_before - NOT_BEFORE_SKEW <= now <
expires``. The skew forgives an issuing clock slightly ahead of ours; expiry is exact.

Rotation: certificates are short-lived on purpose (there is no revocation list: not renewing is how a
member is removed). A node loads its certificate at start; to renew, issue a new one and restart the node
with it. Connections are closed when the remote's certificate expires (the host watches it), so an
expired member loses its place within a certificate lifetime at most.

This module is pure (time is passed in); the handshake and the DHT call :meth:`Membership.check`.
"""

from __future__ import annotations

import base64
import datetime
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, InvalidSignature, P2PError, RemoteProtocolError
from .identity import (
    PEER_ID_BYTES,
    PUBLIC_KEY_BYTES,
    Identity,
    PeerID,
    SignedEnvelope,
    _b58decode,
    _b58encode,
)
from .wire.codec import pack, unpack
from .wire.schema import Message, bounded

CERT_DOMAIN = "p2ptrain/membership-cert"
MAX_CERT_BYTES = 1024  # a certificate is ~250 bytes (up to ~700 with a long non-ASCII run id)
MAX_CERT_RUN = 128  # = net.handshake.MAX_RUN_ID (not imported from there: the handshake imports us)
NOT_BEFORE_SKEW = 60.0  # seconds an issuing authority's clock may run ahead of ours
MAX_LIFETIME = 10 * 366 * 86400.0  # issuing refuses longer certificates: renewal is the revocation
MAX_TIME = 1e11  # certificate times beyond ~year 5000 are malformed
_CERT_HEADER = "-----BEGIN P2PTRAIN MEMBERSHIP CERTIFICATE-----"
_CERT_FOOTER = "-----END P2PTRAIN MEMBERSHIP CERTIFICATE-----"
_CACHE_SIZE = 4096


class CertificateRejected(P2PError):
    """A membership certificate does not admit a peer; ``kind`` says why, ``reason`` for humans.

    Kinds: ``missing``, ``malformed``, ``authority``, ``signature``, ``peer``, ``run``,
    ``not_yet_valid``, ``expired``.
    """

    def __init__(self, kind: str, reason: str) -> None:
        self.kind = kind
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class _Body(Message):
    """The signed payload of a certificate (its wire schema)."""

    peer: bytes = bounded(max_len=PEER_ID_BYTES)
    not_before: float = bounded(ge=0.0, le=MAX_TIME)
    expires: float = bounded(ge=0.0, le=MAX_TIME)
    run: str = bounded("", max_len=MAX_CERT_RUN)  # "": any run of this authority
    serial: int = bounded(0, ge=0, le=2**64 - 1)


def format_time(t: float) -> str:
    """A certificate time for humans: ``2025-06-01 12:00:00 UTC``."""
    if not math.isfinite(t) or not 0 <= t <= MAX_TIME:
        return f"{t!r} (not a valid time)"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class Certificate:
    """A decoded certificate whose signature by ``authority`` has been verified."""

    peer: PeerID
    run: str
    not_before: float
    expires: float
    serial: int
    authority: bytes  # the issuing authority's Ed25519 public key
    raw: bytes  # the encoded envelope, as it travels

    def check(self, peer: PeerID, run_id: str, now: float) -> None:
        """Raise CertificateRejected unless this certificate admits ``peer`` to ``run_id`` at ``now``."""
        if self.peer != peer:
            raise CertificateRejected(
                "peer", f"membership certificate is for peer {self.peer}, not for {peer}"
            )
        if self.run and self.run != run_id:
            raise CertificateRejected(
                "run", f"membership certificate is for run {self.run!r}, not for run {run_id!r}"
            )
        if now < self.not_before - NOT_BEFORE_SKEW:
            raise CertificateRejected(
                "not_yet_valid",
                f"membership certificate is not valid before {format_time(self.not_before)}",
            )
        if now >= self.expires:
            raise CertificateRejected(
                "expired", f"membership certificate expired on {format_time(self.expires)}"
            )

    def fields(self) -> dict[str, Any]:
        """What ``p2ptrain authority show`` prints."""
        return {
            "peer": str(self.peer),
            "run": self.run or "(any run of this authority)",
            "authority": authority_key_text(self.authority),
            "serial": self.serial,
            "not_before": format_time(self.not_before),
            "expires": format_time(self.expires),
        }


# ---- authority keys --------------------------------------------------------------------------------


def authority_key_text(public_key: bytes) -> str:
    """The text form of an authority's public key (base58), for run files and ``--authority``."""
    return _b58encode(public_key)


def parse_authority_key(text: str) -> bytes:
    """Parse ``authority_key_text``; raise ConfigError with a reason."""
    text = text.strip()
    if not text or len(text) > 64:
        raise ConfigError(f"not an authority public key: {text[:70]!r}")
    try:
        raw = _b58decode(text)
    except ValueError as e:
        raise ConfigError(f"not an authority public key: {e}") from None
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(
            f"not an authority public key: decodes to {len(raw)} bytes, expected {PUBLIC_KEY_BYTES}"
            " (`p2ptrain authority init` prints it)"
        )
    return raw


# ---- issuing and verifying ---------------------------------------------------------------------


def issue_certificate(
    authority: Identity,
    peer: PeerID,
    *,
    not_before: float,
    expires: float,
    run: str = "",
    serial: int | None = None,
) -> bytes:
    """A membership certificate for ``peer`` signed by ``authority`` (its encoded envelope).

    ``run=""`` admits the peer to every run of this authority. ``serial`` defaults to a random 63-bit
    number (it names the certificate in logs; the authority keeps no state).
    """
    if not (math.isfinite(not_before) and math.isfinite(expires) and 0 <= not_before < expires <= MAX_TIME):
        raise ConfigError("a certificate must expire after it becomes valid")
    if expires - not_before > MAX_LIFETIME:
        raise ConfigError("a certificate may be valid for 10 years at most")
    if len(run) > MAX_CERT_RUN or not run.isprintable():
        raise ConfigError(f"run id must be at most {MAX_CERT_RUN} printable characters")
    if serial is None:
        serial = int.from_bytes(os.urandom(8), "big") >> 1
    body = _Body(peer.digest, float(not_before), float(expires), run, serial)
    data = SignedEnvelope.seal(authority, CERT_DOMAIN, pack(body.to_obj())).to_bytes()
    assert len(data) <= MAX_CERT_BYTES, "a certificate outgrew MAX_CERT_BYTES"
    return data


def decode_certificate(data: bytes, authority: bytes | None) -> Certificate:
    """Decode ``data`` and verify its signature; by ``authority`` unless None (any signer, for ``show``).

    Raises CertificateRejected (``malformed``, ``authority``, ``signature``).
    """
    if len(data) > MAX_CERT_BYTES:
        raise CertificateRejected(
            "malformed", f"membership certificate of {len(data)} bytes exceeds {MAX_CERT_BYTES}"
        )
    try:
        env = SignedEnvelope.from_bytes(data)
    except RemoteProtocolError:
        raise CertificateRejected("malformed", "membership certificate is malformed") from None
    if env.domain != CERT_DOMAIN:
        raise CertificateRejected("malformed", f"not a membership certificate (a {env.domain!r} envelope)")
    if len(env.public_key) != PUBLIC_KEY_BYTES:
        raise CertificateRejected("malformed", "membership certificate has a malformed authority key")
    if authority is not None and env.public_key != authority:
        raise CertificateRejected(
            "authority",
            f"membership certificate was issued by another authority ({authority_key_text(env.public_key)}),"
            f" not by this run's ({authority_key_text(authority)})",
        )
    try:
        payload = env.open(CERT_DOMAIN)
    except InvalidSignature:
        raise CertificateRejected("signature", "membership certificate signature does not verify") from None
    try:
        body = _Body.from_obj(unpack(payload, max_bytes=MAX_CERT_BYTES))
        peer = PeerID(body.peer)
    except (RemoteProtocolError, ValueError) as e:
        raise CertificateRejected("malformed", f"membership certificate is malformed: {e}") from None
    if body.expires <= body.not_before:
        raise CertificateRejected("malformed", "membership certificate expires before it becomes valid")
    return Certificate(peer, body.run, body.not_before, body.expires, body.serial, env.public_key, data)


def verify_certificate(data: bytes, authority: bytes, peer: PeerID, run_id: str, now: float) -> Certificate:
    """The certificate in ``data`` if it admits ``peer`` to ``run_id`` at ``now``, by ``authority``.

    Raises CertificateRejected with the first reason it does not.
    """
    cert = decode_certificate(data, authority)
    cert.check(peer, run_id, now)
    return cert


class Membership:
    """A private run's admission rule, and this node's own certificate (sent to peers, attached to the
    DHT records it writes). Verified certificates are cached by their bytes (signature checks only)."""

    def __init__(self, authority: bytes, run_id: str, certificate: bytes | None = None) -> None:
        if len(authority) != PUBLIC_KEY_BYTES:
            raise ConfigError(f"an authority public key is {PUBLIC_KEY_BYTES} bytes")
        self.authority = authority
        self.run_id = run_id
        self.certificate = certificate
        self.refusal = "record not written by a member"  # (DHT records: see ``dht.records.Authors``)
        self._verified: dict[bytes, Certificate] = {}

    def __repr__(self) -> str:
        return f"Membership(authority={authority_key_text(self.authority)[:8]}.., run={self.run_id!r})"

    def check(self, cert: bytes | None, peer: PeerID, now: float) -> Certificate:
        """The certificate admitting ``peer`` at ``now``; CertificateRejected with the reason otherwise."""
        if not cert:
            raise CertificateRejected(
                "missing",
                f"peer {peer} has no membership certificate (this run is private: its authority"
                f" {authority_key_text(self.authority)} must issue one)",
            )
        decoded = self._verified.get(cert)
        if decoded is None:
            decoded = decode_certificate(cert, self.authority)
            if len(self._verified) >= _CACHE_SIZE:
                self._verified.clear()
            self._verified[cert] = decoded
        decoded.check(peer, self.run_id, now)
        return decoded

    def check_own(self, peer: PeerID, now: float) -> Certificate | None:
        """Check this node's own certificate at start; ConfigError says what is wrong with it."""
        if self.certificate is None:
            return None
        try:
            return self.check(self.certificate, peer, now)
        except CertificateRejected as e:
            raise ConfigError(f"this node's {e.reason}") from None


# ---- durations and files -------------------------------------------------------------------------

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w`` -> seconds; ConfigError with an example otherwise."""
    m = _DURATION.match(text)
    if m is None:
        raise ConfigError(f"bad duration {text!r}: expected a number and a unit (s, m, h, d, w), e.g. 30d")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= MAX_LIFETIME:
        raise ConfigError(f"bad duration {text!r}: must be more than 0 and at most 10 years")
    return seconds


def save_certificate(data: bytes, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Write a certificate as text (it is public: mode 0644), refusing to overwrite unless asked."""
    p = Path(path)
    cert = decode_certificate(data, None)
    body = base64.b64encode(data).decode()
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    text = "\n".join(
        [
            _CERT_HEADER,
            *lines,
            _CERT_FOOTER,
            f"# peer: {cert.peer}",
            f"# run: {cert.run or '(any)'}",
            f"# expires: {format_time(cert.expires)}",
            "",
        ]
    )
    try:
        with open(p, "w" if overwrite else "x") as f:
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"{p} already exists; refusing to overwrite it (--force)") from None
    except OSError as e:
        raise ConfigError(f"cannot write {p}: {e.strerror}") from None


def load_certificate(path: str | os.PathLike[str]) -> bytes:
    """Read a certificate file written by :func:`save_certificate`; ConfigError says what is wrong."""
    p = Path(path)
    try:
        if p.stat().st_size > 8 * MAX_CERT_BYTES:
            raise ConfigError(f"{p} is not a membership certificate (too large)")
        lines = [ln.strip() for ln in p.read_text().splitlines()]
    except FileNotFoundError:
        raise ConfigError(f"certificate file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read certificate file {p}: {e}") from None
    try:
        start, end = lines.index(_CERT_HEADER), lines.index(_CERT_FOOTER)
        data = base64.b64decode("".join(lines[start + 1 : end]), validate=True)
    except ValueError:
        raise ConfigError(f"{p} is not a membership certificate file") from None
    try:
        decode_certificate(data, None)
    except CertificateRejected as e:
        raise ConfigError(f"{p}: {e.reason}") from None
    return data
