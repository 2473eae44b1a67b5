"""Step results kept and replayed without a copy as large as the result on the heap (what a site's rank
0 needs: its result lies in a mapped wire buffer, and a replayed one is fetched into one).

- ``ResultStore.keep`` of values that are consecutive views of one storage (a contribution's flat
  buffer, a site's wire buffer) reads them in place (``flat_of``: a view, not a copy) and writes them a
  window at a time: the kept bytes are exactly those of the whole-tensor way (concatenate, convert,
  pack), for every form (float32, fp16, int8, top-k), in memory or spilled.
- ``ResultFetcher._values`` with an allocator puts the values in a mapped buffer: a float32 result's
  values are its fetched bytes themselves, any other form is decoded into a new mapped buffer; bit for
  bit the values the heap path gives.

Random values and splits from each seed; the window and the spill threshold are made small so that a
result of thousands of values crosses both."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.averaging import sparse
from p2ptrain.averaging.compression import INT8_BLOCK, Compression, decode, encode
from p2ptrain.averaging.spill import Spilled
from p2ptrain.training.site.wire import WireBuffer
from p2ptrain.training.state import replay, result_codec
from p2ptrain.training.state.protocol import ResultEntry, hash_pieces
from p2ptrain.training.state.replay import ResultFetcher, ResultStore, flat_of

SEEDS = range(6)


def values_of(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "float16":
        return torch.randn(n, generator=g).half().float()
    if kind == result_codec.INT8:
        cut = n // 3 + 7  # (a partition edge off the block grid)
        out = torch.empty(n)
        for a, b in ((0, cut), (cut, n)):
            mean = torch.randn(b - a, generator=g) * 1e-3
            out[a:b] = decode(encode(mean, Compression.INT8), Compression.INT8, b - a)
        return out
    if kind == result_codec.SPARSE:
        density, _ = Compression.TOPK3_Q2.sparse  # type: ignore[misc]
        mean = torch.randn(n, generator=g)
        return sparse.decode_sum(sparse.encode_sum(mean, density, 2), density, 2, n)
    return torch.randn(n, generator=g)


def split(flat: torch.Tensor, rng: random.Random) -> list[torch.Tensor]:
    """``flat`` as consecutive views of random sizes and shapes (a model's parameters over one buffer)."""
    cuts = sorted(rng.sample(range(1, flat.numel()), rng.randrange(1, 6)))
    out = []
    for a, b in zip([0, *cuts], [*cuts, flat.numel()], strict=True):
        part = flat[a:b]
        out.append(part.view(-1, 1) if rng.random() < 0.5 else part)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_kept_results_are_the_whole_tensors_bytes_and_replay_into_mapped_buffers_bit_for_bit(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(replay, "WINDOW", rng.choice([INT8_BLOCK, 1000, 4096]))
    monkeypatch.setattr(replay, "SPILL_BYTES", rng.choice([1 << 12, 1 << 30]))
    fetcher = ResultFetcher(None, chunk_timeout=1.0, allocate=WireBuffer)  # type: ignore[arg-type]
    heap = ResultFetcher(None, chunk_timeout=1.0)  # type: ignore[arg-type]
    for kind in ("float32", "float16", result_codec.INT8, result_codec.SPARSE):
        n = rng.randrange(3 * INT8_BLOCK, 16 * INT8_BLOCK)
        values = values_of(kind, n, g)
        wire = WireBuffer(n)  # (where a site's round leaves its result)
        wire.flat.copy_(values)
        views = split(wire.flat, rng)
        flat = flat_of(views)
        assert flat.data_ptr() == wire.flat.data_ptr() and flat.numel() == n  # read in place
        compact = [torch.float16] if kind == "float16" else []
        # (a run's compression names one form; values of another form are tried against both)
        packs = (kind,) if kind in result_codec.PACKED else (result_codec.INT8, result_codec.SPARSE)
        store = ResultStore(None, 2, lambda e: b"")
        store.keep(0, range(len(views)), views, compact, (b"b", b"a"), packs)
        kept = store.get(0)
        assert kept is not None
        # the whole-tensor way, as it was: concatenated, converted or packed at once
        whole = torch.cat([v.reshape(-1) for v in views])
        packed = result_codec.pack(whole, packs) if kind in result_codec.PACKED else None
        if packed is not None:
            want_kind, want = packed[0], packed[1]
        else:
            want_kind = "float16" if kind == "float16" else "float32"
            dtype = torch.float16 if kind == "float16" else torch.float32
            want = whole.to(dtype).view(torch.uint8).numpy().tobytes()
        assert kept.kind == want_kind == kind
        assert bytes(kept.read()) == want
        assert isinstance(kept.data, Spilled) == (len(want) >= replay.SPILL_BYTES)
        # replayed: into mapped buffers, the same values as on the heap and as kept
        entry = ResultEntry(0, 0, len(views), kept.kind, kept.size, b"b", b"a")
        mapped, into = fetcher._into(entry, torch.float32)
        assert mapped is not None and into is not None and len(into) == kept.size
        into[:] = bytes(kept.read())  # (what ``fetch_pieces`` writes there)
        got, held = fetcher._values(entry, into, torch.float32, n, mapped)
        on_heap, none = heap._values(entry, bytearray(kept.read()), torch.float32, n, None)
        assert none is None and isinstance(held, WireBuffer)
        assert got.data_ptr() == held.flat.data_ptr() and held.numel == n
        if kind == "float32":
            assert held is mapped  # (its fetched bytes are its values: no second buffer)
        assert torch.equal(got.view(torch.int32), on_heap.view(torch.int32))
        assert torch.equal(got.view(torch.int32), values.view(torch.int32))
        wire.close()


def test_values_that_are_not_consecutive_views_of_one_storage_are_copied_in_order() -> None:
    a, b = torch.arange(6.0), torch.arange(4.0) + 10
    for views in ([a[:3], b], [a[3:], a[:3]], [a[::2]], [a[:2], a[3:]]):
        flat = flat_of(views)
        assert torch.equal(flat, torch.cat([v.reshape(-1) for v in views]))
        assert flat.data_ptr() != a.data_ptr()  # (a copy: no view of it is in this order)
    assert flat_of([a[:2], a[2:5]]).data_ptr() == a.data_ptr()
    assert flat_of([]).numel() == 0


def test_a_packed_result_unpacked_into_a_buffer_of_another_size_is_refused() -> None:
    values = values_of(result_codec.SPARSE, 8 * INT8_BLOCK, torch.Generator().manual_seed(0))
    packed = result_codec.pack(values, (result_codec.SPARSE,))
    assert packed is not None
    with pytest.raises(ValueError, match="float32 values"):
        result_codec.unpack(result_codec.SPARSE, packed[1], values.numel(), out=torch.empty(3))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_spilled_results_piece_hashes_read_a_piece_at_a_time_are_the_whole_results(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder names a result's piece hashes (``train.result_pieces``) reading one piece at a time from
    its spill file, never the whole result into memory: the same hashes as over the whole bytes."""
    rng = random.Random(seed)
    monkeypatch.setattr(replay, "SPILL_BYTES", 1 << 10)
    n = rng.randrange(1, 20_000)
    store = ResultStore(None, 1, lambda e: b"")
    store.keep(0, range(1), [torch.randn(n, generator=torch.Generator().manual_seed(seed))], [])
    kept = store.get(0)
    assert kept is not None and isinstance(kept.data, Spilled) == (4 * n >= 1 << 10)
    piece = rng.choice([1, 7, 1000, 4096, 4 * n, 4 * n + 3])
    assert ResultStore._hash_spilled(kept, piece) == hash_pieces(bytes(kept.read()), piece)


@pytest.mark.parametrize("seed", range(3))
def test_an_int8_result_packed_into_a_spill_file_is_the_in_memory_packing(seed: int) -> None:
    """``replay.spill_int8`` writes the codes at their place as they come and the head before them: the
    bytes of ``result_codec.pack_int8``, for results of many partitions (the head's room is its most)
    and for values of no int8 form (None)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = rng.randrange(INT8_BLOCK, 24 * INT8_BLOCK)
    edges = sorted(rng.sample(range(1, n), rng.randrange(1, 12)))
    values = torch.empty(n)
    for a, b in zip([0, *edges], [*edges, n], strict=True):
        mean = torch.randn(b - a, generator=g) * 1e-3
        values[a:b] = decode(encode(mean, Compression.INT8), Compression.INT8, b - a)
    want = result_codec.pack_int8(values)
    got = replay.spill_int8(values)
    if want is None:  # (partitions too short to tell apart: no int8 form either way)
        assert got is None
    else:
        assert got is not None and bytes(got.read()) == want
        assert torch.equal(result_codec.unpack(result_codec.INT8, got.read(), n), values)
        got.file.close()
    assert replay.spill_int8(torch.randn(n, generator=g)) is None
