"""Compression of flat float32 slices: sizes, error bounds, determinism and hostile bytes (pure)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.averaging.compression import (
    DENSE,
    INT8_BLOCK,
    Compression,
    accumulate,
    all_finite,
    chunk_elements,
    decode,
    encode,
    encoded_size,
    error_bound,
    parse_compression,
)
from p2ptrain.errors import RemoteProtocolError

MODES = list(DENSE)
LOSSY = [Compression.FP16, Compression.BF16, Compression.INT8]
SIZES = [1, 7, 1023, 1024, 1025, 100003]
FLT_MAX = torch.finfo(torch.float32).max


def nbytes(buf: bytes | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def round_trip(x: torch.Tensor, mode: Compression) -> torch.Tensor:
    return decode(encode(x, mode), mode, x.numel())


def max_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).abs().max()) if x.numel() else 0.0


def int8_reference(x: torch.Tensor) -> torch.Tensor:
    """Blockwise symmetric int8 written independently: pad with zeros (absmax unchanged), quantize."""
    n = x.numel()
    blocks = torch.cat([x, x.new_zeros(-n % INT8_BLOCK)]).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(dim=1) / 127
    q = torch.nan_to_num((blocks / scale[:, None]).round().clamp(-127, 127), nan=0.0)
    return (q * scale[:, None]).flatten()[:n]


# ---- round trips and sizes ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_within_bound(mode: Compression, n: int) -> None:
    x = randn(n, seed=n) * 3
    buf = encode(x, mode)
    assert nbytes(buf) == encoded_size(mode, n)
    y = decode(buf, mode, n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert max_error(x, y) <= error_bound(x, mode)
    if mode is Compression.NONE:
        assert torch.equal(x, y)


@pytest.mark.parametrize("mode", MODES)
def test_empty_slice(mode: Compression) -> None:
    x = torch.empty(0)
    assert nbytes(encode(x, mode)) == encoded_size(mode, 0) == 0
    assert decode(b"", mode, 0).shape == (0,)


@pytest.mark.parametrize("mode", MODES)
def test_zeros_decode_exactly(mode: Compression) -> None:
    x = torch.zeros(2 * INT8_BLOCK + 5)
    assert torch.equal(round_trip(x, mode), x)
    if mode is Compression.INT8:
        assert bytes(encode(x, mode)) == bytes(encoded_size(mode, x.numel()))  # zero scales, zero values


@pytest.mark.parametrize("mode", MODES)
def test_negative_values_keep_their_sign(mode: Compression) -> None:
    x = -(randn(3000, seed=1).abs() + 0.5)
    y = round_trip(x, mode)
    assert bool((y < 0).all())
    assert max_error(x, y) <= error_bound(x, mode)


def test_fp16_clamps_out_of_range_values_instead_of_infinity() -> None:
    x = torch.tensor([1e6, -1e6, 70000.0, 65504.0, 1.0, -FLT_MAX])
    y = round_trip(x, Compression.FP16)
    assert y.tolist() == [65504.0, -65504.0, 65504.0, 65504.0, 1.0, -65504.0]
    assert max_error(x, y) <= error_bound(x, Compression.FP16)


def test_bf16_clamps_values_that_would_round_to_infinity() -> None:
    x = torch.tensor([FLT_MAX, -FLT_MAX, 1.0])
    y = round_trip(x, Compression.BF16)
    assert bool(torch.isfinite(y).all())
    assert y[2] == 1.0
    assert max_error(x, y) <= error_bound(x, Compression.BF16)


def test_int8_encodes_values_near_float32_max() -> None:
    # FLT_MAX / 127 rounds up in float32, so the naive scale times 127 overflows and a decoder must
    # refuse it: the encoder steps such a scale down instead and the round trip stays within the bound
    x = torch.tensor([FLT_MAX, -FLT_MAX / 3, 1.0])
    y = round_trip(x, Compression.INT8)
    assert bool(torch.isfinite(y).all())
    assert max_error(x, y) <= error_bound(x, Compression.INT8)
    assert round_trip(torch.tensor([FLT_MAX]), Compression.INT8).item() > 0.99 * FLT_MAX


@pytest.mark.parametrize("n", SIZES)
def test_lossy_modes_match_torch_references(n: int) -> None:
    x = randn(n, seed=7) * 100
    assert torch.equal(round_trip(x, Compression.FP16), x.half().float())
    assert torch.equal(round_trip(x, Compression.BF16), x.bfloat16().float())
    assert torch.equal(round_trip(x, Compression.INT8), int8_reference(x))


def test_int8_error_is_bounded_per_block() -> None:
    # each block gets its own scale: a tiny block next to a huge one keeps its own resolution
    x = torch.cat([randn(INT8_BLOCK, seed=2) * 1e4, randn(INT8_BLOCK, seed=3) * 1e-3, randn(17, seed=4)])
    y = round_trip(x, Compression.INT8)
    for a in range(0, x.numel(), INT8_BLOCK):
        xb, yb = x[a : a + INT8_BLOCK], y[a : a + INT8_BLOCK]
        assert max_error(xb, yb) <= float(xb.abs().max()) / 254 * (1 + 2**-18)


def test_int8_wire_size_is_about_a_quarter_of_fp32() -> None:
    n = 1000 * INT8_BLOCK
    assert encoded_size(Compression.INT8, n) == n + 4 * 1000
    assert encoded_size(Compression.INT8, n + 1) == n + 1 + 4 * 1001
    assert 0.25 < encoded_size(Compression.INT8, n) / encoded_size(Compression.NONE, n) < 0.251
    assert encoded_size(Compression.FP16, n) == encoded_size(Compression.BF16, n) == 2 * n


def test_non_contiguous_and_grad_inputs_are_accepted() -> None:
    x = randn(2000, seed=5)
    assert torch.equal(round_trip(x[::2], Compression.NONE), x[::2])
    w = x.clone().requires_grad_(True)
    assert torch.equal(round_trip(w, Compression.NONE), x)


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2), torch.zeros(())])
def test_encode_rejects_wrong_dtype_or_shape(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="1-D float32"):
        encode(bad, Compression.NONE)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, INT8_BLOCK + 3])  # a full block and the short last block
def test_encode_rejects_non_finite_input(mode: Compression, value: float, where: int) -> None:
    x = randn(INT8_BLOCK + 10)
    x[where] = value
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode(x, mode)


# ---- hostile bytes -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delta", [-1, 1, -4])
def test_wrong_length_is_a_remote_error(mode: Compression, delta: int) -> None:
    buf = bytes(encode(randn(1025), mode))
    bad = buf[:delta] if delta < 0 else buf + b"\x00" * delta
    with pytest.raises(RemoteProtocolError, match="bytes"):
        decode(bad, mode, 1025)
    acc = torch.zeros(1025)
    with pytest.raises(RemoteProtocolError):
        accumulate(acc, bad, mode, 1.0)
    assert not bool(acc.any())


@pytest.mark.parametrize(
    ("mode", "pattern"),
    [
        (Compression.NONE, struct.pack("<f", float("nan"))),
        (Compression.NONE, struct.pack("<f", float("-inf"))),
        (Compression.FP16, struct.pack("<H", 0x7E00)),  # NaN
        (Compression.FP16, struct.pack("<H", 0xFC00)),  # -inf
        (Compression.BF16, struct.pack("<H", 0x7FC0)),  # NaN
        (Compression.BF16, struct.pack("<H", 0x7F80)),  # inf
    ],
)
def test_non_finite_values_are_a_remote_error(mode: Compression, pattern: bytes) -> None:
    buf = bytearray(encode(randn(100), mode))
    buf[40 : 40 + len(pattern)] = pattern
    with pytest.raises(RemoteProtocolError, match="NaN or infinite"):
        decode(bytes(buf), mode, 100)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, FLT_MAX / 100])
@pytest.mark.parametrize("block", [0, 2])  # a full block and the short last block
def test_bad_int8_scales_are_a_remote_error(scale: float, block: int) -> None:
    n = 2 * INT8_BLOCK + 9
    buf = bytearray(encode(randn(n), Compression.INT8))
    struct.pack_into("<f", buf, 4 * block, scale)
    acc = randn(n, seed=9)
    before = acc.clone()
    with pytest.raises(RemoteProtocolError, match="scale"):
        accumulate(acc, memoryview(buf), Compression.INT8, 0.5)
    assert torch.equal(acc, before)


def test_int8_minus_128_is_a_remote_error() -> None:
    buf = bytearray(encode(randn(10), Compression.INT8))
    buf[4 + 3] = 0x80
    with pytest.raises(RemoteProtocolError, match="-128"):
        decode(bytes(buf), Compression.INT8, 10)


@pytest.mark.parametrize("mode", MODES)
def test_decode_accepts_read_only_and_unaligned_buffers(mode: Compression) -> None:
    x = randn(3001, seed=11)
    wire = bytes(encode(x, mode))
    frame = bytearray(b"\x01" + wire + b"\x02")  # a chunk inside a receive buffer, at an odd offset
    expected = decode(wire, mode, 3001)
    assert torch.equal(decode(memoryview(frame)[1:-1], mode, 3001), expected)
    assert torch.equal(decode(memoryview(wire), mode, 3001), expected)
    frame[1:5] = b"\x00\x00\x00\x00"  # the decoded tensor is a copy, not a view of the buffer
    assert torch.equal(decode(wire, mode, 3001), expected)


# ---- accumulation ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_accumulate_is_multiply_then_add_and_bit_deterministic(mode: Compression) -> None:
    n = 5000
    parts = [(bytes(encode(randn(n, seed=s) * (s + 1), mode)), 1 / (s + 3)) for s in range(5)]
    runs = []
    for _ in range(2):
        acc = torch.zeros(n)
        for buf, weight in parts:
            accumulate(acc, buf, mode, weight)
        runs.append(acc)
    assert torch.equal(runs[0], runs[1])
    reference = torch.zeros(n)
    for buf, weight in parts:
        reference = reference + decode(buf, mode, n) * weight  # two separately rounded fp32 ops
    assert torch.equal(runs[0], reference)


def test_accumulate_into_a_slice_of_a_flat_buffer() -> None:
    flat = torch.ones(3 * INT8_BLOCK)
    x = randn(INT8_BLOCK + 1)
    accumulate(flat[100 : 100 + x.numel()], encode(x, Compression.INT8), Compression.INT8, 2.0)
    assert torch.equal(flat[:100], torch.ones(100))
    assert torch.equal(flat[100 + x.numel() :], torch.ones(3 * INT8_BLOCK - 100 - x.numel()))
    assert torch.equal(flat[100 : 100 + x.numel()], 1 + int8_reference(x) * 2.0)


def test_accumulate_rejects_a_non_finite_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        accumulate(torch.zeros(3), encode(torch.ones(3), Compression.NONE), Compression.NONE, float("nan"))


# ---- chunking and parsing ----------------------------------------------------------------------


@pytest.mark.parametrize("target", [1, 7, 1027, 1028, 4096, 1 << 20, 4 << 20, (4 << 20) + 123])
@pytest.mark.parametrize("mode", MODES)
def test_chunk_elements(mode: Compression, target: int) -> None:
    n = chunk_elements(mode, target)
    assert n >= 1
    if mode is Compression.INT8:
        assert n % INT8_BLOCK == 0
    floor = encoded_size(mode, INT8_BLOCK if mode is Compression.INT8 else 1)
    if target >= floor:
        assert encoded_size(mode, n) <= target < encoded_size(mode, n) + floor


def test_chunk_elements_rejects_non_positive_targets() -> None:
    with pytest.raises(ValueError):
        chunk_elements(Compression.NONE, 0)


def test_parse_compression() -> None:
    assert parse_compression("int8") is Compression.INT8
    assert parse_compression(" BF16 ") is Compression.BF16
    assert [parse_compression(m.value) for m in Compression] == list(Compression)
    with pytest.raises(ValueError, match="none, fp16, bf16, int8") as info:
        parse_compression("int4")
    assert "int4" in str(info.value)


# ---- property ----------------------------------------------------------------------------------

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite32, min_size=1, max_size=2 * INT8_BLOCK + 50), mode=st.sampled_from(MODES))
def test_error_never_exceeds_the_stated_bound(values: list[float], mode: Compression) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = round_trip(x, mode)
    assert bool(torch.isfinite(y).all())
    assert max_error(x, y) <= error_bound(x, mode)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 1, 999])
def test_all_finite_finds_any_nan_or_infinity(bad: float, where: int) -> None:
    x = randn(1000, seed=11)
    assert all_finite(x) and all_finite(torch.empty(0))
    x[where] = bad
    assert not all_finite(x)
