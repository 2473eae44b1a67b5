"""File-backed tensors (``training.state.file_tensors``): ordinary tensors whose pages can leave the
resident set.

What is proved here: the tensors start as zeros with the shapes and dtypes asked for, each on its own
pages; ``read`` gives exactly the bytes the tensor holds (including writes made through the mapping);
``release`` drops the pages from this process's resident set (read from ``/proc/self/smaps``) and keeps
every value; ``owns`` recognizes the tensors and views into them, and nothing else.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from p2ptrain.training.state import checkpoint, codec
from p2ptrain.training.state.file_tensors import PAGE, FileTensors

SMAPS = Path("/proc/self/smaps")


def resident_bytes(t: torch.Tensor) -> int:
    """Rss of the mapping that holds ``t``, from ``/proc/self/smaps``."""
    addr = t.data_ptr()
    found = None
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= addr < hi
        elif found and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def like() -> list[torch.Tensor]:
    return [torch.empty(3, 5), torch.empty(1000, 257), torch.empty(7, dtype=torch.float16)]


def test_tensors_start_as_zeros_shaped_like_the_originals_each_on_its_own_pages() -> None:
    ft = FileTensors(like())
    for t, ref in zip(ft.tensors, like(), strict=True):
        assert t.shape == ref.shape and t.dtype == ref.dtype and not t.any()
        assert (t.data_ptr() - ft.tensors[0].data_ptr()) % PAGE == 0


def test_read_gives_the_bytes_written_through_the_mapping() -> None:
    ft = FileTensors(like())
    g = torch.Generator().manual_seed(1)
    for t in ft.tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    for t in ft.tensors:
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert ft.read(t, 0, len(raw)) == raw
        assert ft.read(t, 3, len(raw) - 1) == raw[3:-1]
    view = ft.tensors[1][10:20]
    assert ft.owns(view) and ft.read(view, 0, 8) == view.reshape(-1).view(torch.uint8).numpy().tobytes()[:8]
    with pytest.raises(ValueError, match="not bytes"):
        ft.read(ft.tensors[0], 0, 10**6)


def test_owns_only_its_own_tensors() -> None:
    ft, other = FileTensors(like()), FileTensors(like())
    assert all(ft.owns(t) for t in ft.tensors)
    assert not any(ft.owns(t) for t in other.tensors)
    assert not ft.owns(torch.zeros(3, 5))
    assert not ft.owns(ft.tensors[1].t())  # (not contiguous: not read as a byte range)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not SMAPS.exists(), reason="needs /proc")
def test_release_drops_the_pages_from_the_resident_set_and_keeps_the_values() -> None:
    ft = FileTensors([torch.empty(1 << 20), torch.empty(1 << 20)])
    a, b = ft.tensors
    a.fill_(1.5)
    b.copy_(torch.arange(1 << 20, dtype=torch.float32))
    assert resident_bytes(a) >= 2 * a.numel() * 4  # both written: both mapped in
    ft.release([a])
    assert a.numel() * 4 <= resident_bytes(a) < a.numel() * 4 + 2 * PAGE  # only b's pages (and a's edge)
    ft.release()
    assert resident_bytes(a) == 0
    assert ft.read(a, 0, 8) == torch.tensor([1.5, 1.5]).numpy().tobytes()  # from the page cache
    assert resident_bytes(a) == 0  # reading did not map anything in
    assert bool((a == 1.5).all()) and torch.equal(b, torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not SMAPS.exists(), reason="needs /proc")
def test_a_checkpoint_reads_file_backed_tensors_from_the_file_and_writes_the_same_bytes(
    tmp_path: Path,
) -> None:
    ft = FileTensors([torch.empty(300_000), torch.empty(5, 7)])
    ft.tensors[0].copy_(torch.linspace(-1, 1, 300_000))
    ft.tensors[1].fill_(3.0)
    tensors = {"model.w": ft.tensors[0], "optim.x.0.momentum_buffer": ft.tensors[1], "model.b": torch.ones(4)}
    ft.release()
    via_source = checkpoint.save(tmp_path / "a", 3, tensors, {"k": "v"}, {}, source=ft)
    assert resident_bytes(ft.tensors[0]) == 0  # written without mapping a page in
    in_place = checkpoint.save(tmp_path / "b", 3, tensors, {"k": "v"}, {})
    assert (via_source / checkpoint.STATE_FILE).read_bytes() == (
        in_place / checkpoint.STATE_FILE
    ).read_bytes()
    assert codec.digest(tensors, ft) == codec.digest(tensors)
    step, loaded, meta, _ = checkpoint.latest(tmp_path / "a")  # type: ignore[misc]
    assert step == 3 and meta["k"] == "v" and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
