"""Private swarms, pure: certificates (issue, verify, every refusal), durations, files, and the handshake
of a private run driven frame by frame (no event loop), in both directions."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import nacl.bindings as sodium
import pytest

from p2ptrain.authority import (
    CERT_DOMAIN,
    MAX_CERT_BYTES,
    NOT_BEFORE_SKEW,
    CertificateRejected,
    Membership,
    authority_key_text,
    decode_certificate,
    format_time,
    issue_certificate,
    load_certificate,
    parse_authority_key,
    parse_duration,
    save_certificate,
    verify_certificate,
)
from p2ptrain.dht.records import (
    RecordLimits,
    RecordRefused,
    RecordStore,
    check_entry,
    key_id,
    make_entry,
)
from p2ptrain.errors import (
    ConfigError,
    HandshakeRefused,
    IdentityError,
    LocalProtocolError,
    RemoteProtocolError,
)
from p2ptrain.identity import Identity, SignedEnvelope, load_identity, save_identity
from p2ptrain.net.handshake import (
    Accept,
    InitiatorHandshake,
    Reply,
    ResponderHandshake,
    decode_frame,
    encode_frame,
    reject_frame,
)
from p2ptrain.wire.codec import pack

AUTH = Identity.from_seed(b"\x0a" * 32)  # this run's authority
OTHER_AUTH = Identity.from_seed(b"\x0b" * 32)  # another swarm's authority
ALICE = Identity.from_seed(b"\x01" * 32)  # initiator
BOB = Identity.from_seed(b"\x02" * 32)  # responder
CAROL = Identity.from_seed(b"\x03" * 32)
RUN = "private-run"
NOW = 1_750_000_000.0
HOUR = 3600.0
BEGIN, END = (
    "-----BEGIN P2PTRAIN MEMBERSHIP CERTIFICATE-----",
    "-----END P2PTRAIN MEMBERSHIP CERTIFICATE-----",
)


def cert(
    who: Identity,
    *,
    by: Identity = AUTH,
    run: str = RUN,
    not_before: float = NOW - HOUR,
    expires: float = NOW + HOUR,
) -> bytes:
    return issue_certificate(by, who.peer_id, not_before=not_before, expires=expires, run=run, serial=7)


def flip(data: bytes, index: int) -> bytes:
    b = bytearray(data)
    b[index] ^= 0x01
    return bytes(b)


# ---- certificates ------------------------------------------------------------------------------


def test_issue_then_verify_gives_the_fields_back() -> None:
    data = cert(ALICE)
    got = verify_certificate(data, AUTH.public_key, ALICE.peer_id, RUN, NOW)
    assert (got.peer, got.run, got.serial) == (ALICE.peer_id, RUN, 7)
    assert (got.not_before, got.expires) == (NOW - HOUR, NOW + HOUR)
    assert got.authority == AUTH.public_key
    assert got.raw == data
    assert len(data) < 400  # small enough for every proof and DHT entry
    assert SignedEnvelope.from_bytes(data).domain == CERT_DOMAIN
    shown = got.fields()
    assert shown["peer"] == str(ALICE.peer_id)
    assert shown["authority"] == authority_key_text(AUTH.public_key)
    assert shown["expires"] == format_time(NOW + HOUR)


def test_a_certificate_without_a_run_admits_to_every_run_of_its_authority() -> None:
    data = cert(ALICE, run="")
    for run in (RUN, "another", "x" * 128):
        assert verify_certificate(data, AUTH.public_key, ALICE.peer_id, run, NOW).run == ""
    assert "any run" in decode_certificate(data, None).fields()["run"]


def test_random_serials_differ() -> None:
    a, b = (issue_certificate(AUTH, ALICE.peer_id, not_before=NOW, expires=NOW + 1) for _ in range(2))
    assert decode_certificate(a, None).serial != decode_certificate(b, None).serial


def _envelope(payload: bytes, *, domain: str = CERT_DOMAIN) -> bytes:
    return SignedEnvelope.seal(AUTH, domain, payload).to_bytes()


def _body(**changes: object) -> bytes:
    fields: dict[str, object] = {
        "peer": ALICE.peer_id.digest,
        "not_before": NOW - HOUR,
        "expires": NOW + HOUR,
        "run": RUN,
        "serial": 1,
    }
    fields.update(changes)
    return pack(fields)


REFUSALS = [
    pytest.param(lambda: cert(ALICE, by=OTHER_AUTH), "authority", "another authority", id="other-authority"),
    pytest.param(lambda: flip(cert(ALICE), len(cert(ALICE)) - 1), "signature", "does not verify", id="sig"),
    pytest.param(lambda: flip(cert(ALICE), 40), "signature", "does not verify", id="tampered-body"),
    pytest.param(lambda: cert(CAROL), "peer", f"for peer {CAROL.peer_id}", id="wrong-peer"),
    pytest.param(lambda: cert(ALICE, run="other-run"), "run", "run 'other-run'", id="wrong-run"),
    pytest.param(
        lambda: cert(ALICE, not_before=NOW - 2 * HOUR, expires=NOW - 1),
        "expired",
        f"expired on {format_time(NOW - 1)}",
        id="expired",
    ),
    pytest.param(
        lambda: cert(ALICE, not_before=NOW - HOUR, expires=NOW), "expired", "expired on", id="expires-now"
    ),
    pytest.param(
        lambda: cert(ALICE, not_before=NOW + NOT_BEFORE_SKEW + 1, expires=NOW + HOUR),
        "not_yet_valid",
        "not valid before",
        id="not-yet-valid",
    ),
    pytest.param(lambda: b"", "malformed", "malformed", id="empty"),
    pytest.param(lambda: b"\x93garbage", "malformed", "malformed", id="garbage"),
    pytest.param(lambda: b"\x00" * (MAX_CERT_BYTES + 1), "malformed", "exceeds", id="too-large"),
    pytest.param(
        lambda: _envelope(_body(), domain="dht-record"), "malformed", "'dht-record' envelope", id="domain"
    ),
    pytest.param(lambda: _envelope(b"\xc1"), "malformed", "malformed", id="body-not-msgpack"),
    pytest.param(lambda: _envelope(pack([1, 2])), "malformed", "expected a map", id="body-not-a-map"),
    pytest.param(lambda: _envelope(_body(peer=b"\x01" * 5)), "malformed", "peer id", id="short-peer"),
    pytest.param(lambda: _envelope(_body(expires="soon")), "malformed", "expected a number", id="str-time"),
    pytest.param(lambda: _envelope(_body(expires=float("inf"))), "malformed", "finite", id="inf-expiry"),
    pytest.param(lambda: _envelope(_body(run="r" * 129)), "malformed", "exceeds 128", id="long-run"),
    pytest.param(
        lambda: _envelope(_body(not_before=NOW, expires=NOW - 1)), "malformed", "before it", id="inverted"
    ),
    pytest.param(
        lambda: SignedEnvelope(CERT_DOMAIN, _body(), b"\x01" * 5, b"\x00" * 64).to_bytes(),
        "malformed",
        "authority key",
        id="short-key",
    ),
]


@pytest.mark.parametrize(("make", "kind", "detail"), REFUSALS)
def test_every_refusal_has_its_kind_and_reason(make: Callable[[], bytes], kind: str, detail: str) -> None:
    with pytest.raises(CertificateRejected) as refused:
        verify_certificate(make(), AUTH.public_key, ALICE.peer_id, RUN, NOW)
    assert refused.value.kind == kind
    assert detail in refused.value.reason
    assert str(refused.value) == refused.value.reason


def test_validity_bounds_are_exact_but_forgive_a_fast_issuing_clock() -> None:
    data = cert(ALICE, not_before=NOW, expires=NOW + HOUR)
    for now in (NOW - NOT_BEFORE_SKEW, NOW, NOW + HOUR - 0.001):
        verify_certificate(data, AUTH.public_key, ALICE.peer_id, RUN, now)
    for now, kind in ((NOW - NOT_BEFORE_SKEW - 0.001, "not_yet_valid"), (NOW + HOUR, "expired")):
        with pytest.raises(CertificateRejected) as refused:
            verify_certificate(data, AUTH.public_key, ALICE.peer_id, RUN, now)
        assert refused.value.kind == kind


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"expires": NOW - 1}, "expire after"),
        ({"not_before": -1.0}, "expire after"),
        ({"expires": float("nan")}, "expire after"),
        ({"expires": NOW + 11 * 366 * 86400}, "10 years"),
        ({"run": "r" * 129}, "at most 128"),
        ({"run": "tab\there"}, "printable"),
    ],
)
def test_issuing_refuses_bad_values(changes: dict[str, object], reason: str) -> None:
    kwargs: dict[str, object] = {"not_before": NOW, "expires": NOW + HOUR, "run": RUN} | changes
    with pytest.raises(ConfigError, match=reason):
        issue_certificate(AUTH, ALICE.peer_id, **kwargs)  # type: ignore[arg-type]


def test_the_longest_certificate_fits_its_bound() -> None:
    data = cert(ALICE, run="ü" * 128)  # 256 bytes of UTF-8 run id
    assert len(data) <= MAX_CERT_BYTES
    assert decode_certificate(data, AUTH.public_key).run == "ü" * 128


# ---- the membership rule ----------------------------------------------------------------------


def test_membership_names_a_missing_certificate_and_the_authority() -> None:
    m = Membership(AUTH.public_key, RUN)
    for missing in (None, b""):
        with pytest.raises(CertificateRejected) as refused:
            m.check(missing, ALICE.peer_id, NOW)
        assert refused.value.kind == "missing"
        assert str(ALICE.peer_id) in refused.value.reason
        assert authority_key_text(AUTH.public_key) in refused.value.reason


def test_membership_caches_signatures_but_checks_time_and_subject_every_time() -> None:
    m = Membership(AUTH.public_key, RUN)
    data = cert(ALICE)
    assert m.check(data, ALICE.peer_id, NOW).peer == ALICE.peer_id
    assert data in m._verified
    with pytest.raises(CertificateRejected, match="expired"):
        m.check(data, ALICE.peer_id, NOW + HOUR)
    with pytest.raises(CertificateRejected, match="for peer"):
        m.check(data, BOB.peer_id, NOW)
    bad = flip(data, len(data) - 1)
    for _ in range(2):  # failures are not cached as successes
        with pytest.raises(CertificateRejected, match="does not verify"):
            m.check(bad, ALICE.peer_id, NOW)
    assert bad not in m._verified


def test_own_certificate_is_checked_as_a_configuration_error() -> None:
    assert Membership(AUTH.public_key, RUN).check_own(ALICE.peer_id, NOW) is None
    assert Membership(AUTH.public_key, RUN, cert(ALICE)).check_own(ALICE.peer_id, NOW) is not None
    with pytest.raises(ConfigError, match="this node's membership certificate is for peer"):
        Membership(AUTH.public_key, RUN, cert(ALICE)).check_own(BOB.peer_id, NOW)
    with pytest.raises(ConfigError, match="expired on"):
        Membership(AUTH.public_key, RUN, cert(ALICE)).check_own(ALICE.peer_id, NOW + HOUR)
    with pytest.raises(ConfigError, match="32 bytes"):
        Membership(b"short", RUN)


# ---- durations, keys and files ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("15m", 900), ("12h", 43200), ("30d", 2_592_000), ("2w", 1_209_600), ("1.5h", 5400)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(f" {text} ") == seconds


@pytest.mark.parametrize("text", ["", "30", "d", "30x", "-1d", "0d", "1e3s", "30 days", "11000d", "1d2h"])
def test_bad_durations_say_what_is_expected(text: str) -> None:
    with pytest.raises(ConfigError, match="bad duration"):
        parse_duration(text)


def test_authority_key_text_round_trips_and_bad_keys_are_explained() -> None:
    text = authority_key_text(AUTH.public_key)
    assert parse_authority_key(text) == AUTH.public_key
    assert parse_authority_key(f"  {text}\n") == AUTH.public_key
    for bad, reason in [("", "not an authority"), ("0OIl", "invalid base58"), ("abc", "decodes to 3 bytes")]:
        with pytest.raises(ConfigError, match=reason):
            parse_authority_key(bad)
    with pytest.raises(ConfigError, match="not an authority"):
        parse_authority_key("x" * 65)


def test_authority_key_file_is_private_and_refused_when_it_is_not(tmp_path: Path) -> None:
    path = tmp_path / "authority.key"
    save_identity(AUTH, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_identity(path).public_key == AUTH.public_key
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="accessible by other users"):
        load_identity(path)


def test_certificate_files_round_trip_and_refuse_overwrites(tmp_path: Path) -> None:
    path, data = tmp_path / "node.cert", cert(ALICE)
    save_certificate(data, path)
    assert load_certificate(path) == data
    text = path.read_text()
    assert f"# peer: {ALICE.peer_id}" in text
    assert f"# expires: {format_time(NOW + HOUR)}" in text
    with pytest.raises(ConfigError, match="already exists"):
        save_certificate(cert(BOB), path)
    save_certificate(cert(BOB), path, overwrite=True)
    assert load_certificate(path) == cert(BOB)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "does not exist"),
        ("hello\n", "not a membership certificate file"),
        (
            f"{BEGIN}\n!!!\n{END}\n",
            "not a membership certificate file",
        ),
        (
            f"{BEGIN}\nAAAA\n{END}\n",
            "malformed",
        ),
        ("x" * 10_000, "too large"),
    ],
)
def test_bad_certificate_files_are_explained(tmp_path: Path, content: str | None, reason: str) -> None:
    path = tmp_path / "node.cert"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=reason):
        load_certificate(path)


# ---- DHT records in a private run -------------------------------------------------------------


def test_private_store_keeps_only_entries_written_by_members() -> None:
    m = Membership(AUTH.public_key, RUN)
    limits, expiry = RecordLimits(), NOW + 60
    store = RecordStore(limits, membership=m)
    good = make_entry(b"k", b"v", expiry, subkey=b"a", signer=ALICE, cert=cert(ALICE))
    assert store.put(good, NOW, BOB.peer_id) == "stored"
    refused = [
        (make_entry(b"k", b"v", expiry, subkey=b"b"), "unsigned record"),
        (make_entry(b"k", b"v", expiry, subkey=b"c", signer=CAROL), "has no membership certificate"),
        (make_entry(b"k", b"v", expiry, subkey=b"d", signer=CAROL, cert=cert(ALICE)), "is for peer"),
        (make_entry(b"k", b"v", expiry, subkey=b"e", signer=CAROL, cert=b"junk"), "malformed"),
        (
            make_entry(b"k", b"v", expiry, subkey=b"f", signer=CAROL, cert=cert(CAROL, by=OTHER_AUTH)),
            "another authority",
        ),
    ]
    for entry, reason in refused:
        with pytest.raises(RecordRefused, match=reason):
            store.put(entry, NOW, BOB.peer_id)
        with pytest.raises(RecordRefused, match=reason):
            check_entry(entry, NOW, limits, m)
        check_entry(entry, NOW, limits)  # an open run takes them all
    assert store.get(key_id(b"k"), NOW) == [good]
    # Once its author's certificate has expired, an entry is no longer served (nor replicated).
    late = make_entry(b"k2", b"v", NOW + 2 * HOUR, signer=ALICE, cert=cert(ALICE))
    store.put(late, NOW, BOB.peer_id)
    assert store.get(key_id(b"k2"), NOW + HOUR) == []
    assert late not in store.all_entries(NOW + HOUR)


def test_the_certificate_field_is_absent_from_open_run_entries() -> None:
    entry = make_entry(b"k", b"v", NOW, signer=ALICE)
    assert entry.to_obj() == [b"k", b"", b"v", NOW, entry.public_key, entry.signature]  # (no cert)
    with_cert = make_entry(b"k", b"v", NOW, signer=ALICE, cert=cert(ALICE))
    assert with_cert.to_obj()[-1] == cert(ALICE)
    assert type(with_cert).from_obj(with_cert.to_obj()) == with_cert
    assert with_cert.signed_payload() == entry.signed_payload()  # the author's signature is unchanged
    assert with_cert.nbytes() == entry.nbytes() + len(cert(ALICE))


# ---- the handshake of a private run -----------------------------------------------------------


def member(identity: Identity | None, certificate: bytes | None = None) -> Membership | None:
    """A private-run Membership holding ``certificate`` (None identity: an open-run peer)."""
    return None if identity is None else Membership(AUTH.public_key, RUN, certificate)


CERTS = [
    pytest.param(lambda who: cert(who), None, id="valid"),
    pytest.param(lambda who: cert(who, run=""), None, id="valid-any-run"),
    pytest.param(lambda who: None, "has no membership certificate", id="none"),
    pytest.param(
        lambda who: cert(who, not_before=NOW - 2 * HOUR, expires=NOW - 1), "expired on", id="expired"
    ),
    pytest.param(
        lambda who: cert(who, not_before=NOW + HOUR, expires=NOW + 2 * HOUR),
        "not valid before",
        id="not-yet-valid",
    ),
    pytest.param(lambda who: cert(CAROL), f"is for peer {CAROL.peer_id}", id="wrong-peer"),
    pytest.param(lambda who: cert(who, run="other-run"), "for run 'other-run'", id="wrong-run"),
    pytest.param(lambda who: cert(who, by=OTHER_AUTH), "another authority", id="other-authority"),
    pytest.param(lambda who: b"\x00garbage", "malformed", id="garbage"),
    pytest.param(lambda who: flip(cert(who), len(cert(who)) - 1), "does not verify", id="bad-signature"),
]


@pytest.mark.parametrize(("initiator_cert", "reason"), CERTS)
def test_private_responder_judges_the_initiators_certificate(
    initiator_cert: Callable[[Identity], bytes | None], reason: str | None
) -> None:
    init = InitiatorHandshake(
        ALICE, RUN, BOB.peer_id, membership=member(ALICE, initiator_cert(ALICE)), now=NOW
    )
    resp = ResponderHandshake(BOB, RUN, membership=member(BOB, cert(BOB)), now=NOW)
    reply = resp.receive(init.start())
    assert reply is not None
    finish = init.receive(reply)
    assert init.expects_verdict
    assert init.result is None  # not before the responder's verdict
    if reason is None:
        accept = resp.receive(finish)
        assert accept is not None
        assert isinstance(decode_frame(accept), Accept)
        init.receive_verdict(accept)
        assert init.result is not None
        assert resp.result is not None
        assert init.result.send_key == resp.result.recv_key
        assert init.result.recv_key == resp.result.send_key
        assert resp.result.remote_certificate is not None
        assert resp.result.remote_certificate.peer == ALICE.peer_id
        assert init.result.remote_certificate is not None
        assert init.result.remote_certificate.peer == BOB.peer_id
        return
    with pytest.raises(HandshakeRefused) as refused:
        resp.receive(finish)
    assert refused.value.code == "membership"
    assert refused.value.by_remote is False
    assert reason in refused.value.reason
    assert str(ALICE.peer_id) in refused.value.reason  # the authority can issue one from this line
    assert resp.result is None
    # The host sends the refusal as the verdict; the initiator reports it as the remote's decision.
    with pytest.raises(HandshakeRefused) as remote:
        init.receive_verdict(reject_frame(refused.value.code, refused.value.reason))
    assert (remote.value.code, remote.value.reason, remote.value.by_remote) == (
        "membership",
        refused.value.reason,
        True,
    )
    assert init.result is None


@pytest.mark.parametrize(("responder_cert", "reason"), CERTS)
def test_private_initiator_judges_the_responders_certificate(
    responder_cert: Callable[[Identity], bytes | None], reason: str | None
) -> None:
    init = InitiatorHandshake(ALICE, RUN, BOB.peer_id, membership=member(ALICE, cert(ALICE)), now=NOW)
    resp = ResponderHandshake(BOB, RUN, membership=member(BOB, responder_cert(BOB)), now=NOW)
    reply = resp.receive(init.start())
    assert reply is not None
    if reason is None:
        finish = init.receive(reply)
        accept = resp.receive(finish)
        assert accept is not None
        init.receive_verdict(accept)
        assert init.result is not None
        return
    with pytest.raises(HandshakeRefused) as refused:
        init.receive(reply)
    assert refused.value.code == "membership"
    assert refused.value.by_remote is False
    assert reason in refused.value.reason
    assert str(BOB.peer_id) in refused.value.reason
    assert init.result is None
    # The host sends the refusal instead of the finish; the responder reads the reason.
    with pytest.raises(HandshakeRefused) as remote:
        resp.receive(reject_frame(refused.value.code, refused.value.reason))
    assert remote.value.by_remote is True
    assert remote.value.code == "membership"


def test_open_dialer_is_refused_by_a_private_listener_with_a_reason_it_can_print() -> None:
    init = InitiatorHandshake(ALICE, RUN, BOB.peer_id)  # an open-swarm peer: no authority, no certificate
    resp = ResponderHandshake(BOB, RUN, membership=member(BOB, cert(BOB)), now=NOW)
    finish = init.receive(resp.receive(init.start()) or b"")
    assert init.expects_verdict  # the listener's proof named its authority
    with pytest.raises(HandshakeRefused) as refused:
        resp.receive(finish)
    assert refused.value.code == "membership"
    assert "has no membership certificate" in refused.value.reason
    assert authority_key_text(AUTH.public_key) in refused.value.reason


def test_private_dialer_refuses_an_open_listener() -> None:
    init = InitiatorHandshake(ALICE, RUN, BOB.peer_id, membership=member(ALICE, cert(ALICE)), now=NOW)
    resp = ResponderHandshake(BOB, RUN)
    with pytest.raises(HandshakeRefused) as refused:
        init.receive(resp.receive(init.start()) or b"")
    assert refused.value.code == "membership"
    assert f"peer {BOB.peer_id} has no membership certificate" in refused.value.reason


def test_open_run_proofs_carry_no_new_fields() -> None:
    # Byte for byte what peers without private runs send: the box holds {public_key, signature} only.
    init, resp = InitiatorHandshake(ALICE, RUN, None), ResponderHandshake(BOB, RUN)
    reply = resp.receive(init.start())
    assert reply is not None
    finish = init.receive(reply)
    assert not init.expects_verdict
    assert init.result is not None
    assert resp.receive(finish) is None
    assert resp.result is not None
    assert resp.result.remote_certificate is None
    open_proof = len(pack({"public_key": BOB.public_key, "signature": b"\x00" * 64}))
    msg = decode_frame(reply)
    assert isinstance(msg, Reply)
    assert len(msg.box) == open_proof + sodium.crypto_aead_aegis256_ABYTES


def test_a_private_handshake_needs_the_time() -> None:
    with pytest.raises(LocalProtocolError, match="current time"):
        InitiatorHandshake(ALICE, RUN, None, membership=member(ALICE, cert(ALICE)))
    with pytest.raises(LocalProtocolError, match="current time"):
        ResponderHandshake(BOB, RUN, membership=member(BOB, cert(BOB)))


def _private_pair() -> tuple[InitiatorHandshake, ResponderHandshake, bytes]:
    init = InitiatorHandshake(ALICE, RUN, BOB.peer_id, membership=member(ALICE, cert(ALICE)), now=NOW)
    resp = ResponderHandshake(BOB, RUN, membership=member(BOB, cert(BOB)), now=NOW)
    finish = init.receive(resp.receive(init.start()) or b"")
    return init, resp, finish


def test_tampered_or_replayed_acceptance_is_refused() -> None:
    init, resp, finish = _private_pair()
    accept = resp.receive(finish)
    assert accept is not None
    for index in range(len(accept)):
        fresh, _, _ = _private_pair()
        with pytest.raises(RemoteProtocolError):
            fresh.receive_verdict(flip(accept, index))
        assert fresh.result is None
    # An acceptance from another session (other randomness) does not authenticate here.
    other, _, _ = _private_pair()
    with pytest.raises(RemoteProtocolError, match="does not authenticate"):
        other.receive_verdict(accept)
    init.receive_verdict(accept)
    with pytest.raises(LocalProtocolError, match="state done"):
        init.receive_verdict(accept)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (lambda: encode_frame(Accept(b"")), "does not authenticate"),
        (lambda: encode_frame(Accept(b"\x00" * 64)), "does not authenticate"),
        (lambda: encode_frame(Reply(b"\x09" * 32, b"")), "expected an accept, got Reply"),
        (lambda: b"\xc1", "malformed msgpack"),
    ],
)
def test_bad_verdicts_are_refused(frame: Callable[[], bytes], reason: str) -> None:
    init, _, _ = _private_pair()
    with pytest.raises(RemoteProtocolError, match=reason):
        init.receive_verdict(frame())
    assert init.result is None


def test_verdict_out_of_turn_is_a_local_error() -> None:
    init = InitiatorHandshake(ALICE, RUN, None)
    with pytest.raises(LocalProtocolError, match="verdict in state start"):
        init.receive_verdict(b"")


def test_oversized_certificate_in_a_proof_is_a_protocol_error() -> None:
    huge = b"\x00" * (MAX_CERT_BYTES + 1)
    init = InitiatorHandshake(ALICE, RUN, BOB.peer_id, membership=member(ALICE, huge), now=NOW)
    resp = ResponderHandshake(BOB, RUN, membership=member(BOB, cert(BOB)), now=NOW)
    finish = init.receive(resp.receive(init.start()) or b"")
    with pytest.raises(RemoteProtocolError, match="exceeds 1024"):
        resp.receive(finish)
