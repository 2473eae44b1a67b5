"""Property tests: hostile bytes and objects never raise anything but RemoteProtocolError.

Each decoder that reads from the network is fed arbitrary bytes, msgpack encodings of arbitrary objects,
and near-valid structures (right tags and field names, arbitrary values). It may succeed or raise
:class:`RemoteProtocolError`; any other exception (TypeError, KeyError, OverflowError, ...) is a bug
that would escape the connection's error handling.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import types
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import p2ptrain
from p2ptrain.errors import InvalidSignature, RemoteProtocolError
from p2ptrain.identity import Identity, SignedEnvelope
from p2ptrain.net import frames
from p2ptrain.net.channel import FrameCipher, open_record, seal_record
from p2ptrain.net.handshake import Finish, Hello, Reject, Reply, decode_frame
from p2ptrain.wire.codec import pack, pack_array, unpack
from p2ptrain.wire.schema import Message, decode_message

FUZZ = settings(max_examples=300, deadline=None)
SIGNER = Identity.from_seed(b"\x07" * 32)

# ---- strategies --------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=80),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=12), st.binary(max_size=12)), children, max_size=6),
    )


msgpack_values = st.recursive(scalars, _containers, max_leaves=10)
"""Anything msgpack can encode and our unpacker can return (str or bytes map keys)."""

field_values = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=4), scalars, max_size=3),
)
"""Cheap, shallow values for one field: the interesting cases are type and bounds mismatches."""


def packed(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    return values.map(lambda v: msgpack.packb(v, use_bin_type=True))


def plausible(tp: Any, meta: Any) -> st.SearchStrategy[Any]:
    """Values of the annotated type, in and just outside the field's bounds."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.one_of(st.none(), plausible(inner, meta))
    if typing.get_origin(tp) is tuple:
        return st.lists(plausible(typing.get_args(tp)[0], {}), max_size=3)
    if isinstance(tp, type) and issubclass(tp, Message):
        return near_valid(tp)
    ge, le, max_len = (meta.get(k) for k in ("ge", "le", "max_len"))
    if tp is bool:
        return st.booleans()
    if tp is int:
        lo = -(2**63) if ge is None else int(ge) - 1
        hi = 2**64 - 1 if le is None else min(int(le) + 1, 2**64 - 1)
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo, lo + 1, hi - 1, hi]))
    if tp is float:
        lo, hi = (-1e300 if ge is None else ge - 1), (1e300 if le is None else le + 1)
        return st.one_of(st.floats(lo, hi), st.sampled_from([float(lo), float(hi), math.nan, math.inf]))
    limit = max_len if max_len is not None else 1024
    if tp is str:
        return st.one_of(st.text(max_size=min(limit, 40)), st.sampled_from(["x" * limit, "x" * (limit + 1)]))
    if tp is bytes:
        return st.one_of(
            st.binary(max_size=min(limit, 40)), st.sampled_from([b"x" * limit, b"x" * (limit + 1)])
        )
    raise AssertionError(f"no strategy for {tp!r}")


def near_valid(cls: type[Message]) -> st.SearchStrategy[dict[Any, Any]]:
    """Maps with ``cls``'s field names holding plausible or arbitrary values, plus an unknown field."""
    hints = typing.get_type_hints(cls)
    typed = {f.name: plausible(hints[f.name], f.metadata) for f in dataclasses.fields(cls)}
    mixed = {name: st.one_of(strategy, field_values) for name, strategy in typed.items()}
    extra = {"unknown": field_values}
    return st.one_of(
        st.fixed_dictionaries(typed, optional=extra),  # right types, values in and around bounds
        st.fixed_dictionaries(mixed, optional=extra),  # some fields of the wrong type
        st.fixed_dictionaries({}, optional={**mixed, **extra}),  # missing fields too
    )


hostile_bytes = st.one_of(st.binary(max_size=300), packed(msgpack_values))


def _only_remote_errors(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except RemoteProtocolError:
        pass


# ---- raw decoders ------------------------------------------------------------------------------


@FUZZ
@given(hostile_bytes)
def test_unpack_only_raises_remote_protocol_error(data: bytes) -> None:
    _only_remote_errors(unpack, data)


@FUZZ
@given(msgpack_values)
def test_unpack_round_trips_what_pack_makes(value: Any) -> None:
    # NaN != NaN, so compare encodings rather than values.
    assert pack(unpack(pack(value))) == pack(value)


@FUZZ
@given(st.lists(msgpack_values, max_size=40), st.sampled_from([0, 15, 16, 70_000]))
def test_an_array_of_packed_items_is_the_array_packed_whole(values: list[Any], pad: int) -> None:
    items = values + [0] * pad  # (the three sizes of msgpack's array header)
    assert pack_array([pack(v) for v in items]) == pack(items)


HANDSHAKE_KINDS = {"hello": Hello, "reply": Reply, "finish": Finish, "reject": Reject}


@st.composite
def handshake_like(draw: st.DrawFn) -> bytes:
    tag = draw(st.one_of(st.sampled_from(sorted(HANDSHAKE_KINDS)), msgpack_values))
    body = draw(
        near_valid(HANDSHAKE_KINDS[tag])
        if isinstance(tag, str) and tag in HANDSHAKE_KINDS
        else msgpack_values
    )
    return pack({"t": tag, "m": body})


@FUZZ
@given(st.one_of(hostile_bytes, handshake_like()))
def test_decode_frame_only_raises_remote_protocol_error(data: bytes) -> None:
    _only_remote_errors(decode_frame, data)


@FUZZ
@given(hostile_bytes)
def test_decode_header_only_raises_remote_protocol_error(data: bytes) -> None:
    _only_remote_errors(frames.decode_header, data)


@st.composite
def header_like(draw: st.DrawFn) -> bytes:
    # Kinds are drawn from the known ints (or out-of-range ints); 'k' of other types is covered by the
    # regression test below.
    kind = draw(st.one_of(st.sampled_from(sorted(frames.FRAME_KINDS)), st.integers(-(2**63), 2**64 - 1)))
    cls = frames.FRAME_KINDS.get(kind, frames.Request)
    obj = draw(near_valid(cls))
    obj["k"] = kind
    return pack(obj)


@st.composite
def header_array_like(draw: st.DrawFn) -> bytes:
    """A header as frames carry it: ``[kind, *fields]``, the fields near valid, some missing or extra."""
    kind = draw(st.one_of(st.sampled_from(sorted(frames.FRAME_KINDS)), st.integers(-(2**63), 2**64 - 1)))
    cls = frames.FRAME_KINDS.get(kind, frames.Request)
    obj = draw(near_valid(cls))
    values = [obj[f.name] for f in dataclasses.fields(cls) if f.name in obj]
    return pack([kind, *values, *draw(st.lists(field_values, max_size=2))])


@FUZZ
@given(st.one_of(header_like(), header_array_like()))
def test_decode_header_near_valid_only_raises_remote_protocol_error(data: bytes) -> None:
    _only_remote_errors(frames.decode_header, data)


@pytest.mark.parametrize("kind", [[1], {"a": 1}], ids=["list", "map"])
def test_decode_header_unhashable_kind(kind: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        frames.decode_header(pack({"k": kind, "id": 1}))
    with pytest.raises(RemoteProtocolError):
        frames.decode_header(pack([kind, 1]))


@pytest.mark.parametrize(
    "header",
    [
        frames.Request(7, "dht.store", 10.0, False, b"args"),
        frames.Response(8, b"result"),
        frames.Data(9),
        frames.Credit(9, 4096),
        frames.GoAway("bye"),
    ],
)
def test_a_header_reads_back_from_the_array_it_is_sent_as_and_from_an_older_peer_s_map(
    header: Message,
) -> None:
    data = frames.encode_header(header)
    assert isinstance(unpack(data), list)
    assert frames.decode_header(data) == header
    old = {f.name: getattr(header, f.name) for f in dataclasses.fields(header)}
    assert frames.decode_header(pack(old | {"k": unpack(data)[0]})) == header
    assert len(data) < len(pack(old | {"k": 1}))


@FUZZ
@given(st.one_of(hostile_bytes, packed(st.lists(msgpack_values, min_size=4, max_size=4))))
def test_envelope_from_bytes_only_raises_remote_protocol_error(data: bytes) -> None:
    _only_remote_errors(SignedEnvelope.from_bytes, data)


@FUZZ
@given(st.binary(max_size=300))
def test_open_record_only_raises_remote_protocol_error(data: bytes) -> None:
    # Bytes nobody sealed with the key never open, whatever their layout.
    with pytest.raises(RemoteProtocolError):
        open_record(FrameCipher(bytes(32)), data)


@FUZZ
@given(
    st.binary(max_size=40),
    st.binary(max_size=200),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=3),
)
def test_open_record_refuses_every_altered_frame(header: bytes, body: bytes, flips) -> None:
    sealed = seal_record(FrameCipher(bytes(32)), header, body)
    frame = bytearray(sealed)
    for index, mask in flips:
        frame[index % len(frame)] ^= mask
    assume(frame != sealed)  # two flips of one byte may cancel out
    with pytest.raises(RemoteProtocolError):
        open_record(FrameCipher(bytes(32)), frame)


# ---- signed envelopes --------------------------------------------------------------------------


@FUZZ
@given(domain=st.text(max_size=64), payload=st.binary(max_size=2000))
def test_envelope_round_trip(domain: str, payload: bytes) -> None:
    env = SignedEnvelope.from_bytes(SignedEnvelope.seal(SIGNER, domain, payload).to_bytes())
    assert env.open(domain, expected_signer=SIGNER.peer_id) == payload


@FUZZ
@given(payload=st.binary(min_size=1, max_size=200), data=st.data())
def test_any_bit_flip_in_an_envelope_is_caught(payload: bytes, data: st.DataObject) -> None:
    original = SignedEnvelope.seal(SIGNER, "dht-record", payload)
    wire = bytearray(original.to_bytes())
    index = data.draw(st.integers(0, len(wire) - 1))
    wire[index] ^= 1 << data.draw(st.integers(0, 7))
    try:
        env = SignedEnvelope.from_bytes(bytes(wire))
        opened = env.open("dht-record", expected_signer=SIGNER.peer_id)
    except RemoteProtocolError:  # includes InvalidSignature
        return
    # Only a flip that changes nothing signed could get here, and then the payload is the original.
    assert opened == payload
    assert env == original


def test_invalid_signature_is_a_remote_protocol_error() -> None:
    # The property above relies on this: a bad signature is the remote's fault.
    assert issubclass(InvalidSignature, RemoteProtocolError)


# ---- schemas -----------------------------------------------------------------------------------


def _all_message_classes() -> list[type[Message]]:
    """Every wire message the package defines (all its modules imported): none can be forgotten here."""
    for info in pkgutil.walk_packages(p2ptrain.__path__, "p2ptrain."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found: set[type[Message]] = set()
    todo = list(Message.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return sorted((c for c in found if c.__module__.startswith("p2ptrain.")), key=lambda c: c.__qualname__)


SCHEMAS: list[type[Message]] = _all_message_classes()


def test_every_message_schema_is_fuzzed() -> None:
    names = {c.__name__ for c in SCHEMAS}
    for expected in ("Hello", "Request", "Manifest", "PartReq", "ProgressRecord", "StateInfo", "Attestation"):
        assert expected in names
    assert len(SCHEMAS) >= 40


@FUZZ
@given(cls=st.sampled_from(SCHEMAS), obj=msgpack_values)
def test_decode_message_arbitrary_objects(cls: type[Message], obj: Any) -> None:
    _only_remote_errors(decode_message, cls, obj)


@FUZZ
@given(data=st.data())
def test_decode_message_near_valid_maps(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(SCHEMAS))
    _accepted_round_trips(cls, data.draw(near_valid(cls)))


def _accepted_round_trips(cls: type[Message], obj: Any) -> None:
    """Decoding ``obj`` raises RemoteProtocolError, or gives a message that re-encodes and decodes to
    itself. (A message whose fields may hold more than a header's 64 KiB, a proof's manifest say,
    travels with its own larger limit.)"""
    try:
        msg = decode_message(cls, obj)
    except RemoteProtocolError:
        return
    packed = pack(msg.to_obj())
    assert decode_message(cls, unpack(packed, max_bytes=max(len(packed), 1))) == msg


POSITIONAL = [c for c in SCHEMAS if c._positional]


@FUZZ
@given(data=st.data())
def test_decode_message_near_valid_arrays(data: st.DataObject) -> None:
    """Positional messages as they travel: their fields in order, some wrong, missing or extra."""
    cls = data.draw(st.sampled_from(POSITIONAL))
    obj = data.draw(near_valid(cls))
    values = [obj.get(f.name) for f in dataclasses.fields(cls)][: data.draw(st.integers(0, 64))]
    values += data.draw(st.lists(field_values, max_size=2))
    _accepted_round_trips(cls, values)


def test_the_messages_sent_most_often_are_positional() -> None:
    names = {c.__name__ for c in POSITIONAL}
    assert {"Request", "Response", "Data", "Entry", "StoreReq", "FindValueReq", "ProgressRecord"} <= names


# ---- decoders of signed and relayed things ---------------------------------------------------------


def _decoders() -> list[Any]:
    from p2ptrain.averaging.audit import open_attestation, open_commit
    from p2ptrain.averaging.matchmaking import Announcement
    from p2ptrain.averaging.protocol import SignedManifest, open_decision
    from p2ptrain.training.optimizer.bans import _parse_bans

    peer = SIGNER.peer_id
    return [
        lambda d: Announcement.from_bytes(peer, d),
        lambda d: open_commit(d, peer, b"r" * 16, 0),
        lambda d: open_attestation(d, peer, b"r" * 16, 0, 4),
        lambda d: open_decision(d, peer, b"r" * 16, 4),
        lambda d: SignedManifest.verify(d, peer),
        lambda d: _parse_bans(d) and None,
    ]


@FUZZ
@given(
    index=st.integers(0, 5),
    data=st.one_of(
        hostile_bytes,
        st.binary(max_size=300).map(
            lambda p: SignedEnvelope.seal(SIGNER, "p2ptrain/averaging-commit", p).to_bytes()
        ),
    ),
)
def test_relayed_record_decoders_only_raise_remote_protocol_error(index: int, data: bytes) -> None:
    _only_remote_errors(_decoders()[index], data)
