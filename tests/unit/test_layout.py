"""The chunked state layout: spans, hashes, the root digest, and strict parsing of a donor's header."""

from __future__ import annotations

import json

import pytest
import torch

from p2ptrain.training.state import capture, codec
from p2ptrain.training.state import chunks as lay
from p2ptrain.training.state.chunks import CHUNK, Layout
from p2ptrain.training.state.codec import StateError


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.big": torch.randn(CHUNK // 4 + 1000, generator=g),  # spills into a second chunk
        "b.small": torch.arange(7, dtype=torch.int64),
        "c.half": torch.randn(300_000, generator=g).half(),
        "d.flag": torch.tensor([True, False]),
        "e.empty": torch.zeros(0, 3),
    }


def test_spans_tile_the_data_section_and_place_rebuilds_every_tensor() -> None:
    src = tensors()
    layout = Layout.of(src)
    live = [src[e.name] for e in layout.entries]
    assert layout.size == sum(t.numel() * t.element_size() for t in src.values())
    assert layout.chunks == -(-layout.size // CHUNK) == 2
    covered = 0
    for i in range(layout.chunks):
        spans = list(layout.spans(i))
        assert spans[0].offset == 0
        assert sum(s.hi - s.lo for s in spans) == layout.chunk_size(i)
        covered += layout.chunk_size(i)
    assert covered == layout.size
    out = lay.empty_like(layout)
    for i in reversed(range(layout.chunks)):  # any order
        data = b"".join(bytes(p) for p in lay.chunk_pieces(layout, live, i))
        lay.place(layout, out, i, memoryview(data))
    for e, t in zip(layout.entries, out, strict=True):
        assert torch.equal(t, src[e.name]) and t.dtype == src[e.name].dtype


def test_the_root_commits_to_epoch_layout_and_every_byte() -> None:
    src = tensors()
    layout = Layout.of(src)
    live = [src[e.name] for e in layout.entries]
    hashes = lay.hash_chunks(layout, live)
    root = lay.root(3, layout, hashes)
    assert root == lay.root(3, Layout.of(dict(src)), lay.hash_chunks(layout, live))  # deterministic
    assert lay.root(4, layout, hashes) != root
    src["c.half"][-1] += 1  # one byte in the last chunk
    assert lay.root(3, layout, lay.hash_chunks(layout, live)) != root
    renamed = {("z" if k == "b.small" else k): v for k, v in src.items()}
    assert lay.root(3, Layout.of(renamed), lay.hash_chunks(layout, live)) != root
    with pytest.raises(Exception, match="chunk hashes"):
        lay.root(3, layout, hashes[:1])


def test_a_parsed_header_is_the_layout_it_describes() -> None:
    layout = Layout.of(tensors())
    again = Layout.parse(layout.header)
    assert again.entries == layout.entries and again.size == layout.size and again.header == layout.header


def header(entries: dict[str, object]) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"[]", "not an object"),
        (b'{"a": 1, "a": 2}', "repeats the key"),
        (header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}), "starts at byte 8"),
        (
            header(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                }
            ),
            "out of name order",
        ),
        (header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "needs 12"),
        (header({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}), "unknown dtype"),
        (header({"__metadata__": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}), "reserved"),
        (header({"a": {"dtype": "U8", "shape": [1 << 43], "data_offsets": [0, 1 << 43]}}), "chunks"),
    ],
)
def test_a_hostile_header_is_refused(raw: bytes, match: str) -> None:
    with pytest.raises(StateError, match=match):
        Layout.parse(raw)


def test_hash_lists_of_the_wrong_length_are_refused() -> None:
    assert lay.split_hashes(b"x" * 64, 2) == [b"x" * 32, b"x" * 32]
    with pytest.raises(StateError, match="hash list"):
        lay.split_hashes(b"x" * 63, 2)


def test_bool_bytes_other_than_0_and_1_are_refused() -> None:
    src = {"f": torch.tensor([True, False])}
    layout = Layout.of(src)
    out = lay.empty_like(layout)
    lay.place(layout, out, 0, memoryview(bytes([1, 7])))
    with pytest.raises(StateError, match="BOOL"):
        lay.check_bool_entries(layout, out)


def test_tied_weights_are_captured_once_and_restored_only_into_a_model_that_ties_them() -> None:
    def model(tied: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16, bias=False))
        if tied:
            m[1].weight = m[0].weight
        return m

    src = model(True)
    tensors_, meta = capture.capture(src)
    assert list(tensors_) == ["model.0.weight"] and json.loads(meta[codec.TIED_KEY]) == {
        "1.weight": "0.weight"
    }
    dst = model(True)
    with torch.no_grad():
        dst[0].weight.zero_()
    capture.restore(dst, {}, tensors_, meta)
    assert torch.equal(dst[1].weight, src[0].weight) and dst[1].weight is dst[0].weight
    untied = model(False)
    with pytest.raises(StateError, match="keeps them apart"):
        capture.restore(untied, {}, tensors_, meta)
    with pytest.raises(StateError, match="lacks model entry"):
        capture.restore(untied, {}, tensors_, {k: v for k, v in meta.items() if k != codec.TIED_KEY})


@pytest.mark.parametrize("seed", range(3))
def test_chunk_hashes_are_the_same_on_any_number_of_threads(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large state's chunks are hashed on several threads: each hash, in order, is the one a single
    thread computes (tensors of random sizes, chunk boundaries inside and across them, two dtypes)."""
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(3, 9, (1,), generator=g))
    sizes = torch.randint(1, 3 * CHUNK // 4, (count,), generator=g)  # (float32: up to 3 chunks each)
    src = {f"t{i}": torch.randn(int(n), generator=g) for i, n in enumerate(sizes)}
    src["half"] = torch.randn(CHUNK // 3, generator=g).half()  # (another dtype: spans of 2-byte values)
    layout = Layout.of(src)
    live = [src[e.name] for e in layout.entries]
    threads = torch.get_num_threads()
    monkeypatch.setattr(lay, "PARALLEL_CHUNKS", 2)  # (so that a state of a few chunks uses threads)
    try:
        torch.set_num_threads(1)
        one = lay.hash_chunks(layout, live)
        torch.set_num_threads(4)
        many = lay.hash_chunks(layout, live)
    finally:
        torch.set_num_threads(threads)
    assert len(one) == layout.chunks >= 4
    assert many == one
    assert len(set(one)) == len(one)  # (every chunk's bytes differ: a hash per chunk, not one repeated)


@pytest.mark.parametrize("threads", [1, 3])
def test_chunks_made_in_order_are_hashed_and_handed_on_each_once(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hash_each`` (a site's HASH: chunks assembled in order on rank 0, hashed and written on threads):
    every chunk is made once, in order, on the calling thread, handed on once, and its hash is in its
    place; an error while handing one on is raised, not lost."""
    import threading

    g = torch.Generator().manual_seed(threads)
    sizes = [5, 1 << 16] * 20
    blobs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes() for n in sizes]
    made, handed = [], {}
    caller = threading.get_ident()

    def chunk(i: int) -> bytes:
        assert threading.get_ident() == caller
        made.append(i)
        return blobs[i]

    def then(i: int, data: bytes | bytearray) -> None:
        assert i not in handed
        handed[i] = bytes(data)

    monkeypatch.setattr(lay, "PARALLEL_CHUNKS", 2)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = lay.hash_each(len(blobs), chunk, then)

        def failing(i: int, data: bytes | bytearray) -> None:
            if i == 17:
                raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space"):
            lay.hash_each(len(blobs), lambda i: blobs[i], failing)
    finally:
        torch.set_num_threads(old)
    assert made == list(range(len(blobs)))
    assert handed == dict(enumerate(blobs))
    assert got == [lay.hash_chunk([b]) for b in blobs]
