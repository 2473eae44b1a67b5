"""The top-k encodings (``averaging.sparse``): what a member sends and the sum it gets back, their exact
sizes, that re-encoding loses nothing more, and that hostile bytes are refused before any value is used."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
import pytest
import torch

from p2ptrain.averaging import sparse
from p2ptrain.averaging.compression import Compression, accumulate, decode, encode, encoded_size, roundtrip
from p2ptrain.errors import RemoteProtocolError

MODES = [m for m in Compression if m.sparse]
COUNTS = [1, 7, sparse.BLOCK - 1, sparse.BLOCK, 2 * sparse.BLOCK + 3]


def sample(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", COUNTS)
def test_sizes_are_exact_and_reencoding_changes_nothing(mode: Compression, n: int) -> None:
    x = sample(n)
    wire = bytes(encode(x, mode))
    assert len(wire) == encoded_size(mode, n)
    y = decode(wire, mode, n)
    assert bytes(encode(y, mode)) == wire  # compressing before the round loses nothing more in it
    assert torch.equal(roundtrip(y, mode), y)
    for members in (1, 3, 64):
        s = bytes(encode(y, mode, members))  # y's blocks fill a contribution's slots: one member's sum
        assert len(s) <= encoded_size(mode, n, members)
        assert len(s) == encoded_size(mode, n, members) or members > 1
        assert torch.equal(decode(s, mode, n, members) != 0, y != 0)


@pytest.mark.parametrize("mode", MODES)
def test_each_block_keeps_its_largest_values_with_their_signs(mode: Compression) -> None:
    density, bits = mode.sparse or (0.0, 0)
    n = 3 * sparse.BLOCK + 100
    x = sample(n, 1)
    y = decode(encode(x, mode), mode, n)
    for a in range(0, n, sparse.BLOCK):
        block, got = x[a : a + sparse.BLOCK], y[a : a + sparse.BLOCK]
        k = sparse.kept(density, block.numel())
        top = set(torch.topk(block.abs(), k).indices.tolist())
        assert set(got.nonzero().flatten().tolist()) == top
        idx = list(top)
        assert torch.equal(torch.sign(got[idx]), torch.sign(block[idx]))
        # the largest keeps its value exactly (it sets the scale); the others are within half a level
        scale = block.abs().max()
        assert got.abs().max() == scale
        step = 2 * scale / ((1 << bits) - 1)
        assert (got[idx] - block[idx]).abs().max() <= step / 2 + 1e-6


def test_zeros_are_never_sent_and_a_sum_keeps_every_value_its_members_sent() -> None:
    mode = Compression.TOPK1_Q2
    assert torch.equal(roundtrip(torch.zeros(5000), mode), torch.zeros(5000))
    x = torch.zeros(sparse.BLOCK)
    x[[3, 900]] = torch.tensor([2.0, -2.0])  # fewer non-zeros than slots: the rest stay empty
    assert torch.equal(roundtrip(x, mode), x)
    members = [roundtrip(sample(2 * sparse.BLOCK, s), mode) for s in range(4)]
    total = sum(members)
    got = decode(encode(total, mode, 4), mode, total.numel(), 4)
    assert torch.equal(got != 0, total != 0)
    # e4m3 values: three mantissa bits, so within 2**-4 of each value (the members' levels: 1/3 of a scale)
    torch.testing.assert_close(got, total, rtol=2**-4, atol=0)
    assert torch.equal(got.abs().max(), total.abs().max())  # the largest sets the scale: exact


def test_a_sum_with_more_values_than_slots_keeps_the_largest() -> None:
    mode = Compression.TOPK1_Q2
    x = sample(sparse.BLOCK, 3)
    got = decode(encode(x, mode, 2), mode, x.numel(), 2)
    slots = sparse.sum_slots(0.01, 2, sparse.BLOCK)
    assert set(got.nonzero().flatten().tolist()) == set(torch.topk(x.abs(), slots).indices.tolist())


Block = tuple[float, int, list[int], int, list[int], list[int], int]
"""A block's fields as the wire lays them out: scale, upper field's length, its set bits, low-part width,
low parts, codes, code width (so that tests can also write what an encoder never would)."""


def fields(scale: float, length: int, k: int, idx: list[int], codes: list[int], code_bits: int) -> Block:
    low = math.floor(math.log2(length / k))
    ones = [(j >> low) + i for i, j in enumerate(idx)]
    lows = [j & ((1 << low) - 1) for j in idx] + [0] * (k - len(idx))
    return (scale, k + ((length - 1) >> low), ones, low, lows, codes + [0] * (k - len(codes)), code_bits)


def wire(blocks: list[Block], pad: int = 0, counts: list[int] | None = None) -> bytes:
    """The module docstring's layout, written bit by bit: the scales, then each block's upper field, low
    parts and codes, low bits first (``pad``: set that padding bit too). ``counts``: a sum's, in the
    header; then of a block with ``c`` used slots only the upper field's first bits, ``c`` low parts and
    ``c`` codes are sent (none of a block of none), every block's upper field first, then every low
    part, then every code."""
    head = b"".join(struct.pack("<f", b[0]) for b in blocks)
    if counts is not None:
        head += struct.pack(f"<{len(counts)}H", *counts)
    uppers: list[int] = []
    lows_bits: list[int] = []
    codes_bits: list[int] = []
    for at, (_, upper, ones, low, lows, codes, code_bits) in enumerate(blocks):
        k = c = len(lows)
        if counts is not None:
            c = counts[at]
            if c == 0:
                continue
            upper -= k - c
        fields = (
            [int(i in ones) for i in range(upper)],
            [(v >> b) & 1 for v in lows[:c] for b in range(low)],
            [(v >> b) & 1 for v in codes[:c] for b in range(code_bits)],
        )
        if counts is None:  # a contribution: each block's fields together
            uppers += fields[0] + fields[1] + fields[2]
        else:
            uppers, lows_bits, codes_bits = uppers + fields[0], lows_bits + fields[1], codes_bits + fields[2]
    bits = uppers + lows_bits + codes_bits
    tail = [0] * (-len(bits) % 8)
    if pad:
        tail[pad - 1] = 1
    bits += tail
    return head + bytes(sum(bits[i + b] << b for b in range(8)) for i in range(0, len(bits), 8))


def blocks_of(
    y: torch.Tensor, k_of: Callable[[int], int], code: Callable[[torch.Tensor], list[int]], cb: int
) -> list[Block]:
    out = []
    for a in range(0, y.numel(), sparse.BLOCK):
        block = y[a : a + sparse.BLOCK]
        idx = block.nonzero().flatten()
        scale = float(block.abs().max())
        out.append(
            fields(scale, block.numel(), k_of(block.numel()), idx.tolist(), code(block[idx] / scale), cb)
        )
    return out


@pytest.mark.parametrize("mode", [Compression.TOPK05_Q2, Compression.TOPK3_Q4])
def test_the_wire_is_the_documented_layout(mode: Compression) -> None:
    density, bits = mode.sparse or (0.0, 0)
    n, top = 2 * sparse.BLOCK + 1000, (1 << bits) - 1
    y = roundtrip(sample(n, 5), mode)
    levels = lambda v: ((v * top + top) / 2).round().to(torch.int64).tolist()  # noqa: E731
    assert bytes(encode(y, mode)) == wire(blocks_of(y, lambda n: sparse.kept(density, n), levels, bits))
    total = sum(roundtrip(sample(n, s), mode) for s in range(3))
    got = decode(encode(total, mode, 3), mode, n, 3)
    e4m3 = lambda v: (v * 448).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64).tolist()  # noqa: E731
    slots = lambda n: sparse.sum_slots(density, 3, n)  # noqa: E731
    counts = [int((got[a : a + sparse.BLOCK] != 0).sum()) for a in range(0, n, sparse.BLOCK)]
    assert bytes(encode(total, mode, 3)) == wire(blocks_of(got, slots, e4m3, 8), counts=counts)


def test_an_index_takes_about_two_bits_more_than_log2_of_the_gap() -> None:
    n = 4 * sparse.BLOCK
    # 0.5%: 21 slots of 4096, 7 low bits, an upper field of 21 + 31 bits, 2-bit levels: 241 bits a block
    assert encoded_size(Compression.TOPK05_Q2, n) == 4 * 4 + -(-4 * 241 // 8)
    assert encoded_size(Compression.TOPK05_Q2, n) < 0.7 * 4 * (4 + 21 * 2 + 21 * 2 / 8)  # 16-bit indices
    # the sum of 8, every slot used: 168 slots, 4 low bits, 168 + 255 upper bits, e4m3 values: 2439 bits
    # a block, and a count
    assert encoded_size(Compression.TOPK05_Q2, n, 8) == 4 * 6 + -(-4 * 2439 // 8)
    assert encoded_size(Compression.TOPK05_Q2, n, 8) < 0.75 * 4 * (6 + 168 * 5 / 2)  # 12-bit indices


def test_a_sum_sends_only_the_slots_its_members_filled() -> None:
    mode, n = Compression.TOPK05_Q2, 4 * sparse.BLOCK
    same = roundtrip(sample(n, 2), mode)
    # eight members that picked the same 21 values a block: 255 + 21 upper bits, 21 x (4 + 8) others
    assert len(encode(8 * same, mode, 8)) == 4 * 6 + -(-4 * (255 + 21 + 21 * 12) // 8)
    assert len(encode(torch.zeros(n), mode, 8)) == 4 * 6  # nothing used: the header alone
    apart = sum(roundtrip(sample(n, s), mode) for s in range(8))
    assert len(encode(apart, mode, 8)) > 3 * len(encode(8 * same, mode, 8))


def contribution_cases() -> dict[str, bytes]:
    """A valid 1%-2-bit contribution of 100 elements (one slot: 6 low bits, a 2-bit upper field; 10 bits),
    then ways to break it."""

    def one(scale: float = 1.0, ones: list[int] | None = None, low: int = 10, code: int = 3, pad: int = 0):
        return wire([(scale, 2, [0] if ones is None else ones, 6, [low], [code], 2)], pad)

    x = torch.zeros(100)
    x[10] = 1.0
    valid = bytes(encode(x, Compression.TOPK1_Q2))
    assert valid == one() and len(valid) == 6
    return {
        "valid": valid,
        "wrong length": valid[:-1],
        "more indices than slots": one(ones=[0, 1]),
        "outside its block": one(ones=[1], low=40),  # (1 << 6) + 40 = 104
        "negative scale": one(scale=-1.0),
        "NaN scale": one(scale=math.nan),
        "infinite scale": one(scale=math.inf),
        "a scale with no slot used": one(ones=[], low=0, code=0),
        "a slot used with no scale": one(scale=0.0),
        "low part in an empty slot": one(ones=[], scale=0.0, code=0),
        "level in an empty slot": one(ones=[], scale=0.0, low=0),
        "bits set past the last block": one(pad=3),
    }


def test_hostile_contributions_are_refused_before_a_value_is_used() -> None:
    mode, n, cases = Compression.TOPK1_Q2, 100, contribution_cases()
    acc = torch.full((n,), 5.0)
    accumulate(acc, cases.pop("valid"), mode, 1.0)
    assert acc[10] == 6.0 and int((acc != 5.0).sum()) == 1
    for what, bad in cases.items():
        with pytest.raises(RemoteProtocolError):
            accumulate(acc, bad, mode, 1.0)
            pytest.fail(f"{what}: accepted")
        assert acc[10] == 6.0 and int((acc != 5.0).sum()) == 1, what


def test_repeated_or_unordered_indices_are_refused() -> None:
    mode = Compression.TOPK3_Q4
    n = 200  # 6 slots, 5 low bits, an upper field of 6 + 6 bits
    x = torch.zeros(n)
    x[[5, 50, 150]] = torch.tensor([1.0, -2.0, 3.0])
    good = fields(3.0, n, 6, [5, 50, 150], [10, 2, 15], 4)  # levels: round((v / 3 * 15 + 15) / 2)
    assert bytes(encode(x, mode)) == wire([good])
    scale, upper, _, low, _, codes, cb = good
    # two indices in one bucket (high part 0): 5 then 5, and 18 then 5
    for lows in ([5, 5, 22], [18, 5, 22]):
        bad = wire([(scale, upper, [0, 1, 6], low, lows + [0] * 3, codes, cb)])
        with pytest.raises(RemoteProtocolError, match=r"order|repeated"):
            decode(bad, mode, n)


def sum_cases() -> dict[str, bytes]:
    """A valid 2-slot sum of 100 elements (one used: 5 low bits, an upper field of 2 + 3 bits of which
    3 + 1 are sent), then ways to break it."""

    def two(
        scale: float = 1.5,
        ones: list[int] | None = None,
        lows: tuple[int, int] = (7, 0),
        codes: tuple[int, int] = (0xFE, 0),
        count: int = 1,
        pad: int = 0,
    ) -> bytes:
        block = (scale, 5, [0] if ones is None else ones, 5, list(lows), list(codes), 8)
        return wire([block], pad, counts=[count])

    x = torch.zeros(100)
    x[7] = -1.5
    valid = bytes(encode(x, Compression.TOPK1_Q2, 2))
    assert valid == two() and len(valid) == 4 + 2 + 3  # 4 + 5 + 8 bits
    return {
        "valid": valid,
        "nan code": two(codes=(0x7F, 0)),
        "a count past its slots": two(count=3, ones=[0, 1, 2], lows=(7, 8), codes=(1, 2)),
        "a count above its indices": two(count=2, codes=(0xFE, 0x38)),
        "a count below its indices": two(ones=[0, 1]),
        "a slot used with no scale": two(scale=0.0),
        "a scale with no slot used": two(count=0),
        "negative scale": two(scale=-1.5),
        "infinite scale": two(scale=math.inf),
        "index outside its block": two(ones=[3], lows=(8, 0)),  # (3 << 5) + 8 = 104
        "two used slots out of order": two(count=2, ones=[0, 1], lows=(7, 3), codes=(0xFE, 0x38)),
        "bits set past the last block": two(pad=1),
        "one byte short": valid[:-1],
        "one byte long": valid + b"\0",
        "shorter than its header": valid[:5],
    }


def test_a_hostile_sum_is_refused_before_a_value_is_used() -> None:
    mode, cases = Compression.TOPK1_Q2, sum_cases()
    got = decode(cases.pop("valid"), mode, 100, 2)
    assert got[7] == -1.5 and int((got != 0).sum()) == 1
    for what, bad in cases.items():
        with pytest.raises(RemoteProtocolError):
            decode(bad, mode, 100, 2)
            pytest.fail(f"{what}: decoded")


def test_encoding_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode(torch.tensor([1.0, float("nan")]), Compression.TOPK1_Q2)


@pytest.mark.parametrize("members", [0, 4])
def test_flipped_bits_are_refused_or_decode_to_finite_values_within_the_slots(members: int) -> None:
    mode, n = Compression.TOPK1_Q4, 2 * sparse.BLOCK + 300
    x = roundtrip(sample(n, 9), mode)
    valid = bytes(encode(x * 3 if members else x, mode, members))
    rng = np.random.default_rng(7)
    refused = 0
    for _ in range(300):
        bad = bytearray(valid)
        for at in rng.integers(0, 8 * len(bad), size=int(rng.integers(1, 4))):
            bad[at // 8] ^= 1 << (at % 8)
        try:
            got = decode(bytes(bad), mode, n, members)
        except RemoteProtocolError:
            refused += 1
            continue
        assert bool(torch.isfinite(got).all())
        for a in range(0, n, sparse.BLOCK):
            length = min(sparse.BLOCK, n - a)
            slots = sparse.sum_slots(0.01, members, length) if members else sparse.kept(0.01, length)
            assert int((got[a : a + sparse.BLOCK] != 0).sum()) <= slots
    assert refused > 0  # (most single flips in an index field break its order or its count)
