"""The msgpack codec limits and schema validation of untrusted messages (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.wire import MAX_HEADER_BYTES, Message, bounded, decode_message, pack, unpack
from p2ptrain.wire.schema import DEFAULT_MAX_BYTES, DEFAULT_MAX_ITEMS, DEFAULT_MAX_STR

# ---- codec -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        None,
        True,
        0,
        -1,
        2**64 - 1,
        -(2**63),
        1.5,
        "",
        "héllo",
        b"",
        b"\x00\xff",
        [1, [2, [3]]],
        {"a": {"b": b"c"}},
    ],
)
def test_pack_unpack_round_trip(obj: Any) -> None:
    assert unpack(pack(obj)) == obj


def test_unpack_accepts_memoryview() -> None:
    assert unpack(memoryview(pack({"k": 1}))) == {"k": 1}


def test_unpack_refuses_oversized_input_before_decoding() -> None:
    data = pack(b"x" * MAX_HEADER_BYTES)  # a bin header plus the limit: just over
    with pytest.raises(RemoteProtocolError, match=f"exceeds the {MAX_HEADER_BYTES}-byte limit"):
        unpack(data)
    assert unpack(data, max_bytes=len(data)) == b"x" * MAX_HEADER_BYTES


def test_unpack_custom_limit() -> None:
    assert unpack(pack("abc"), max_bytes=4) == "abc"
    with pytest.raises(RemoteProtocolError, match="exceeds the 3-byte limit"):
        unpack(pack("abc"), max_bytes=3)


@pytest.mark.parametrize(
    "data",
    [
        msgpack.packb(msgpack.ExtType(5, b"hello")),
        msgpack.packb(msgpack.ExtType(0, b"")),
        b"\xd6\xff\x00\x00\x00\x01",  # the timestamp extension (type -1)
        msgpack.packb(msgpack.Timestamp(1, 0)),
        msgpack.packb([1, msgpack.ExtType(42, b"x" * 100)]),
    ],
)
def test_unpack_refuses_extension_types(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed msgpack"):
        unpack(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved byte
        b"\x92\x01",  # array of 2 with one element
        b"\xa5abc",  # str of 5 with 3 bytes
        pack(1) + pack(2),  # two objects
        b"\xa2\xff\xfe",  # invalid UTF-8 in a str
        b"\x81\x01\x02",  # map key that is an int
        b"\x81\x90\x02",  # map key that is an array
        b"\xdd\xff\xff\xff\xff",  # array32 announcing 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map32 announcing 4 billion entries
        b"\xdb\x7f\xff\xff\xff",  # str32 announcing 2 GiB
        b"\xc6\x7f\xff\xff\xff",  # bin32 announcing 2 GiB
        b"\x91" * 10_000,  # nesting deeper than the unpacker's stack
    ],
)
def test_unpack_malformed_is_remote_protocol_error(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="malformed msgpack"):
        unpack(data)


def test_unpack_container_limits_follow_max_bytes() -> None:
    # 100 items in 101 bytes is fine with a 200-byte limit, refused as "malformed" with 40.
    data = pack([0] * 100)
    assert unpack(data, max_bytes=200) == [0] * 100
    with pytest.raises(RemoteProtocolError):
        unpack(data, max_bytes=40)


# ---- schema ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point(Message):
    x: float
    y: float = 0.0


@dataclass(frozen=True)
class Sample(Message):
    name: str = bounded(max_len=8)
    count: int = bounded(ge=0, le=10)
    weight: float = bounded(ge=-1.0, le=1.0)
    blob: bytes = bounded(max_len=4)
    flag: bool
    tags: tuple[str, ...] = bounded(max_len=3)
    where: Point
    path: tuple[Point, ...] = ()
    note: str | None = None
    size: int | None = bounded(None, ge=1)


@dataclass(frozen=True)
class Plain(Message):
    s: str = ""
    b: bytes = b""
    items: tuple[int, ...] = ()
    nested: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Checked(Message):
    """A message whose constructor validates more (cross-field)."""

    lo: int
    hi: int
    extra: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.lo > self.hi:
            raise ValueError("lo must not exceed hi")


def _valid() -> dict[str, Any]:
    return {
        "name": "abc",
        "count": 3,
        "weight": 0.5,
        "blob": b"\x01\x02",
        "flag": True,
        "tags": ["a", "b"],
        "where": {"x": 1.0, "y": 2.0},
        "path": [{"x": 1.0}, {"x": 2.5, "y": -1.0}],
        "note": "hi",
        "size": 5,
    }


def _with(**changes: Any) -> dict[str, Any]:
    obj = _valid()
    obj.update(changes)
    return obj


def _without(name: str) -> dict[str, Any]:
    obj = _valid()
    del obj[name]
    return obj


def test_decode_valid_message() -> None:
    msg = decode_message(Sample, _valid())
    assert msg == Sample(
        name="abc",
        count=3,
        weight=0.5,
        blob=b"\x01\x02",
        flag=True,
        tags=("a", "b"),
        where=Point(1.0, 2.0),
        path=(Point(1.0, 0.0), Point(2.5, -1.0)),
        note="hi",
        size=5,
    )
    assert isinstance(msg.tags, tuple)
    assert isinstance(msg.path[0], Point)


def test_to_obj_round_trips_through_msgpack() -> None:
    msg = decode_message(Sample, _valid())
    assert Sample.from_obj(unpack(pack(msg.to_obj()))) == msg
    assert msg.to_obj()["where"] == {"x": 1.0, "y": 2.0}
    assert msg.to_obj()["path"] == [{"x": 1.0, "y": 0.0}, {"x": 2.5, "y": -1.0}]


def test_defaults_fill_missing_optional_fields() -> None:
    obj = _valid()
    for name in ("path", "note", "size"):
        del obj[name]
    msg = decode_message(Sample, obj)
    assert (msg.path, msg.note, msg.size) == ((), None, None)


def test_none_for_optional_fields() -> None:
    msg = decode_message(Sample, _with(note=None, size=None))
    assert msg.note is None
    assert msg.size is None


def test_int_accepted_for_float_and_converted() -> None:
    msg = decode_message(Sample, _with(weight=1, where={"x": 3}))
    assert msg.weight == 1.0
    assert type(msg.weight) is float
    assert type(msg.where.x) is float


def test_unknown_extra_fields_are_ignored() -> None:
    msg = decode_message(Sample, _with(future_field=[1, 2, 3], where={"x": 1.0, "z": "new"}))
    assert msg == decode_message(Sample, _with(where={"x": 1.0}))
    assert not hasattr(msg, "future_field")
    assert msg.where == Point(1.0, 0.0)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("name", "Sample: missing field 'name'"),
        ("count", "Sample: missing field 'count'"),
        ("flag", "Sample: missing field 'flag'"),
        ("where", "Sample: missing field 'where'"),
    ],
)
def test_missing_required_field(name: str, reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        decode_message(Sample, _without(name))


def test_missing_field_in_nested_message_names_the_path() -> None:
    with pytest.raises(RemoteProtocolError, match=r"Sample\.path\[1\]: missing field 'x'"):
        decode_message(Sample, _with(path=[{"x": 1.0}, {"y": 1.0}]))


@pytest.mark.parametrize("obj", [None, [], "x", 1, b"map", [("name", "a")]])
def test_top_level_must_be_a_map(obj: Any) -> None:
    with pytest.raises(RemoteProtocolError, match="Sample: expected a map"):
        decode_message(Sample, obj)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        # wrong types
        ({"name": b"abc"}, "Sample.name: expected a string"),
        ({"name": 1}, "Sample.name: expected a string"),
        ({"name": None}, "Sample.name: expected a string"),
        ({"count": "3"}, "Sample.count: expected an integer"),
        ({"count": 3.0}, "Sample.count: expected an integer"),
        ({"count": True}, "Sample.count: expected an integer"),  # bool is not an int on the wire
        ({"count": False}, "Sample.count: expected an integer"),
        ({"weight": "0.5"}, "Sample.weight: expected a number"),
        ({"weight": True}, "Sample.weight: expected a number"),
        ({"weight": None}, "Sample.weight: expected a number"),
        ({"blob": "ab"}, "Sample.blob: expected bytes"),
        ({"blob": [1, 2]}, "Sample.blob: expected bytes"),
        ({"flag": 1}, "Sample.flag: expected a bool"),
        ({"flag": 0}, "Sample.flag: expected a bool"),
        ({"flag": "true"}, "Sample.flag: expected a bool"),
        ({"tags": "ab"}, "Sample.tags: expected a list"),
        ({"tags": {"a": 1}}, "Sample.tags: expected a list"),
        ({"tags": ["a", 1]}, r"Sample.tags\[1\]: expected a string"),
        ({"where": [1.0, 2.0]}, "Sample.where: expected a map"),
        ({"where": {"x": "1"}}, "Sample.where.x: expected a number"),
        ({"path": [{"x": 1.0}, 7]}, r"Sample.path\[1\]: expected a map"),
        ({"path": [{"x": float("nan")}]}, r"Sample.path\[0\].x: must be finite"),
        ({"note": 5}, "Sample.note: expected a string"),
        ({"size": "5"}, "Sample.size: expected an integer"),
        ({"size": True}, "Sample.size: expected an integer"),
        # non-finite floats
        ({"weight": float("nan")}, "Sample.weight: must be finite"),
        ({"weight": float("inf")}, "Sample.weight: must be finite"),
        ({"weight": float("-inf")}, "Sample.weight: must be finite"),
        ({"where": {"x": math.inf}}, "Sample.where.x: must be finite"),
        # bounds
        ({"name": "123456789"}, "Sample.name: length 9 exceeds 8"),
        ({"blob": b"12345"}, "Sample.blob: length 5 exceeds 4"),
        ({"tags": ["a", "b", "c", "d"]}, "Sample.tags: length 4 exceeds 3"),
        ({"tags": ["x" * (DEFAULT_MAX_STR + 1)]}, rf"Sample.tags\[0\]: length {DEFAULT_MAX_STR + 1} exceeds"),
        ({"count": -1}, "Sample.count: -1 is below 0"),
        ({"count": 11}, "Sample.count: 11 is above 10"),
        ({"count": 2**64 - 1}, "Sample.count: .* is above 10"),
        ({"weight": -1.5}, "Sample.weight: -1.5 is below -1.0"),
        ({"weight": 2}, "Sample.weight: 2 is above 1.0"),
        ({"size": 0}, "Sample.size: 0 is below 1"),
    ],
)
def test_invalid_fields(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        decode_message(Sample, _with(**changes))


@pytest.mark.parametrize(
    ("changes", "field_value"),
    [
        ({"name": "12345678"}, ("name", "12345678")),
        ({"blob": b"1234"}, ("blob", b"1234")),
        ({"tags": ["a", "b", "c"]}, ("tags", ("a", "b", "c"))),
        ({"tags": []}, ("tags", ())),
        ({"count": 0}, ("count", 0)),
        ({"count": 10}, ("count", 10)),
        ({"weight": -1.0}, ("weight", -1.0)),
        ({"weight": 1}, ("weight", 1.0)),
        ({"flag": False}, ("flag", False)),
    ],
)
def test_bounds_are_inclusive(changes: dict[str, Any], field_value: tuple[str, Any]) -> None:
    name, value = field_value
    assert getattr(decode_message(Sample, _with(**changes)), name) == value


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (
            {"s": "x" * (DEFAULT_MAX_STR + 1)},
            f"Plain.s: length {DEFAULT_MAX_STR + 1} exceeds {DEFAULT_MAX_STR}",
        ),
        ({"b": b"x" * (DEFAULT_MAX_BYTES + 1)}, f"Plain.b: length {DEFAULT_MAX_BYTES + 1} exceeds"),
        ({"items": [0] * (DEFAULT_MAX_ITEMS + 1)}, f"Plain.items: length {DEFAULT_MAX_ITEMS + 1} exceeds"),
        ({"items": [1, "2"]}, r"Plain.items\[1\]: expected an integer"),
        ({"items": [True]}, r"Plain.items\[0\]: expected an integer"),
        ({"nested": [[1], 2]}, r"Plain.nested\[1\]: expected a list"),
        ({"nested": [[1], [2, None]]}, r"Plain.nested\[1\]\[1\]: expected an integer"),
    ],
)
def test_default_limits_without_bounded(obj: dict[str, Any], reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        decode_message(Plain, obj)


def test_default_limits_are_inclusive() -> None:
    msg = decode_message(
        Plain,
        {
            "s": "x" * DEFAULT_MAX_STR,
            "b": b"x" * DEFAULT_MAX_BYTES,
            "items": [1] * DEFAULT_MAX_ITEMS,
            "nested": [[1, 2], [], [3]],
        },
    )
    assert len(msg.s) == DEFAULT_MAX_STR
    assert len(msg.b) == DEFAULT_MAX_BYTES
    assert msg.items == (1,) * DEFAULT_MAX_ITEMS
    assert msg.nested == ((1, 2), (), (3,))


def test_constructor_errors_become_remote_protocol_errors() -> None:
    assert decode_message(Checked, {"lo": 1, "hi": 2}) == Checked(1, 2)
    with pytest.raises(RemoteProtocolError, match="Checked: lo must not exceed hi"):
        decode_message(Checked, {"lo": 3, "hi": 2})


def test_bytes_map_keys_do_not_count_as_field_names() -> None:
    with pytest.raises(RemoteProtocolError, match="missing field 'lo'"):
        decode_message(Checked, {b"lo": 1, "hi": 2})


# ---- positional messages -------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed(Message, positional=True):
    x: int = bounded(ge=0, le=100)
    where: Point | None = None
    tags: tuple[str, ...] = bounded((), max_len=2)
    note: str = ""


def test_a_positional_message_travels_as_its_values_in_order() -> None:
    msg = Packed(3, Point(1.0), ("a",), "n")
    assert msg.to_obj() == [3, {"x": 1.0, "y": 0.0}, ["a"], "n"]
    assert Packed.from_obj(unpack(pack(msg.to_obj()))) == msg


@pytest.mark.parametrize(
    ("msg", "sent"),
    [
        (Packed(3), [3]),
        (Packed(3, tags=("a",)), [3, None, ["a"]]),  # (a default before a set field stays)
        (Packed(0, note="n"), [0, None, [], "n"]),
    ],
)
def test_trailing_defaults_are_left_out(msg: Packed, sent: list[Any]) -> None:
    assert msg.to_obj() == sent
    assert Packed.from_obj(sent) == msg


def test_a_positional_message_still_reads_the_map_an_older_peer_sends() -> None:
    assert Packed.from_obj({"x": 3, "note": "n", "future": 1}) == Packed(3, note="n")


def test_array_items_past_the_known_fields_are_ignored() -> None:
    """A newer peer may add fields at the end."""
    assert Packed.from_obj([3, None, [], "n", {"new": 1}, 7]) == Packed(3, note="n")


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ([], "Packed: missing field 'x'"),
        (["3"], "Packed.x: expected an integer"),
        ([101], "Packed.x: 101 is above 100"),
        ([3, [1.0]], "Packed.where: expected a map, got list"),  # (Point is not positional)
        ([3, None, ["a", "b", "c"]], "Packed.tags: length 3 exceeds 2"),
        ("x", "Packed: expected an array or a map"),
    ],
)
def test_a_hostile_array_is_refused_with_the_field_named(obj: Any, reason: str) -> None:
    with pytest.raises(RemoteProtocolError, match=reason):
        Packed.from_obj(obj)


def test_a_map_message_does_not_take_an_array() -> None:
    with pytest.raises(RemoteProtocolError, match="Point: expected a map, got list"):
        Point.from_obj([1.0, 2.0])
