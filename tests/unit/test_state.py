"""Training state: safetensors codec, hostile bytes, digest, capture and restore (pure, no event loop)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from p2ptrain.errors import LocalProtocolError, RemoteProtocolError
from p2ptrain.training.state.capture import capture, restore
from p2ptrain.training.state.codec import (
    DTYPES,
    FORMAT_KEY,
    MAX_HEADER,
    StateError,
    decode,
    digest,
    encode,
    encoded_size,
)

# ---- helpers -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny models: extra intra-op threads only contend (20x slower on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def join(pieces: list[memoryview | bytes]) -> bytes:
    return b"".join(pieces)


def craft(header: Any, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    """Bytes with an arbitrary header (a JSON value, or raw header bytes) and data section."""
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return digest(a) == digest(b)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(3, 4, generator=g),
        "half": torch.randn(5, generator=g).half(),
        "brain": torch.randn(2, 2, generator=g).bfloat16(),
        "f64": torch.randn((), generator=g, dtype=torch.float64),
        "i64": torch.arange(-3, 3),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i16": torch.tensor([-7, 7], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 7),
    }


# ---- codec: round trips --------------------------------------------------------------------------


def test_round_trip_every_dtype_bit_identical() -> None:
    tensors = sample()
    pieces = encode(tensors, {"k": "v", "ünï": "cödé"})
    data = join(pieces)
    assert encoded_size(pieces) == len(data)
    out, meta = decode(data)
    assert meta == {"k": "v", "ünï": "cödé"}
    assert list(out) == sorted(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert same_bits(out, tensors)
    assert {t.dtype for t in tensors.values()} == set(DTYPES.values())


def test_known_bytes() -> None:
    """The exact layout of the published format: a reader built from the spec reads these bytes."""
    data = join(encode({"a": torch.tensor([1.0, -2.0])}))
    header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    header += b" " * (-len(header) % 8)
    assert data == struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, -2.0)


def test_encode_is_deterministic_and_aligned() -> None:
    tensors = sample()
    reordered = dict(reversed(list(tensors.items())))
    a, b = join(encode(tensors)), join(encode(reordered))
    assert a == b
    (hlen,) = struct.unpack_from("<Q", a)
    assert hlen % 8 == 0


def test_encode_pieces_are_zero_copy_views() -> None:
    t = torch.zeros(1000)
    pieces = encode({"t": t})
    assert isinstance(pieces[0], bytes) and isinstance(pieces[1], memoryview)
    t.add_(1)  # a view reflects the tensor's memory, proving no copy was made
    assert bytes(pieces[1])[:4] == struct.pack("<f", 1.0)
    del t
    assert bytes(pieces[1])[-4:] == struct.pack("<f", 1.0)  # the view keeps the memory alive


def test_encode_copies_non_contiguous_and_grad_tensors() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    param = nn.Parameter(torch.ones(2))
    out, _ = decode(join(encode({"t": base.t(), "p": param})))
    assert torch.equal(out["t"], base.t()) and out["t"].is_contiguous()
    assert torch.equal(out["p"], torch.ones(2)) and not out["p"].requires_grad


def test_empty_state_and_metadata_only() -> None:
    assert decode(join(encode({}))) == ({}, {})
    assert decode(join(encode({}, {"only": "meta"}))) == ({}, {"only": "meta"})


def test_decode_result_does_not_alias_the_buffer() -> None:
    buf = bytearray(join(encode({"t": torch.ones(4)})))
    out, _ = decode(buf)
    buf[-16:] = bytes(16)
    assert torch.equal(out["t"], torch.ones(4))


def test_decode_accepts_memoryview_slices_and_other_formats() -> None:
    data = join(encode({"t": torch.arange(5.0)}))
    padded = bytearray(b"xx" + data + b"yy")
    out, _ = decode(memoryview(padded)[2:-2])
    assert torch.equal(out["t"], torch.arange(5.0))
    assert len(data) % 8 == 4  # 5 floats after an 8-aligned header: view it as uint32 words instead
    words = memoryview(data + b"\0" * 4).cast("I")
    with pytest.raises(StateError, match="data section"):  # the 4 pad bytes are trailing garbage
        decode(words)


@pytest.mark.parametrize(
    ("tensors", "metadata", "match"),
    [
        ({"z": torch.zeros(2, dtype=torch.complex64)}, None, "dtype"),
        ({"": torch.zeros(1)}, None, "non-empty"),
        ({"a\x00b": torch.zeros(1)}, None, "unprintable"),
        ({"__metadata__": torch.zeros(1)}, None, "reserved"),
        ({"x" * 513: torch.zeros(1)}, None, "513"),
        ({"s": torch.zeros(3).to_sparse()}, None, "layout"),
        ({}, {"k": 1}, "str to str"),
        ({}, {"k": "\ud800"}, "Unicode"),
    ],
)
def test_encode_rejects_what_the_format_cannot_carry(tensors: Any, metadata: Any, match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        encode(tensors, metadata)


def test_encode_rejects_oversized_header() -> None:
    with pytest.raises(LocalProtocolError, match="header"):
        encode({}, {"big": "x" * MAX_HEADER})


# ---- codec: hostile bytes ------------------------------------------------------------------------

VALID = join(encode({"a": torch.arange(4.0), "b": torch.tensor([1, 2], dtype=torch.int16)}, {"m": "v"}))
ENTRY_A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def entry(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data_offsets": offsets,
    }


HOSTILE: list[tuple[str, bytes, str]] = [
    ("empty", b"", "too short"),
    ("seven bytes", b"\x00" * 7, "too short"),
    ("truncated header", VALID[:20], "exceeds the"),
    ("truncated data", VALID[:-1], "outside|cover"),
    ("header longer than data", struct.pack("<Q", 1000) + b"{}", "exceeds the 2 bytes"),
    ("header over the limit", struct.pack("<Q", MAX_HEADER + 1) + b"{}", "limit"),
    ("header length 2**64-1", b"\xff" * 8 + b"{}", "limit"),
    ("not utf-8", craft(None, raw=b'{"\xff":1}'), "UTF-8"),
    ("not json", craft(None, raw=b"{nope"), "not valid JSON"),
    ("json array", craft([1, 2]), "list, not an object"),
    ("json number", craft(3), "int, not an object"),
    ("json null", craft(None), "NoneType, not an object"),
    ("NaN literal", craft(None, raw=b'{"__metadata__":{"a":NaN}}'), "NaN"),
    ("duplicate key", craft(None, raw=b'{"a":{},"a":{}}'), "repeats the key 'a'"),
    ("deep nesting", craft(None, raw=b"[" * 100_000 + b"]" * 100_000), "deeply|JSON"),
    (
        "huge int",
        craft(None, raw=b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}'),
        "JSON",
    ),
    ("unknown dtype", craft({"a": entry(dtype="F8")}, bytes(8)), "unknown dtype 'F8'"),
    ("lowercase dtype", craft({"a": entry(dtype="f32")}, bytes(8)), "unknown dtype"),
    ("dtype not a string", craft({"a": entry(dtype=4)}, bytes(8)), "unknown dtype 4"),
    ("negative size", craft({"a": entry(shape=(-2,))}, bytes(8)), "out of range"),
    ("float size", craft({"a": entry(shape=(2.0,))}, bytes(8)), "not an integer"),
    ("bool size", craft({"a": entry(shape=[True, 2])}, bytes(8)), "not an integer"),
    ("string size", craft({"a": entry(shape=["2"])}, bytes(8)), "not an integer"),
    ("huge size", craft({"a": entry(shape=(2**70,))}, bytes(8)), "out of range"),
    ("huge zero-size shape", craft({"a": entry(shape=(0, 2**40, 2**40), offsets=(0, 0))}), "too large"),
    ("too many dims", craft({"a": entry(shape=(1,) * 65, offsets=(0, 4))}, bytes(4)), "at most 64"),
    ("shape not a list", craft({"a": entry(shape=2)}, bytes(8)), "shape must be a list"),
    ("offsets not a pair", craft({"a": entry(offsets=[0, 4, 8])}, bytes(8)), "pair"),
    ("float offset", craft({"a": entry(offsets=[0, 8.0])}, bytes(8)), "not an integer"),
    ("negative offset", craft({"a": entry(offsets=[-8, 0])}, bytes(8)), "outside"),
    ("end before begin", craft({"a": entry(offsets=[8, 0])}, bytes(8)), "outside"),
    ("offset past data", craft({"a": entry(offsets=[0, 8])}, bytes(4)), "outside"),
    (
        "size mismatch",
        craft({"a": entry(shape=(3,))}, bytes(8)),
        "8 bytes declared, but F32 \\[3\\] needs 12",
    ),
    ("gap at start", craft({"a": entry(offsets=[4, 12])}, bytes(12)), "'a' starts at byte 4: a gap"),
    (
        "gap between",
        craft({"a": entry(), "b": entry(offsets=[12, 20])}, bytes(20)),
        "'b' starts at byte 12: a gap after byte 8",
    ),
    (
        "overlap",
        craft({"a": entry(), "b": entry(offsets=[4, 12])}, bytes(12)),
        "'b' starts at byte 4: an overlap",
    ),
    ("same range twice", craft({"a": entry(), "b": entry()}, bytes(8)), "an overlap"),
    ("data longer than declared", craft({"a": entry()}, bytes(9)), "9 bytes but the tensors cover 8"),
    ("data without tensors", craft({}, b"junk"), "4 bytes but the tensors cover 0"),
    ("entry not an object", craft({"a": [1]}, bytes(8)), "exactly dtype, shape, data_offsets"),
    ("entry with extra field", craft({"a": {**ENTRY_A, "x": 1}}, bytes(8)), "exactly dtype"),
    ("entry missing field", craft({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)), "exactly dtype"),
    ("empty name", craft({"": entry()}, bytes(8)), "non-empty"),
    ("long name", craft({"n" * 513: entry()}, bytes(8)), "513 characters"),
    ("control char name", craft({"a\nb": entry()}, bytes(8)), "unprintable"),
    ("zero-width name", craft({"a\u200b": entry()}, bytes(8)), "unprintable"),
    ("lone surrogate name", craft(None, raw=b'{"\\ud800":{}}'), "unprintable"),
    ("metadata not object", craft({"__metadata__": ["a"]}), "__metadata__"),
    ("metadata value not str", craft({"__metadata__": {"a": 1}}), "__metadata__"),
    ("metadata value null", craft({"__metadata__": {"a": None}}), "__metadata__"),
    ("bool byte 2", craft({"m": entry(dtype="BOOL", shape=(2,), offsets=(0, 2))}, b"\x01\x02"), "0 or 1"),
]


@pytest.mark.parametrize(("data", "match"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_decode_rejects_hostile_bytes(data: bytes, match: str) -> None:
    with pytest.raises(StateError, match=match) as info:
        decode(data)
    assert isinstance(info.value, RemoteProtocolError)


def test_decode_limits_tensor_count() -> None:
    data = join(encode({f"t{i}": torch.zeros(1) for i in range(5)}))
    assert len(decode(data, max_tensors=5)[0]) == 5
    with pytest.raises(StateError, match="5 tensors, over the limit of 4"):
        decode(data, max_tensors=4)


def test_decode_accepts_null_metadata_and_reordered_offsets() -> None:
    """Other writers order the data by dtype alignment, not by name: any tiling order is fine."""
    header = {"__metadata__": None, "a": entry(offsets=[8, 16]), "b": entry(offsets=[0, 8])}
    out, meta = decode(craft(header, struct.pack("<4f", 1, 2, 3, 4)))
    assert meta == {}
    assert out["a"].tolist() == [3.0, 4.0] and out["b"].tolist() == [1.0, 2.0]


def test_decode_zero_sized_tensors_share_offsets() -> None:
    header = {
        "e": entry(shape=(0, 3), offsets=[0, 0]),
        "a": entry(offsets=[0, 8]),
        "z": entry(shape=(0,), offsets=[8, 8]),
    }
    out, _ = decode(craft(header, bytes(8)))
    assert out["e"].shape == (0, 3) and out["z"].shape == (0,)


# ---- codec: fuzzing ------------------------------------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_reject(data: bytes) -> None:
    try:
        tensors, meta = decode(data, max_tensors=64)
    except StateError:
        return
    # Whatever decodes re-encodes to a state with the same digest.
    again, meta2 = decode(join(encode(tensors, meta)))
    assert meta2 == meta and digest(again) == digest(tensors)


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes) -> None:
    decode_or_reject(data)


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(-20, 20),
)
def test_fuzz_mutated_valid_encoding(flips: list[tuple[int, int]], resize: int) -> None:
    data = bytearray(VALID)
    for pos, value in flips:
        data[pos] = value
    data = data[: len(data) + resize] if resize < 0 else data + bytes(resize)
    decode_or_reject(bytes(data))


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**66), 2**66), st.floats(allow_nan=False), st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)
dims = st.integers(-2, 5) | json_values
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPES, "F8", "", "f32"]) | json_values,
        "shape": st.lists(dims, max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-2, 40), min_size=2, max_size=2) | json_values,
    }
)


@FUZZ
@given(
    st.dictionaries(st.text(min_size=0, max_size=6), entries | json_values, max_size=4),
    st.one_of(
        st.none(),
        json_values,
        st.dictionaries(st.text(max_size=4), st.text(max_size=4) | json_values, max_size=3),
    ),
    st.binary(max_size=48),
)
def test_fuzz_structured_headers(header: dict[str, Any], metadata: Any, data: bytes) -> None:
    if metadata is not None:
        header["__metadata__"] = metadata
    decode_or_reject(craft(header, data))


# ---- interop -------------------------------------------------------------------------------------


def test_interop_with_the_safetensors_package() -> None:
    st_torch = pytest.importorskip("safetensors.torch")
    tensors = sample()
    theirs = st_torch.load(join(encode(tensors, {"k": "v"})))
    assert same_bits(theirs, tensors)
    ours, meta = decode(st_torch.save(tensors, metadata={"k": "v"}))
    assert meta == {"k": "v"} and same_bits(ours, tensors)


# ---- digest --------------------------------------------------------------------------------------


def test_digest_equal_states_equal_digests() -> None:
    tensors = sample()
    clone = {k: v.clone() for k, v in reversed(list(tensors.items()))}
    assert digest(tensors) == digest(clone) == digest(decode(join(encode(tensors)))[0])
    assert len(digest(tensors)) == 32
    base = torch.arange(6.0).reshape(2, 3)
    assert digest({"t": base.t()}) == digest({"t": base.t().contiguous()})


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(
            w=s["w"].clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(1e-30))
        ),
        lambda s: s.update(w2=s.pop("w")),
        lambda s: s.update(w=s["w"].reshape(4, 3)),
        lambda s: s.update(w=s["w"].view(torch.int32)),
        lambda s: s.update(extra=torch.zeros(0)),
        lambda s: s.pop("empty"),
        lambda s: s.update(empty=torch.zeros(7, 0)),
        lambda s: s.update(f64=-s["f64"]),
    ],
    ids=[
        "one value",
        "renamed",
        "reshaped",
        "reinterpreted dtype",
        "added empty",
        "removed",
        "empty reshaped",
        "sign",
    ],
)
def test_digest_changes_with_any_field(change: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    tensors = sample()
    before = digest(tensors)
    change(tensors)
    assert digest(tensors) != before


def test_digest_is_not_fooled_by_moving_bytes_between_names() -> None:
    a = {"x": torch.zeros(2, dtype=torch.uint8), "y": torch.ones(2, dtype=torch.uint8)}
    b = {"x": torch.tensor([0, 0, 1], dtype=torch.uint8), "y": torch.ones(1, dtype=torch.uint8)}
    assert digest(a) != digest(b)


# ---- capture / restore ---------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, width: int = 8, more: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, width, dtype=dtype)
        self.norm = nn.BatchNorm1d(width, dtype=dtype)  # float buffers and an int64 counter
        self.fc2 = nn.Linear(width, 3, dtype=dtype)
        self.more = nn.Linear(3, 3, dtype=dtype) if more else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return self.more(y) if self.more is not None else y


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": adamw,
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    "sgd_plain": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
}


def make(seed: int, kind: str = "adamw", **net: Any) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(**net)
    return model, OPTIMIZERS[kind](model)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[bytes, dict[str, str]]:
    tensors, meta = capture(model, {"opt": opt})
    return digest(tensors), meta


def transfer(
    model: nn.Module, opt: torch.optim.Optimizer, **kw: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Capture and send through the codec, as a joining peer receives it."""
    tensors, meta = capture(model, {"opt": opt}, **kw)
    return decode(join(encode(tensors, meta)))


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("donor_steps", [0, 3], ids=["fresh donor", "trained donor"])
@pytest.mark.parametrize("local_steps", [0, 2], ids=["fresh local", "trained local"])
def test_restore_then_train_bit_identical(kind: str, donor_steps: int, local_steps: int) -> None:
    donor, donor_opt = make(1, kind)
    train(donor, donor_opt, donor_steps, seed=10)
    tensors, meta = transfer(donor, donor_opt)
    local, local_opt = make(2, kind)
    train(local, local_opt, local_steps, seed=20)
    assert fingerprint(local, local_opt) != fingerprint(donor, donor_opt)

    assert restore(local, {"opt": local_opt}, tensors, meta) == {}
    assert fingerprint(local, local_opt) == fingerprint(donor, donor_opt)
    # The real proof that the optimizer state came across: the next steps agree bit for bit.
    train(donor, donor_opt, 3, seed=30)
    train(local, local_opt, 3, seed=30)
    assert fingerprint(local, local_opt) == fingerprint(donor, donor_opt)


def test_capture_is_a_detached_contiguous_cpu_snapshot() -> None:
    model, opt = make(0)
    train(model, opt, 1)
    tensors, meta = capture(model, {"opt": opt})
    assert meta[FORMAT_KEY] == "1"
    assert all(t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad for t in tensors.values())
    before = digest(tensors)
    train(model, opt, 1)
    assert digest(tensors) == before
    assert "model.norm.num_batches_tracked" in tensors
    assert {"optim.opt.0.step", "optim.opt.0.exp_avg", "optim.opt.0.exp_avg_sq"} <= set(tensors)
    doc = json.loads(meta["optim.opt"])
    assert [g["size"] for g in doc["groups"]] == [3, 3]
    assert doc["groups"][1]["hyper"]["weight_decay"] == 0.0 and "params" not in doc["groups"][1]["hyper"]


def test_restore_takes_hyperparameters_but_keeps_local_implementation_flags() -> None:
    donor, donor_opt = make(1)
    for group in donor_opt.param_groups:
        group["lr"] = 0.125
        group["betas"] = (0.5, 0.75)
        group["initial_lr"] = 0.25  # as an LR scheduler adds
    tensors, meta = transfer(donor, donor_opt)
    doc = json.loads(meta["optim.opt"])
    for group in doc["groups"]:
        group["hyper"].update(foreach=True, fused=True, capturable=True, differentiable=True)
    meta["optim.opt"] = json.dumps(doc)
    local, local_opt = make(2)
    restore(local, {"opt": local_opt}, tensors, meta)
    for group in local_opt.param_groups:
        assert group["lr"] == 0.125 and group["initial_lr"] == 0.25
        assert group["betas"] == (0.5, 0.75) and isinstance(group["betas"], tuple)
        assert group["foreach"] is None and group["fused"] is None
        assert group["capturable"] is False and group["differentiable"] is False
    train(local, local_opt, 1)


def test_restore_returns_extras() -> None:
    donor, donor_opt = make(1)
    global_copy = {n: p.detach() * 2 for n, p in donor.named_parameters()}
    tensors, meta = transfer(donor, donor_opt, extra=global_copy)
    local, local_opt = make(2)
    extras = restore(local, {"opt": local_opt}, tensors, meta, extra_names=list(global_copy))
    assert list(extras) == list(global_copy)
    assert same_bits(extras, global_copy)
    templates = {n: torch.empty_like(p) for n, p in local.named_parameters()}
    assert same_bits(restore(local, {"opt": local_opt}, tensors, meta, extra_names=templates), global_copy)


def test_restore_without_optimizers() -> None:
    donor, _ = make(1)
    tensors, meta = capture(donor)
    local, _ = make(2)
    restore(local, {}, tensors, meta)
    assert digest(capture(local)[0]) == digest(tensors)


def test_capture_rejects_state_it_cannot_carry() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(LocalProtocolError, match="'lr'"):
        capture(model, {"opt": torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))})
    with pytest.raises(LocalProtocolError, match="optimizer key"):
        capture(model, {"a.b": torch.optim.SGD(model.parameters(), lr=0.1)})

    class WithExtraState(nn.Module):
        def get_extra_state(self) -> Any:
            return {"a": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    with pytest.raises(LocalProtocolError, match="_extra_state"):
        capture(WithExtraState())
    with pytest.raises(LocalProtocolError, match="dtype"):
        capture(model, extra={"z": torch.zeros(1, dtype=torch.complex64)})


# Each case: (tensors, meta) -> None edits a valid transferred AdamW state; restore must refuse it.
Edit = Callable[[dict[str, torch.Tensor], dict[str, str]], Any]


def optim_doc(edit: Callable[[dict[str, Any]], Any]) -> Edit:
    def apply(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        doc = json.loads(meta["optim.opt"])
        edit(doc)
        meta["optim.opt"] = json.dumps(doc)

    return apply


def hyper(name: str, value: Any) -> Edit:
    return optim_doc(lambda d: d["groups"][0]["hyper"].__setitem__(name, value))


def put(name: str, value: torch.Tensor) -> Edit:
    return lambda t, m: t.__setitem__(name, value)


def scalar_step(value: Any) -> Edit:
    def apply(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        del tensors["optim.opt.5.step"]
        optim_doc(lambda d: d.__setitem__("state", {"5": {"step": value}}))(tensors, meta)

    return apply


MISMATCHES: list[tuple[str, Edit, str]] = [
    ("missing model entry", lambda t, m: t.pop("model.fc2.bias"), "lacks model entry 'fc2.bias'"),
    ("extra model entry", put("model.fc9.weight", torch.zeros(2)), "model entry 'fc9.weight'.*unknown"),
    (
        "reshaped parameter",
        put("model.fc1.weight", torch.zeros(9, 4)),
        "'fc1.weight' is torch.float32 \\[9, 4\\]",
    ),
    (
        "parameter dtype",
        lambda t, m: t.update({"model.fc1.bias": t["model.fc1.bias"].double()}),
        "'fc1.bias'",
    ),
    ("buffer dtype", put("model.norm.num_batches_tracked", torch.tensor(1.0)), "num_batches_tracked"),
    (
        "exp_avg shape",
        put("optim.opt.0.exp_avg", torch.zeros(4, 8)),
        "#0 state 'exp_avg' (has shape|is torch.float32) \\[4, 8\\]",
    ),
    (
        "exp_avg dtype",
        lambda t, m: t.update({"optim.opt.0.exp_avg": t["optim.opt.0.exp_avg"].double()}),
        "float64",
    ),
    ("exp_avg inf", put("optim.opt.2.exp_avg", torch.full((3, 8), math.inf)), "#2 state 'exp_avg' holds NaN"),
    ("exp_avg_sq negative", put("optim.opt.2.exp_avg_sq", -torch.ones(3, 8)), "'exp_avg_sq' holds negative"),
    ("NaN step", put("optim.opt.0.step", torch.tensor(math.nan)), "#0 state 'step' is nan"),
    ("negative step", put("optim.opt.0.step", torch.tensor(-1.0)), "'step' is -1.0"),
    ("step vector", put("optim.opt.0.step", torch.zeros(2)), "#0 state 'step' is torch.float32 \\[2\\]"),
    ("step bool", put("optim.opt.0.step", torch.tensor(True)), "'step'"),
    ("missing exp_avg_sq", lambda t, m: t.pop("optim.opt.2.exp_avg_sq"), "#2 lacks state 'exp_avg_sq'"),
    ("unknown state", put("optim.opt.0.bogus", torch.zeros(())), "unexpected state 'bogus'"),
    ("parameter index too big", put("optim.opt.6.step", torch.tensor(1.0)), "#6, but only 6 parameters"),
    ("non-canonical index", put("optim.opt.01.step", torch.tensor(1.0)), "optim.<key>.<parameter index>"),
    ("malformed optim name", put("optim.opt.step", torch.tensor(1.0)), "optim.<key>"),
    ("unknown section", put("weights.fc1", torch.zeros(1)), "not under model."),
    ("bare section", put("model", torch.zeros(1)), "not under model."),
    ("unknown optimizer tensor", put("optim.other.0.step", torch.tensor(1.0)), "optimizer 'other'"),
    ("unknown optimizer metadata", lambda t, m: m.__setitem__("optim.other", "{}"), "optimizer 'other'"),
    ("missing optimizer", lambda t, m: m.pop("optim.opt"), "lacks optimizer 'opt'"),
    ("format missing", lambda t, m: m.pop(FORMAT_KEY), "format"),
    ("format from the future", lambda t, m: m.__setitem__(FORMAT_KEY, "2"), "format is '2'"),
    ("metadata not JSON", lambda t, m: m.__setitem__("optim.opt", "{"), "'opt' metadata is not valid JSON"),
    ("metadata NaN", lambda t, m: m.__setitem__("optim.opt", '{"a":NaN}'), "NaN"),
    ("metadata not an object", lambda t, m: m.__setitem__("optim.opt", "[]"), "groups and state"),
    ("groups not a list", optim_doc(lambda d: d.__setitem__("groups", {})), "no parameter groups"),
    (
        "one group too many",
        optim_doc(lambda d: d["groups"].append(d["groups"][0])),
        "3 parameter groups, the local one 2",
    ),
    ("group size", optim_doc(lambda d: d["groups"][0].__setitem__("size", 4)), "group 0 has 4 parameters"),
    ("group size bool", optim_doc(lambda d: d["groups"][0].__setitem__("size", True)), "group 0 has True"),
    ("group not object", optim_doc(lambda d: d["groups"].__setitem__(0, 3)), "group 0"),
    ("hyper not object", optim_doc(lambda d: d["groups"][0].__setitem__("hyper", [])), "must be an object"),
    ("lr negative", hyper("lr", -0.1), "'lr' is -0.1, must not be negative"),
    ("lr string", hyper("lr", "fast"), "'lr' is 'fast'"),
    ("lr null", hyper("lr", None), "'lr' is None"),
    ("lr bool", hyper("lr", True), "'lr' is True"),
    (
        "lr overflow",
        lambda t, m: m.__setitem__("optim.opt", m["optim.opt"].replace('"lr":0.01', '"lr":1e999')),
        "1e999",
    ),
    ("eps list", hyper("eps", [1]), "'eps'"),
    ("betas short", hyper("betas", [0.9]), "'betas' is \\[0.9\\], expected a list of 2"),
    ("betas beyond 1", hyper("betas", [0.9, 1.5]), "betas .* \\[0, 1\\)"),
    ("betas strings", hyper("betas", ["a", "b"]), "betas"),
    ("amsgrad int", hyper("amsgrad", 1), "'amsgrad' is 1"),
    (
        "missing hyper",
        optim_doc(lambda d: d["groups"][1]["hyper"].pop("eps")),
        "group 1 lacks hyperparameter 'eps'",
    ),
    ("object hyper", hyper("foo", {"a": 1}), "unexpected hyperparameter 'foo'"),
    ("amsgrad without max", hyper("amsgrad", True), "lacks state 'max_exp_avg_sq'"),
    (
        "state not object",
        optim_doc(lambda d: d.__setitem__("state", [])),
        "per-parameter state must be an object",
    ),
    ("state index text", optim_doc(lambda d: d.__setitem__("state", {"x": {}})), "'x' is not an index"),
    (
        "scalar repeats tensor",
        optim_doc(lambda d: d.__setitem__("state", {"0": {"step": 3}})),
        "'step' repeated",
    ),
    ("scalar step string", scalar_step("x"), "#5 state 'step' is 'x'"),
    ("scalar step negative", scalar_step(-1), "#5 state 'step' is -1"),
    ("scalar step list", scalar_step([1]), "#5 state 'step' is \\[1\\]"),
    ("missing extra", lambda t, m: t.pop("extra.g"), "lacks extra tensor 'g'"),
    ("unexpected extra", put("extra.h", torch.zeros(1)), "unexpected extra tensor 'h'"),
    ("extra shape", put("extra.g", torch.zeros(3)), "extra tensor 'g' is torch.float32 \\[3\\]"),
]


@pytest.mark.parametrize(("edit", "match"), [c[1:] for c in MISMATCHES], ids=[c[0] for c in MISMATCHES])
@pytest.mark.parametrize("local_steps", [0, 1], ids=["fresh local", "trained local"])
def test_restore_refuses_mismatch_and_changes_nothing(edit: Edit, match: str, local_steps: int) -> None:
    donor, donor_opt = make(1)
    train(donor, donor_opt, 2, seed=5)
    tensors, meta = transfer(donor, donor_opt, extra={"g": torch.ones(2)})
    edit(tensors, meta)
    local, local_opt = make(2)
    train(local, local_opt, local_steps, seed=6)
    before = fingerprint(local, local_opt)
    with pytest.raises(StateError, match=match):
        restore(local, {"opt": local_opt}, tensors, meta, extra_names={"g": torch.zeros(2)})
    assert fingerprint(local, local_opt) == before


def test_restore_refuses_a_differently_shaped_model() -> None:
    donor, _ = make(1, more=True)
    tensors, meta = capture(donor)
    for local in (make(2)[0], make(2, width=9)[0], make(2, dtype=torch.float64)[0]):
        before = digest(capture(local)[0])
        with pytest.raises(StateError, match="model entry"):
            restore(local, {}, tensors, meta)
        assert digest(capture(local)[0]) == before


def test_restored_optimizer_state_does_not_alias_the_input() -> None:
    donor, donor_opt = make(1)
    train(donor, donor_opt, 1)
    tensors, meta = transfer(donor, donor_opt)
    local, local_opt = make(2)
    restore(local, {"opt": local_opt}, tensors, meta)
    before = fingerprint(local, local_opt)
    for t in tensors.values():
        t.zero_()
    assert fingerprint(local, local_opt) == before


def test_restore_accepts_a_none_momentum_buffer() -> None:
    donor, donor_opt = make(1, "sgd_nesterov")
    tensors, meta = transfer(donor, donor_opt)
    meta["optim.opt"] = meta["optim.opt"].replace('"state":{}', '"state":{"0":{"momentum_buffer":null}}')
    local, local_opt = make(2, "sgd_nesterov")
    train(local, local_opt, 1)
    restore(local, {"opt": local_opt}, tensors, meta)
    assert local_opt.state_dict()["state"] == {0: {"momentum_buffer": None}}
    train(local, local_opt, 1)


def test_restore_sgd_state_checked_against_parameter() -> None:
    donor, donor_opt = make(1, "sgd_nesterov")
    train(donor, donor_opt, 1)
    tensors, meta = transfer(donor, donor_opt)
    tensors["optim.opt.0.momentum_buffer"] = torch.zeros(1)
    local, local_opt = make(2, "sgd_nesterov")
    before = fingerprint(local, local_opt)
    with pytest.raises(StateError, match="momentum_buffer' has shape \\[1\\]"):
        restore(local, {"opt": local_opt}, tensors, meta)
    assert fingerprint(local, local_opt) == before


def test_restore_state_of_unknown_optimizer_class() -> None:
    """Optimizers without a rule table: state tensors are the parameter's shape or scalars."""
    torch.manual_seed(1)
    donor = Net()
    donor_opt = torch.optim.RMSprop(donor.parameters(), lr=1e-3, momentum=0.5)
    train(donor, donor_opt, 2)
    tensors, meta = transfer(donor, donor_opt)
    torch.manual_seed(2)
    local = Net()
    local_opt = torch.optim.RMSprop(local.parameters(), lr=1e-3, momentum=0.5)
    restore(local, {"opt": local_opt}, tensors, meta)
    train(donor, donor_opt, 2, seed=3)
    train(local, local_opt, 2, seed=3)
    assert fingerprint(local, local_opt) == fingerprint(donor, donor_opt)
    tensors["optim.opt.0.square_avg"] = torch.zeros(2, 2)
    with pytest.raises(StateError, match=r"square_avg' (has shape|is torch.float32 \[2, 2\])"):
        restore(local, {"opt": local_opt}, tensors, meta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_restore_across_devices() -> None:
    donor, donor_opt = make(1)
    train(donor, donor_opt, 2)
    tensors, meta = transfer(donor, donor_opt)
    torch.manual_seed(2)
    local = Net().cuda()
    local_opt = adamw(local)
    restore(local, {"opt": local_opt}, tensors, meta)
    assert fingerprint(local, local_opt) == fingerprint(donor, donor_opt)
    assert all(p.device.type == "cuda" for p in local.parameters())
    back, back_meta = transfer(local, local_opt)  # captured from the device, back to host memory
    other, other_opt = make(3)
    restore(other, {"opt": other_opt}, back, back_meta)
    assert fingerprint(other, other_opt) == fingerprint(donor, donor_opt)


def test_a_download_takes_the_tensors_and_keeps_the_local_hyperparameters() -> None:
    """A donor's metadata is not covered by the state's digest: with ``tensors_only`` its learning rate
    and betas are not adopted (without, they are: a checkpoint of our own carries them)."""
    donor, donor_opt = make(1)
    train(donor, donor_opt, 2)
    for group in donor_opt.param_groups:
        group["lr"], group["betas"] = 1e6, (0.0, 0.0)
    tensors, meta = transfer(donor, donor_opt)
    local, local_opt = make(2)
    restore(local, {"opt": local_opt}, tensors, meta, tensors_only=True)
    assert [g["lr"] for g in local_opt.param_groups] == [1e-2, 1e-2]
    assert all(g["betas"] == (0.9, 0.999) for g in local_opt.param_groups)
    assert digest(capture(local, {"opt": local_opt})[0]) == digest(tensors)  # every tensor came across
    restore(local, {"opt": local_opt}, tensors, meta)
    assert [g["lr"] for g in local_opt.param_groups] == [1e6, 1e6]


def test_a_download_refuses_non_tensor_optimizer_state() -> None:
    donor, donor_opt = make(1)
    train(donor, donor_opt, 1)
    tensors, meta = transfer(donor, donor_opt)
    doc = json.loads(meta["optim.opt"])
    doc["state"] = {"0": {"unchecked": 1.0}}
    meta = {**meta, "optim.opt": json.dumps(doc)}
    local, local_opt = make(2)
    with pytest.raises(StateError, match="non-tensor state"):
        restore(local, {"opt": local_opt}, tensors, meta, tensors_only=True)
