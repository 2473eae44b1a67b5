"""Peer ids, key files and signed envelopes (pure: no event loop)."""

from __future__ import annotations

import hashlib
import os
import random
import stat
from pathlib import Path

import msgpack
import pytest

from p2ptrain.errors import IdentityError, InvalidSignature, RemoteProtocolError
from p2ptrain.identity import (
    KEPT_SIGNATURES,
    MAX_ENVELOPE_PAYLOAD,
    SIGNATURE_BYTES,
    Identity,
    PeerID,
    SignedEnvelope,
    load_identity,
    load_or_create_identity,
    remember_verified_signatures,
    save_identity,
    verify_signature,
)

SEED_A = bytes(range(32))
SEED_B = bytes(range(1, 33))


@pytest.fixture
def alice() -> Identity:
    return Identity.from_seed(SEED_A)


@pytest.fixture
def bob() -> Identity:
    return Identity.from_seed(SEED_B)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- peer ids ----------------------------------------------------------------------------------


def test_peer_id_is_blake2b_of_public_key(alice: Identity) -> None:
    expected = hashlib.blake2b(alice.public_key, digest_size=32).digest()
    assert alice.peer_id.digest == expected
    assert alice.peer_id == PeerID.from_public_key(alice.public_key)


def test_identity_from_seed_is_deterministic(alice: Identity, bob: Identity) -> None:
    again = Identity.from_seed(SEED_A)
    assert again.peer_id == alice.peer_id
    assert again.seed() == SEED_A
    assert alice.peer_id != bob.peer_id


def test_generated_identities_differ() -> None:
    assert Identity.generate().peer_id != Identity.generate().peer_id


@pytest.mark.parametrize("seed", [b"", b"\x00" * 31, b"\x00" * 33])
def test_identity_from_seed_refuses_wrong_length(seed: bytes) -> None:
    with pytest.raises(IdentityError, match="32 bytes"):
        Identity.from_seed(seed)


@pytest.mark.parametrize(
    "digest",
    [
        bytes(32),  # all zeros: every byte is a leading zero, encoded as '1'
        b"\x00\x00\x07" + bytes(range(29)),  # some leading zero bytes
        b"\xff" * 32,
        hashlib.blake2b(b"x", digest_size=32).digest(),
    ],
)
def test_peer_id_base58_round_trip(digest: bytes) -> None:
    pid = PeerID(digest)
    text = pid.to_string()
    assert str(pid) == text
    assert PeerID.from_string(text) == pid
    leading_zeros = len(digest) - len(digest.lstrip(b"\0"))
    assert text.startswith("1" * leading_zeros)
    assert not text[leading_zeros:].startswith("1")


def test_peer_id_known_base58_encoding() -> None:
    # Bitcoin alphabet: the value 57 is 'z', 58 is '21'; leading zero bytes are '1'.
    assert PeerID(bytes(31) + b"\x39").to_string() == "1" * 31 + "z"
    assert PeerID(bytes(31) + b"\x3a").to_string() == "1" * 31 + "21"


def test_peer_id_short_and_repr(alice: Identity) -> None:
    text = alice.peer_id.to_string()
    assert alice.peer_id.short() == f"{text[:6]}..{text[-4:]}"
    assert alice.peer_id.short() in repr(alice.peer_id)
    assert alice.peer_id.short() in repr(alice)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "decodes to 0 bytes"),
        ("0" * 44, "invalid base58 character '0'"),  # 0, O, I and l are not in the alphabet
        ("O" + "2" * 43, "invalid base58 character 'O'"),
        ("abc def", "invalid base58 character ' '"),
        ("2" * 10, "expected 32"),
        ("1" * 33, "decodes to 33 bytes"),
        ("z" * 60, "expected 32"),
    ],
)
def test_peer_id_from_string_errors(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match="not a peer id") as info:
        PeerID.from_string(text)
    assert reason in str(info.value)


@pytest.mark.parametrize("digest", [b"", b"\x01" * 31, b"\x01" * 33, "x" * 32])
def test_peer_id_constructor_checks_length_and_type(digest: object) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        PeerID(digest)  # type: ignore[arg-type]


def test_peer_id_from_public_key_checks_length() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        PeerID.from_public_key(b"\x01" * 31)


def test_peer_ids_are_ordered_by_digest() -> None:
    low, high = PeerID(bytes(32)), PeerID(b"\xff" * 32)
    assert low < high
    assert sorted([high, low]) == [low, high]


# ---- signatures --------------------------------------------------------------------------------


def test_sign_and_verify(alice: Identity, bob: Identity) -> None:
    sig = alice.sign(b"hello")
    verify_signature(alice.public_key, b"hello", sig)
    with pytest.raises(InvalidSignature, match="does not verify"):
        verify_signature(alice.public_key, b"hellO", sig)
    with pytest.raises(InvalidSignature, match="does not verify"):
        verify_signature(bob.public_key, b"hello", sig)
    with pytest.raises(InvalidSignature, match="malformed"):
        verify_signature(alice.public_key[:31], b"hello", sig)
    with pytest.raises(InvalidSignature, match="malformed"):
        verify_signature(alice.public_key, b"hello", sig[:63])


@pytest.mark.parametrize("seed", range(3))
def test_a_signature_checked_once_is_not_checked_again_and_nothing_else_passes_for_it(
    seed: int, alice: Identity, bob: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's memory of good signatures: a good one checked again costs no Ed25519 check, and
    whatever differs from it by a byte (the message, the signature, the key) or failed once is checked
    again and fails again, under random messages and mutations; the memory keeps at most its bound."""
    import nacl.signing

    checks = []
    real = nacl.signing.VerifyKey.verify

    def counted(self: nacl.signing.VerifyKey, *a: object, **k: object) -> bytes:
        checks.append(1)
        return real(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(nacl.signing.VerifyKey, "verify", counted)
    remember_verified_signatures(8)
    try:
        rng = random.Random(seed)
        for _ in range(40):
            signer = rng.choice([alice, bob])
            msg = rng.randbytes(rng.randrange(0, 300))
            sig = signer.sign(msg)
            verify_signature(signer.public_key, msg, sig)
            n = len(checks)
            verify_signature(signer.public_key, msg, sig)  # remembered
            assert len(checks) == n
            other = bob if signer is alice else alice
            forged = [
                (other.public_key, msg, sig),
                (signer.public_key, msg + b"x", sig),
                (signer.public_key, msg[1:], sig) if msg else (signer.public_key, b"y", sig),
            ]
            i = rng.randrange(SIGNATURE_BYTES)
            forged.append(
                (signer.public_key, msg, sig[:i] + bytes([sig[i] ^ 1 << rng.randrange(8)]) + sig[i + 1 :])
            )
            for pk, m, sg in forged:
                for _ in range(2):  # a failure is never remembered as good
                    with pytest.raises(InvalidSignature):
                        verify_signature(pk, m, sg)
        from p2ptrain import identity

        assert len(identity._verified._good) <= 8
    finally:
        remember_verified_signatures(KEPT_SIGNATURES)


# ---- key files ---------------------------------------------------------------------------------


def test_save_identity_creates_0600_file_and_loads_back(tmp_path: Path, alice: Identity) -> None:
    path = tmp_path / "node.key"
    save_identity(alice, path)
    assert _mode(path) == 0o600
    text = path.read_text()
    assert text.startswith("-----BEGIN P2PTRAIN ED25519 PRIVATE KEY-----\n")
    assert f"# peer id: {alice.peer_id}" in text
    loaded = load_identity(path)
    assert loaded.peer_id == alice.peer_id
    assert loaded.seed() == alice.seed()


def test_save_identity_refuses_to_overwrite(tmp_path: Path, alice: Identity, bob: Identity) -> None:
    path = tmp_path / "node.key"
    save_identity(alice, path)
    with pytest.raises(IdentityError, match="already exists"):
        save_identity(bob, path)
    assert load_identity(path).peer_id == alice.peer_id


def test_save_identity_overwrite_when_asked_resets_mode(
    tmp_path: Path, alice: Identity, bob: Identity
) -> None:
    path = tmp_path / "node.key"
    save_identity(alice, path)
    path.chmod(0o644)
    save_identity(bob, path, overwrite=True)
    assert _mode(path) == 0o600
    assert load_identity(path).peer_id == bob.peer_id


def test_save_identity_into_missing_folder_is_identity_error(tmp_path: Path, alice: Identity) -> None:
    with pytest.raises(IdentityError, match="cannot write"):
        save_identity(alice, tmp_path / "missing" / "node.key")


@pytest.mark.skipif(os.name != "posix", reason="permission bits are POSIX")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_load_identity_refuses_file_readable_by_others(tmp_path: Path, alice: Identity, mode: int) -> None:
    path = tmp_path / "node.key"
    save_identity(alice, path)
    path.chmod(mode)
    with pytest.raises(IdentityError, match="chmod 600") as info:
        load_identity(path)
    assert f"{mode:04o}" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.skipif(os.name != "posix", reason="permission bits are POSIX")
def test_load_identity_accepts_0400(tmp_path: Path, alice: Identity) -> None:
    path = tmp_path / "node.key"
    save_identity(alice, path)
    path.chmod(0o400)
    assert load_identity(path).peer_id == alice.peer_id


def test_load_identity_missing_file_says_how_to_create_one(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="keygen"):
        load_identity(tmp_path / "nope.key")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello world\n",
        b"\xff\xfe\x00binary garbage\x80",
        b"-----BEGIN P2PTRAIN ED25519 PRIVATE KEY-----\nnot base64!!\n"
        b"-----END P2PTRAIN ED25519 PRIVATE KEY-----\n",
        # valid base64, wrong length (16 bytes)
        b"-----BEGIN P2PTRAIN ED25519 PRIVATE KEY-----\nAAAAAAAAAAAAAAAAAAAAAA==\n"
        b"-----END P2PTRAIN ED25519 PRIVATE KEY-----\n",
        # footer only
        b"-----END P2PTRAIN ED25519 PRIVATE KEY-----\n",
    ],
)
def test_load_identity_refuses_garbage(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError) as info:
        load_identity(path)
    assert str(path) in str(info.value)


def test_load_or_create_identity_keeps_the_same_id(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.key"
    first, created = load_or_create_identity(path)
    assert created is True
    assert _mode(path) == 0o600
    assert _mode(path.parent) & 0o077 == 0
    second, created_again = load_or_create_identity(path)
    assert created_again is False
    assert second.peer_id == first.peer_id
    assert second.seed() == first.seed()


# ---- signed envelopes --------------------------------------------------------------------------


def test_envelope_seal_open(alice: Identity) -> None:
    env = SignedEnvelope.seal(alice, "dht-record", b"payload")
    assert env.signer == alice.peer_id
    assert env.open("dht-record") == b"payload"
    assert env.open("dht-record", expected_signer=alice.peer_id) == b"payload"


def test_envelope_wrong_domain(alice: Identity) -> None:
    env = SignedEnvelope.seal(alice, "dht-record", b"payload")
    with pytest.raises(InvalidSignature, match="'dht-record', expected 'manifest'"):
        env.open("manifest")


def test_envelope_domain_is_signed(alice: Identity) -> None:
    # Relabelling the domain does not help an attacker: the signature covers it.
    env = SignedEnvelope.seal(alice, "dht-record", b"payload")
    relabelled = SignedEnvelope("manifest", env.payload, env.public_key, env.signature)
    with pytest.raises(InvalidSignature, match="does not verify"):
        relabelled.open("manifest")


def test_envelope_wrong_expected_signer(alice: Identity, bob: Identity) -> None:
    env = SignedEnvelope.seal(alice, "d", b"payload")
    with pytest.raises(InvalidSignature, match="expected") as info:
        env.open("d", expected_signer=bob.peer_id)
    assert alice.peer_id.short() in str(info.value)
    assert bob.peer_id.short() in str(info.value)


def test_envelope_key_swap_is_refused(alice: Identity, bob: Identity) -> None:
    # Claiming someone else's key with one's own signature fails verification.
    env = SignedEnvelope.seal(alice, "d", b"payload")
    swapped = SignedEnvelope("d", env.payload, bob.public_key, env.signature)
    with pytest.raises(InvalidSignature):
        swapped.open("d", expected_signer=bob.peer_id)


def test_envelope_tampered_payload(alice: Identity) -> None:
    env = SignedEnvelope.seal(alice, "d", b"payload")
    bad = SignedEnvelope("d", b"paYload", env.public_key, env.signature)
    with pytest.raises(InvalidSignature, match="does not verify"):
        bad.open("d")


@pytest.mark.parametrize("index", [0, 31, 32, 63])
def test_envelope_tampered_signature(alice: Identity, index: int) -> None:
    env = SignedEnvelope.seal(alice, "d", b"payload")
    sig = bytearray(env.signature)
    sig[index] ^= 0x01
    bad = SignedEnvelope("d", env.payload, env.public_key, bytes(sig))
    with pytest.raises(InvalidSignature):
        bad.open("d")


@pytest.mark.parametrize(
    ("public_key", "signature"),
    [(b"\x01" * 31, b"\x00" * 64), (b"", b"\x00" * 64), (b"\x01" * 32, b"\x00" * 63), (b"\x01" * 32, b"")],
)
def test_envelope_malformed_key_or_signature(public_key: bytes, signature: bytes) -> None:
    with pytest.raises(InvalidSignature, match="malformed"):
        SignedEnvelope("d", b"payload", public_key, signature).open("d")


@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 100])
def test_envelope_bytes_round_trip(alice: Identity, payload: bytes) -> None:
    env = SignedEnvelope.seal(alice, "dht-record", payload)
    back = SignedEnvelope.from_bytes(env.to_bytes())
    assert back == env
    assert back.open("dht-record", expected_signer=alice.peer_id) == payload


def test_envelope_tampered_on_the_wire(alice: Identity) -> None:
    data = bytearray(SignedEnvelope.seal(alice, "d", b"payload-bytes").to_bytes())
    data[data.index(b"payload-bytes")] ^= 0x20
    with pytest.raises(InvalidSignature):
        SignedEnvelope.from_bytes(bytes(data)).open("d")


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x94",  # array of 4 announced, nothing follows
        _pack({"domain": "d"}),
        _pack(["d", b"p", b"k"]),
        _pack(["d", b"p", b"k", b"s", b"extra"]),
        _pack([1, b"p", b"k", b"s"]),
        _pack(["d", "p", b"k", b"s"]),
        _pack(["d", b"p", None, b"s"]),
        _pack(["x" * 65, b"p", b"k", b"s"]),
        _pack(["d", b"p", b"k", b"s"]) + b"\x00",  # trailing bytes
        b"\xd6\xff\x00\x00\x00\x00",  # a msgpack timestamp, not a list
        b"\x91" * 5000,  # deeply nested arrays
        b"\xc6\xff\xff\xff\xff",  # bin32 announcing 4 GiB
        b"\x92" * 1 + _pack("d")[:1],
        b"\x00" * (MAX_ENVELOPE_PAYLOAD + 257),  # too large to even look at
    ],
)
def test_envelope_from_bytes_malformed(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="envelope"):
        SignedEnvelope.from_bytes(data)
