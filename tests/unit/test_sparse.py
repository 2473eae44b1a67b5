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
    torch.testing.assert_close(got, total, rtol=2**-8, atol=0)


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


def test_a_sum_with_a_nan_or_a_stray_value_is_refused() -> None:
    mode = Compression.TOPK1_Q2
    x = torch.zeros(100)
    x[7] = 1.0
    wire = bytearray(encode(x, mode, 2))  # 2 slots: indices (4 bytes), bfloat16 values (4 bytes)
    assert len(wire) == 8
    nan = bytes(wire[:4]) + bytes(wire[4:6]) + b"\xc0\x7f"
    with pytest.raises(RemoteProtocolError):
        decode(nan, mode, 100, 2)
    stray = bytes(wire[:6]) + torch.tensor([1.0], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(RemoteProtocolError, match="empty slot"):
        decode(stray, mode, 100, 2)


def test_encoding_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode(torch.tensor([1.0, float("nan")]), Compression.TOPK1_Q2)
