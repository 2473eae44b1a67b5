"""The top-k encodings (``averaging.sparse``): what a member sends and the sum it gets back, their exact
sizes, that re-encoding loses nothing more, and that hostile bytes are refused before any value is used."""

from __future__ import annotations

import struct

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
        s = bytes(encode(y, mode, members))
        assert len(s) == encoded_size(mode, n, members)


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


def contribution(n: int = 100) -> tuple[bytearray, int]:
    """A valid 1%-2-bit contribution of ``n`` elements (one block): its bytes and slot count."""
    x = torch.zeros(n)
    x[10] = 1.0
    return bytearray(encode(x, Compression.TOPK1_Q2)), sparse.kept(0.01, n)


def test_hostile_contributions_are_refused_before_a_value_is_used() -> None:
    mode, n = Compression.TOPK1_Q2, 100
    wire, _ = contribution(n)  # one slot: scale (4), index (2), one byte of levels
    assert len(wire) == 7
    acc = torch.full((n,), 5.0)
    cases = {
        "wrong length": bytes(wire[:-1]),
        "outside its block": wire[:4] + struct.pack("<H", n) + wire[6:],
        "negative or non-finite scale": struct.pack("<f", -1.0) + wire[4:],
        "NaN scale": struct.pack("<f", float("nan")) + wire[4:],
        "level in an empty slot": wire[:4] + struct.pack("<H", sparse.EMPTY) + bytes([1]),
        "bits set past": wire[:6] + bytes([wire[6] | 0b100]),
    }
    for what, bad in cases.items():
        with pytest.raises(RemoteProtocolError):
            accumulate(acc, bytes(bad), mode, 1.0)
        assert torch.equal(acc, torch.full((n,), 5.0)), what


def test_repeated_or_unordered_indices_are_refused() -> None:
    mode = Compression.TOPK3_Q4
    n = 200  # 6 slots
    x = torch.zeros(n)
    x[[5, 50, 150]] = torch.tensor([1.0, -2.0, 3.0])
    wire = bytearray(encode(x, mode))
    idx = np.frombuffer(bytes(wire[4 : 4 + 12]), dtype="<u2").copy()
    assert idx[:3].tolist() == [5, 50, 150] and (idx[3:] == sparse.EMPTY).all()
    for bad in ([50, 5, 150], [5, 5, 150], [5, sparse.EMPTY, 150]):
        changed = idx.copy()
        changed[:3] = bad
        with pytest.raises(RemoteProtocolError, match=r"order|repeated|empty"):
            decode(bytes(wire[:4]) + changed.astype("<u2").tobytes() + bytes(wire[16:]), mode, n)


def test_a_sum_takes_two_and_a_half_bytes_a_slot() -> None:
    mode = Compression.TOPK1_Q2
    n = 4 * sparse.BLOCK
    slots = sparse.sum_slots(0.01, 4, sparse.BLOCK)
    # per block: a float32 scale, a uint16 count, then 12-bit indices and 8-bit values
    assert encoded_size(mode, n, 4) == 4 * (6 + slots * 5 // 2)
    assert encoded_size(mode, n, 4) < 0.65 * 4 * 4 * slots  # a 16-bit index and a bfloat16: 4 bytes


def hostile_sums() -> dict[str, bytes]:
    """A valid 2-slot sum of 100 elements (one used), then ways to break it."""
    x = torch.zeros(100)
    x[7] = -1.5
    wire = bytes(encode(x, Compression.TOPK1_Q2, 2))
    # scale (4), count (2), two 12-bit indices (3), two codes (2)
    assert len(wire) == 11 and struct.unpack("<fH", wire[:6]) == (1.5, 1) and wire[-1] == 0
    scale, count, idx, codes = wire[:4], wire[4:6], wire[6:9], wire[9:]
    assert idx == bytes([7, 0, 0]) and codes[0] == 0xFE  # -448 in e4m3
    return {
        "valid": wire,
        "nan code": scale + count + idx + bytes([0x7F, 0]),
        "value in an empty slot": scale + count + idx + bytes([codes[0], 0x38]),
        "index in an empty slot": scale + count + bytes([7, 0x10, 0]) + codes,
        "count past its slots": scale + struct.pack("<H", 3) + idx + codes,
        "count with no scale": struct.pack("<f", 0.0) + count + idx + codes,
        "negative scale": struct.pack("<f", -1.5) + count + idx + codes,
        "infinite scale": struct.pack("<f", float("inf")) + count + idx + codes,
        "index outside its block": scale + count + bytes([100, 0, 0]) + codes,
        "two used slots out of order": scale + struct.pack("<H", 2) + bytes([7, 0x50, 0]) + codes,
        "wrong length": wire[:-1],
    }


def test_a_hostile_sum_is_refused_before_a_value_is_used() -> None:
    mode, cases = Compression.TOPK1_Q2, hostile_sums()
    got = decode(cases.pop("valid"), mode, 100, 2)
    assert got[7] == -1.5 and int((got != 0).sum()) == 1
    for what, bad in cases.items():
        with pytest.raises(RemoteProtocolError):
            decode(bad, mode, 100, 2)
            pytest.fail(f"{what}: decoded")


def test_encoding_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode(torch.tensor([1.0, float("nan")]), Compression.TOPK1_Q2)
