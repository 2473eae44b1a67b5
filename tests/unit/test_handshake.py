"""The sans-IO handshake, driven synchronously frame by frame (no event loop)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from p2ptrain.errors import HandshakeRefused, LocalProtocolError, RemoteProtocolError
from p2ptrain.identity import Identity, PeerID
from p2ptrain.idwork import find_work
from p2ptrain.net.handshake import (
    MAX_HANDSHAKE_FRAME,
    MAX_RUN_ID,
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    Finish,
    Hello,
    InitiatorHandshake,
    Reject,
    Reply,
    ResponderHandshake,
    WorkRefused,
    decode_frame,
    encode_frame,
    reject_frame,
)
from p2ptrain.wire.codec import pack

ALICE = Identity.from_seed(b"\x01" * 32)  # initiator
BOB = Identity.from_seed(b"\x02" * 32)  # responder
CAROL = Identity.from_seed(b"\x03" * 32)  # a third party
RUN = "run-1"

# Curve25519 points of small order (and their non-canonical encodings): a DH with them yields a
# predictable secret, so they must be refused.
LOW_ORDER_POINTS = [
    bytes(32),
    b"\x01" + bytes(31),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    b"\xec" + b"\xff" * 30 + b"\x7f",  # p - 1
    b"\xed" + b"\xff" * 30 + b"\x7f",  # p
    b"\xee" + b"\xff" * 30 + b"\x7f",  # p + 1
]


def fixed_rng(tag: bytes) -> Callable[[int], bytes]:
    """A deterministic randomness source, for reproducible frames."""
    counter = itertools.count()

    def rng(n: int) -> bytes:
        return hashlib.blake2b(tag + next(counter).to_bytes(8, "big"), digest_size=n).digest()

    return rng


@dataclass
class Frames:
    hello: bytes
    reply: bytes
    finish: bytes


def pair(
    *,
    expected: PeerID | None = None,
    init_run: str = RUN,
    resp_run: str = RUN,
    init_rng: bytes = b"i",
    resp_rng: bytes = b"r",
    responder_identity: object = BOB,
) -> tuple[InitiatorHandshake, ResponderHandshake]:
    init = InitiatorHandshake(ALICE, init_run, expected, rng=fixed_rng(init_rng))
    resp = ResponderHandshake(responder_identity, resp_run, rng=fixed_rng(resp_rng))  # type: ignore[arg-type]
    return init, resp


def complete(init: InitiatorHandshake, resp: ResponderHandshake) -> Frames:
    hello = init.start()
    reply = resp.receive(hello)
    assert reply is not None
    finish = init.receive(reply)
    assert resp.receive(finish) is None
    return Frames(hello, reply, finish)


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    b = bytearray(data)
    b[index] ^= mask
    return bytes(b)


class Impostor:
    """An identity that claims one peer id but holds another key (or signs with a third)."""

    def __init__(self, claims: Identity, key: Identity, signer: Identity | None = None) -> None:
        self.peer_id = claims.peer_id
        self.public_key = key.public_key
        self._signer = signer or key

    def sign(self, message: bytes) -> bytes:
        return self._signer.sign(message)


# ---- success -----------------------------------------------------------------------------------


@pytest.mark.parametrize("expected", [None, BOB.peer_id], ids=["unverified", "verified"])
@pytest.mark.parametrize("run_id", ["", RUN, "x" * MAX_RUN_ID, "ünïcode-run"])
def test_full_exchange_yields_matching_keys(expected: PeerID | None, run_id: str) -> None:
    init = InitiatorHandshake(ALICE, run_id, expected)
    resp = ResponderHandshake(BOB, run_id)
    assert init.result is None
    assert resp.result is None
    complete(init, resp)
    i, r = init.result, resp.result
    assert i is not None
    assert r is not None
    assert i.send_key == r.recv_key
    assert i.recv_key == r.send_key
    assert i.send_key != i.recv_key
    assert len(i.send_key) == len(i.recv_key) == 32
    assert i.transcript == r.transcript
    assert i.remote_peer == BOB.peer_id
    assert i.remote_public_key == BOB.public_key
    assert r.remote_peer == ALICE.peer_id
    assert r.remote_public_key == ALICE.public_key


def test_frames_are_small_and_well_formed() -> None:
    frames = complete(*pair(expected=BOB.peer_id))
    hello, reply, finish = (decode_frame(f) for f in (frames.hello, frames.reply, frames.finish))
    assert isinstance(hello, Hello)
    assert hello.proto == PROTOCOL_NAME
    assert hello.version == PROTOCOL_VERSION
    assert hello.run_id == RUN
    assert hello.dialed == BOB.peer_id.digest
    assert isinstance(reply, Reply)
    assert isinstance(finish, Finish)
    # The responder's identity travels encrypted: its public key is not visible in the reply.
    assert BOB.public_key not in frames.reply
    assert ALICE.public_key not in frames.finish
    assert all(len(f) < MAX_HANDSHAKE_FRAME for f in (frames.hello, frames.reply, frames.finish))


def test_unverified_dial_sends_no_dialed_id() -> None:
    init, _ = pair(expected=None)
    hello = decode_frame(init.start())
    assert isinstance(hello, Hello)
    assert hello.dialed is None


def test_deterministic_rng_gives_deterministic_frames_and_keys() -> None:
    a_init, a_resp = pair(expected=BOB.peer_id)
    b_init, b_resp = pair(expected=BOB.peer_id)
    a, b = complete(a_init, a_resp), complete(b_init, b_resp)
    assert a == b
    assert a_init.result == b_init.result
    assert a_resp.result == b_resp.result


@pytest.mark.parametrize(("init_rng", "resp_rng"), [(b"other", b"r"), (b"i", b"other")])
def test_fresh_randomness_gives_fresh_session_keys(init_rng: bytes, resp_rng: bytes) -> None:
    base_init, base_resp = pair()
    complete(base_init, base_resp)
    init, resp = pair(init_rng=init_rng, resp_rng=resp_rng)
    complete(init, resp)
    assert init.result is not None
    assert base_init.result is not None
    assert init.result.send_key != base_init.result.send_key
    assert init.result.recv_key != base_init.result.recv_key
    assert init.result.transcript != base_init.result.transcript


def test_sessions_are_independent_of_direction_labels() -> None:
    # Swapping roles gives each side its peer's id and a different transcript.
    i1, r1 = InitiatorHandshake(ALICE, RUN, BOB.peer_id), ResponderHandshake(BOB, RUN)
    i2, r2 = InitiatorHandshake(BOB, RUN, ALICE.peer_id), ResponderHandshake(ALICE, RUN)
    complete(i1, r1)
    complete(i2, r2)
    assert i1.result is not None
    assert i2.result is not None
    assert i1.result.remote_peer == BOB.peer_id
    assert i2.result.remote_peer == ALICE.peer_id
    assert i1.result.transcript != i2.result.transcript


# ---- refusals ----------------------------------------------------------------------------------


def _hello_frame(**changes: object) -> bytes:
    fields: dict[str, object] = {
        "proto": PROTOCOL_NAME,
        "version": PROTOCOL_VERSION,
        "run_id": RUN,
        "ephemeral": b"\x09" * 32,
        "dialed": None,
    }
    fields.update(changes)
    return encode_frame(Hello(**fields))  # type: ignore[arg-type]


REFUSALS = [
    pytest.param(
        lambda: InitiatorHandshake(ALICE, "other-run", None).start(), "run_id", "'run-1'", id="run-id"
    ),
    pytest.param(
        lambda: InitiatorHandshake(ALICE, RUN, None, version=PROTOCOL_VERSION + 1).start(),
        "version",
        f"version {PROTOCOL_VERSION + 1}",
        id="version",
    ),
    pytest.param(
        lambda: InitiatorHandshake(ALICE, RUN, CAROL.peer_id).start(),
        "peer_id",
        str(CAROL.peer_id),
        id="dialed-other-peer",
    ),
    pytest.param(lambda: _hello_frame(dialed=b"\x05" * 16), "peer_id", "peer None", id="dialed-short"),
    pytest.param(lambda: _hello_frame(proto="not-p2ptrain"), "protocol", PROTOCOL_NAME, id="protocol"),
]


@pytest.mark.parametrize(("make_hello", "code", "detail"), REFUSALS)
def test_responder_refuses_and_initiator_reads_the_reason(
    make_hello: Callable[[], bytes], code: str, detail: str
) -> None:
    resp = ResponderHandshake(BOB, RUN)
    with pytest.raises(HandshakeRefused) as refused:
        resp.receive(make_hello())
    assert refused.value.code == code
    assert refused.value.by_remote is False
    assert detail in refused.value.reason
    assert resp.result is None

    # The driver sends the refusal back; the initiator reports it as the remote's decision.
    frame = reject_frame(refused.value.code, refused.value.reason)
    init = InitiatorHandshake(ALICE, RUN, None)
    init.start()
    with pytest.raises(HandshakeRefused) as remote:
        init.receive(frame)
    assert remote.value.code == code
    assert remote.value.reason == refused.value.reason
    assert remote.value.by_remote is True
    assert "remote refused the handshake" in str(remote.value)
    assert init.result is None


@pytest.mark.parametrize(("make_hello", "code", "detail"), REFUSALS)
def test_responder_stays_failed_after_refusing(
    make_hello: Callable[[], bytes], code: str, detail: str
) -> None:
    resp = ResponderHandshake(BOB, RUN)
    with pytest.raises(HandshakeRefused):
        resp.receive(make_hello())
    good_hello = InitiatorHandshake(ALICE, RUN, BOB.peer_id).start()
    with pytest.raises(RemoteProtocolError, match="state failed"):
        resp.receive(good_hello)


def test_initiator_refuses_a_responder_that_proves_another_identity() -> None:
    # A man in the middle answers for BOB (passing BOB's dialed-id check) but can only prove CAROL's key.
    init, resp = pair(expected=BOB.peer_id, responder_identity=Impostor(claims=BOB, key=CAROL))
    reply = resp.receive(init.start())
    assert reply is not None
    with pytest.raises(HandshakeRefused) as refused:
        init.receive(reply)
    assert refused.value.code == "peer_id"
    assert refused.value.by_remote is False
    assert str(BOB.peer_id) in refused.value.reason
    assert str(CAROL.peer_id) in refused.value.reason
    assert init.result is None
    with pytest.raises(LocalProtocolError, match="state failed"):
        init.receive(reply)


def test_unverified_initiator_learns_whoever_answers() -> None:
    init, resp = pair(expected=None, responder_identity=CAROL)
    complete(init, resp)
    assert init.result is not None
    assert init.result.remote_peer == CAROL.peer_id


@pytest.mark.parametrize("side", ["responder", "initiator"])
def test_proof_signed_by_a_different_key_is_refused(side: str) -> None:
    # The proof names one public key but carries a signature by another: the signature must not verify.
    liar = Impostor(claims=BOB if side == "responder" else ALICE, key=BOB, signer=CAROL)
    if side == "responder":
        init, resp = pair(responder_identity=liar)
        reply = resp.receive(init.start())
        assert reply is not None
        with pytest.raises(RemoteProtocolError, match="signature does not verify"):
            init.receive(reply)
    else:
        init = InitiatorHandshake(liar, RUN, None)  # type: ignore[arg-type]
        resp = ResponderHandshake(BOB, RUN)
        reply = resp.receive(init.start())
        assert reply is not None
        finish = init.receive(reply)
        with pytest.raises(RemoteProtocolError, match="signature does not verify"):
            resp.receive(finish)
        assert resp.result is None


def test_responder_reads_a_reject_from_the_initiator() -> None:
    init, resp = pair()
    resp.receive(init.start())
    with pytest.raises(HandshakeRefused) as refused:
        resp.receive(reject_frame("peer_id", "not who I dialed"))
    assert refused.value.by_remote is True
    assert refused.value.code == "peer_id"
    assert refused.value.reason == "not who I dialed"


def test_reject_frame_truncates_long_fields() -> None:
    msg = decode_frame(reject_frame("c" * 100, "r" * 1000))
    assert msg == Reject(code="c" * 32, reason="r" * 512)


# ---- tampering and replay ----------------------------------------------------------------------


def _reference_frames() -> Frames:
    return complete(*pair())


@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_tampering_any_byte_of_the_reply_fails_the_handshake(mask: int) -> None:
    reply = _reference_frames().reply
    for index in range(len(reply)):
        init, resp = pair()
        assert resp.receive(init.start()) == reply  # deterministic: the same session every time
        try:
            finish = init.receive(flip(reply, index, mask))
        except RemoteProtocolError:
            assert init.result is None
            continue
        # The initiator may accept an altered reply only if the change is outside what it checks; the
        # transcript then differs and the responder refuses the finish.
        with pytest.raises(RemoteProtocolError):
            resp.receive(finish)
        assert resp.result is None


@pytest.mark.parametrize("mask", [0x01, 0x80])
def test_tampering_any_byte_of_the_finish_fails_the_handshake(mask: int) -> None:
    finish = _reference_frames().finish
    for index in range(len(finish)):
        init, resp = pair()
        reply = resp.receive(init.start())
        assert reply is not None
        assert init.receive(reply) == finish
        with pytest.raises(RemoteProtocolError):
            resp.receive(flip(finish, index, mask))
        assert resp.result is None


def test_tampered_hello_fails_the_handshake() -> None:
    hello = _reference_frames().hello
    for index in range(len(hello)):
        init, resp = pair()
        init.start()
        try:
            reply = resp.receive(flip(hello, index))
        except (RemoteProtocolError, HandshakeRefused):
            continue
        assert reply is not None
        # The responder signed a transcript with a different hello: the initiator cannot open it.
        with pytest.raises(RemoteProtocolError):
            init.receive(reply)


def test_replayed_finish_from_another_session_fails() -> None:
    recorded = _reference_frames()
    # Same initiator randomness (so even the hello is identical), fresh responder randomness.
    init, resp = pair(resp_rng=b"fresh")
    assert init.start() == recorded.hello
    assert resp.receive(recorded.hello) != recorded.reply
    with pytest.raises(RemoteProtocolError, match="does not authenticate"):
        resp.receive(recorded.finish)
    assert resp.result is None


def test_replayed_reply_from_another_session_fails() -> None:
    recorded = _reference_frames()
    init, _ = pair(init_rng=b"fresh")
    init.start()
    with pytest.raises(RemoteProtocolError, match="does not authenticate"):
        init.receive(recorded.reply)


def test_finish_replayed_twice_in_the_same_session_is_refused() -> None:
    init, resp = pair()
    frames = complete(init, resp)
    with pytest.raises(RemoteProtocolError, match="unexpected Finish"):
        resp.receive(frames.finish)


# ---- malformed ephemeral keys and proofs -------------------------------------------------------


@pytest.mark.parametrize("point", LOW_ORDER_POINTS, ids=lambda p: p.hex()[:8])
def test_responder_refuses_low_order_ephemeral(point: bytes) -> None:
    resp = ResponderHandshake(BOB, RUN)
    with pytest.raises(RemoteProtocolError, match="invalid ephemeral key"):
        resp.receive(_hello_frame(ephemeral=point))
    assert resp.result is None


@pytest.mark.parametrize("point", LOW_ORDER_POINTS, ids=lambda p: p.hex()[:8])
def test_initiator_refuses_low_order_ephemeral(point: bytes) -> None:
    init, resp = pair()
    reply = decode_frame(resp.receive(init.start()) or b"")
    assert isinstance(reply, Reply)
    with pytest.raises(RemoteProtocolError, match="invalid ephemeral key"):
        init.receive(encode_frame(Reply(point, reply.box)))


@pytest.mark.parametrize("length", [0, 1, 31])
def test_short_ephemeral_keys_are_refused(length: int) -> None:
    resp = ResponderHandshake(BOB, RUN)
    with pytest.raises(RemoteProtocolError, match="malformed ephemeral key"):
        resp.receive(_hello_frame(ephemeral=b"\x09" * length))
    init, resp = pair()
    resp.receive(init.start())
    with pytest.raises(RemoteProtocolError, match="malformed ephemeral key"):
        init.receive(encode_frame(Reply(b"\x09" * length, b"\x00" * 64)))


@pytest.mark.parametrize("box", [b"", b"\x00", b"\x00" * 31, b"\x00" * 32, b"\x00" * 200])
def test_garbage_proof_boxes_are_refused(box: bytes) -> None:
    init, resp = pair()
    reply = decode_frame(resp.receive(init.start()) or b"")
    assert isinstance(reply, Reply)
    with pytest.raises(RemoteProtocolError, match="handshake proof"):
        init.receive(encode_frame(Reply(reply.ephemeral, box)))

    init, resp = pair()
    init.receive(resp.receive(init.start()) or b"")
    with pytest.raises(RemoteProtocolError, match="handshake proof"):
        resp.receive(encode_frame(Finish(box)))


# ---- state machine misuse and frame decoding ---------------------------------------------------


def test_initiator_state_machine() -> None:
    init, resp = pair()
    with pytest.raises(LocalProtocolError, match="state start"):
        init.receive(b"")
    hello = init.start()
    with pytest.raises(LocalProtocolError, match="already started"):
        init.start()
    reply = resp.receive(hello)
    assert reply is not None
    init.receive(reply)
    with pytest.raises(LocalProtocolError, match="state done"):
        init.receive(reply)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (lambda: encode_frame(Finish(b"\x00" * 48)), "expected a reply, got Finish"),
        (lambda: _hello_frame(), "expected a reply, got Hello"),
    ],
)
def test_initiator_refuses_unexpected_frames(frame: Callable[[], bytes], reason: str) -> None:
    init, _ = pair()
    init.start()
    with pytest.raises(RemoteProtocolError, match=reason):
        init.receive(frame())


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (lambda: encode_frame(Finish(b"\x00" * 48)), "unexpected Finish in handshake state start"),
        (
            lambda: encode_frame(Reply(b"\x09" * 32, b"\x00" * 48)),
            "unexpected Reply in handshake state start",
        ),
    ],
)
def test_responder_refuses_unexpected_frames(frame: Callable[[], bytes], reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        ResponderHandshake(BOB, RUN).receive(frame())


def test_responder_refuses_a_second_hello() -> None:
    init, resp = pair()
    hello = init.start()
    resp.receive(hello)
    with pytest.raises(RemoteProtocolError, match="unexpected Hello in handshake state sent-reply"):
        resp.receive(hello)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "malformed msgpack"),
        (b"\x00" * (MAX_HANDSHAKE_FRAME + 1), "handshake frame too large"),
        (pack([1, 2]), "not a handshake frame"),
        (pack({"t": "bogus", "m": {}}), "not a handshake frame"),
        (pack({"m": {}}), "not a handshake frame"),
        (pack({"t": ["hello"], "m": {}}), "not a handshake frame"),  # unhashable tag
        (pack({"t": {"a": 1}, "m": {}}), "not a handshake frame"),
        (pack({"t": b"hello", "m": {}}), "not a handshake frame"),
        (pack({"t": "hello"}), "Hello: expected a map, got NoneType"),
        (pack({"t": "reply", "m": {"ephemeral": b"\x01" * 33, "box": b""}}), "length 33 exceeds 32"),
        (pack({"t": "reject", "m": {"code": 1, "reason": ""}}), "Reject.code: expected a string"),
    ],
)
def test_decode_frame_errors(data: bytes, reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        decode_frame(data)


@pytest.mark.parametrize(
    "msg",
    [
        Hello(PROTOCOL_NAME, 1, RUN, b"\x01" * 32, None),
        Hello(PROTOCOL_NAME, 1, RUN, b"\x01" * 32, b"\x02" * 32),
        Reply(b"\x01" * 32, b"box"),
        Finish(b"box"),
        Reject("code", "reason"),
    ],
)
def test_encode_decode_frame_round_trip(msg: Hello | Reply | Finish | Reject) -> None:
    assert decode_frame(encode_frame(msg)) == msg


# ---- id work (runs that price ids) -------------------------------------------------------------------

BITS = 10
ALICE_WORK, BOB_WORK = find_work(ALICE.peer_id, BITS), find_work(BOB.peer_id, BITS)


def test_peers_whose_ids_carry_the_work_complete_the_handshake() -> None:
    init = InitiatorHandshake(ALICE, RUN, None, work=ALICE_WORK, required_work=BITS)
    resp = ResponderHandshake(BOB, RUN, work=BOB_WORK, required_work=BITS)
    complete(init, resp)
    assert init.result is not None and resp.result is not None


def test_a_dialer_without_the_work_learns_how_much_the_listener_asks() -> None:
    init = InitiatorHandshake(ALICE, RUN, None)
    resp = ResponderHandshake(BOB, RUN, work=BOB_WORK, required_work=BITS)
    reply = resp.receive(init.start())
    assert reply is not None
    with pytest.raises(WorkRefused) as info:
        init.receive(reply)
    assert info.value.needs == BITS and info.value.code == "id_work"


class CarelessDialer(InitiatorHandshake):
    """A hostile dialer: it ignores what the listener asks and sends its finish anyway."""

    def _check_own_work(self, needs: int | None) -> None:
        pass


def test_a_listener_refuses_a_dialer_that_finishes_without_the_work() -> None:
    init = CarelessDialer(ALICE, RUN, None, work=BOB_WORK)  # Bob's nonce earns Alice nothing
    resp = ResponderHandshake(BOB, RUN, work=BOB_WORK, required_work=BITS)
    reply = resp.receive(init.start())
    assert reply is not None
    with pytest.raises(HandshakeRefused, match="dialer's id carries 0 bits of work, this run asks for 10"):
        resp.receive(init.receive(reply))
    assert resp.result is None


def test_a_dialer_refuses_a_listener_without_the_work() -> None:
    init = InitiatorHandshake(ALICE, RUN, None, work=ALICE_WORK, required_work=BITS)
    resp = ResponderHandshake(BOB, RUN)
    reply = resp.receive(init.start())
    assert reply is not None
    with pytest.raises(HandshakeRefused, match="listener's id carries"):
        init.receive(reply)
