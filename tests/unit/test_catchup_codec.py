"""Step results kept in the compact forms int8 and top-k rounds leave them in (``state.result_codec``).

The invariant: a packed result unpacks to exactly the float32 values that were packed (bit for bit), or
is not packed at all; bytes that are not a well-formed packed result of the count asked for raise
``RemoteProtocolError`` and never return values. Randomized and seeded: partition edges, group sizes,
corrupted bytes.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from p2ptrain.averaging import sparse
from p2ptrain.averaging.compression import INT8_BLOCK, Compression, decode, encode
from p2ptrain.errors import RemoteProtocolError
from p2ptrain.training.state import result_codec
from p2ptrain.training.state.result_codec import INT8, SPARSE, pack, unpack

SEEDS = range(8)


def int8_round_result(n: int, edges: list[int], seed: int) -> torch.Tensor:
    """What the members of an int8 round apply: each reducer's partition (``edges``: where they begin,
    not on the block grid) encoded and decoded on its own, on blocks counted from its start."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=g) * 1e-3
    out = torch.empty(n)
    bounds = [0, *edges, n]
    for a, b in itertools.pairwise(bounds):
        out[a:b] = decode(encode(mean[a:b].contiguous(), Compression.INT8), Compression.INT8, b - a)
    return out


def topk_round_result(n: int, members: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, generator=g)
    density, _ = Compression.TOPK3_Q2.sparse  # type: ignore[misc]
    return sparse.decode_sum(sparse.encode_sum(mean, density, members), density, members, n)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_int8_result_packs_to_about_a_quarter_and_unpacks_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(3 * INT8_BLOCK, 40 * INT8_BLOCK)
    edges = sorted(rng.sample(range(1, n), rng.randrange(1, 6)))
    values = int8_round_result(n, edges, seed)
    packed = pack(values, (INT8,))
    assert packed is not None and packed[0] == INT8
    assert len(packed[1]) <= n + 4 * (-(-n // INT8_BLOCK) + 2 * len(edges) + 2) + 4 * (len(edges) + 1) + 4
    back = unpack(INT8, packed[1], n)
    assert torch.equal(back.view(torch.int32), values.view(torch.int32))


@pytest.mark.parametrize("seed", SEEDS)
def test_blocks_exact_only_under_a_scale_an_ulp_off_the_encoders_are_packed_bit_for_bit(seed: int) -> None:
    """A block ``q * s`` whose decoded absmax, divided by 127, rounds to a scale one float32 step from
    ``s``: the first scale tried does not give it exactly, one of the two beside it does. Such blocks,
    among ones the first scale gives and a zero block, in one result: packed, and back bit for bit."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    blocks, off = [], 0
    while off < 3 or len(blocks) < 8:
        scale = torch.tensor(rng.uniform(1e-6, 10.0), dtype=torch.float32)
        q = torch.randint(-127, 128, (INT8_BLOCK,), generator=g).float()
        q[rng.randrange(INT8_BLOCK)] = rng.choice([127.0, -127.0])
        block = q * scale
        first = block.abs().max() / 127.0
        exact_under_first = torch.equal(torch.div(block, first).round().clamp(-127, 127) * first, block)
        if not exact_under_first:
            off += 1
            blocks.append(block)
        elif len(blocks) < 8 or rng.random() < 0.2:
            blocks.append(block)
    blocks.insert(rng.randrange(len(blocks)), torch.zeros(INT8_BLOCK))
    values = torch.cat(blocks)
    packed = pack(values, (INT8,))
    assert packed is not None and packed[0] == INT8
    back = unpack(INT8, packed[1], values.numel())
    assert torch.equal(back.view(torch.int32), values.view(torch.int32))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_topk_result_packs_to_its_filled_slots_and_unpacks_bit_for_bit(seed: int) -> None:
    n = random.Random(seed).randrange(sparse.BLOCK, 30 * sparse.BLOCK)
    values = topk_round_result(n, members=1 + seed % 4, seed=seed)
    packed = pack(values, (SPARSE,))
    assert packed is not None and packed[0] == SPARSE
    assert pack(values, (INT8,)) is None  # (fp8 values in blocks: not int8's form)
    assert len(packed[1]) == 4 + 8 * int(torch.count_nonzero(values))
    assert len(packed[1]) < 0.5 * 4 * n
    back = unpack(SPARSE, packed[1], n)
    assert torch.equal(back.view(torch.int32), values.view(torch.int32))


def test_values_in_no_compact_form_are_not_packed() -> None:
    dense = torch.randn(10 * INT8_BLOCK, generator=torch.Generator().manual_seed(0))
    assert pack(dense, (SPARSE, INT8)) is None


def well_formed(seed: int) -> list[tuple[str, bytes, int]]:
    n = 5 * INT8_BLOCK + 17
    out = []
    for kind, values in (
        (INT8, int8_round_result(n, [INT8_BLOCK + 100], seed)),
        (SPARSE, topk_round_result(n, 2, seed)),
    ):
        packed = pack(values, (kind,))
        assert packed is not None
        out.append((kind, packed[1], n))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_corrupt_bytes_raise_a_protocol_error_or_give_finite_values(seed: int) -> None:
    rng = random.Random(seed)
    for kind, data, n in well_formed(seed):
        for _ in range(60):
            bad = bytearray(data)
            how = rng.randrange(4)
            if how == 0:
                bad = bad[: rng.randrange(len(bad))]
            elif how == 1:
                bad += bytes(rng.randrange(1, 9))
            else:
                for _ in range(rng.randrange(1, 6)):
                    bad[rng.randrange(len(bad))] = rng.randrange(256)
            try:
                got = unpack(kind, bytes(bad), n)
            except RemoteProtocolError:
                continue
            assert got.shape == (n,) and bool(torch.isfinite(got).all())


def test_each_malformed_field_is_named() -> None:
    n = 3 * INT8_BLOCK
    one = (1).to_bytes(4, "little") + n.to_bytes(4, "little")  # one segment of n values
    cases = [
        (
            SPARSE,
            (2).to_bytes(4, "little") + (5).to_bytes(4, "little") + (3).to_bytes(4, "little") + bytes(8),
        ),
        (SPARSE, (1).to_bytes(4, "little") + (n).to_bytes(4, "little") + bytes(4)),  # index out of range
        (SPARSE, (1).to_bytes(4, "little") + bytes(4) + b"\x00\x00\xc0\x7f"),  # NaN value
        (INT8, one + b"\x00\x00\xc0\x7f" + bytes(8) + bytes(n)),  # NaN scale
        (INT8, one + bytes(12) + b"\x80" + bytes(n - 1)),  # code -128
        (INT8, (1).to_bytes(4, "little") + (n - 1).to_bytes(4, "little") + bytes(12) + bytes(n - 1)),
        (INT8, (0).to_bytes(4, "little")),  # no segment
        (INT8, one + bytes(12) + bytes(n) + bytes(1)),  # a byte too many
        ("float64", bytes(16)),
    ]
    for kind, data in cases:
        with pytest.raises(RemoteProtocolError):
            unpack(kind, data, n)
    assert result_codec.max_size(INT8, n) == 4 * n
