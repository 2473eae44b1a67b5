"""Checkpoints: atomic save, pruning, verified load with fallback past torn or corrupt directories."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from p2ptrain.training.state import checkpoint
from p2ptrain.training.state.checkpoint import META_FILE, STATE_FILE, latest, save
from p2ptrain.training.state.codec import digest


def state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model.w": torch.randn(16, 8, generator=g),
        "model.b": torch.randn(8, generator=g).bfloat16(),
        "model.n": torch.tensor(seed),
        "model.empty": torch.zeros(0, 3),
    }
    return tensors, {"p2ptrain.format": "1", "seed": str(seed)}


def save_steps(folder: Path, *steps: int, keep: int = 2) -> None:
    for step in steps:
        save(folder, step, *state(step), {"loss": step / 10}, keep=keep)


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_bit_identical(tmp_path: Path) -> None:
    tensors, meta = state(7)
    path = save(tmp_path / "ck", 123, tensors, meta, {"loss": 1.5, "peers": ["a", "b"], "nan": math.nan})
    assert path == tmp_path / "ck" / "step-000000123"
    assert sorted(p.name for p in path.iterdir()) == [META_FILE, STATE_FILE]
    found = latest(tmp_path / "ck")
    assert found is not None
    step, got, got_meta, info = found
    assert step == 123 and got_meta == meta
    assert digest(got) == digest(tensors) and list(got) == sorted(tensors)
    assert info["loss"] == 1.5 and info["peers"] == ["a", "b"] and math.isnan(info["nan"])


def test_latest_picks_newest_and_keep_prunes(tmp_path: Path) -> None:
    save_steps(tmp_path, 1, 2, 3)
    assert names(tmp_path) == ["step-000000002", "step-000000003"]
    found = latest(tmp_path)
    assert found is not None and found[0] == 3 and found[3] == {"loss": 0.3}
    save_steps(tmp_path, 4, keep=1)
    assert names(tmp_path) == ["step-000000004"]
    save_steps(tmp_path, 5, 6, 7, keep=3)
    assert names(tmp_path) == ["step-000000005", "step-000000006", "step-000000007"]


def test_newer_checkpoints_are_kept_when_an_older_step_is_saved(tmp_path: Path, caplog: Any) -> None:
    save_steps(tmp_path, 5, 6)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        save_steps(tmp_path, 3, keep=1)
    assert names(tmp_path) == ["step-000000003", "step-000000005", "step-000000006"]
    assert "step-000000006" in caplog.text


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 4, *state(1), {"v": 1})
    save(tmp_path, 4, *state(2), {"v": 2})
    found = latest(tmp_path)
    assert found is not None and found[3] == {"v": 2} and digest(found[1]) == digest(state(2)[0])
    assert names(tmp_path) == ["step-000000004"]


def test_empty_or_missing_folder_gives_none(tmp_path: Path) -> None:
    assert latest(tmp_path / "missing") is None
    assert latest(tmp_path) is None
    (tmp_path / "notes.txt").write_text("unrelated")
    (tmp_path / "step-12").mkdir()  # not our name pattern
    assert latest(tmp_path) is None


def test_crash_mid_write_leaves_previous_checkpoint_and_is_cleaned_up(tmp_path: Path) -> None:
    save_steps(tmp_path, 1, 2)
    # A crash before the rename leaves only a temporary directory with partial content.
    leftover = tmp_path / ".tmp-step-000000003-dead"
    leftover.mkdir()
    (leftover / STATE_FILE).write_bytes(b"\x10\x00\x00")
    found = latest(tmp_path)
    assert found is not None and found[0] == 2
    save_steps(tmp_path, 3)
    assert names(tmp_path) == ["step-000000002", "step-000000003"]


def test_failed_save_leaves_nothing_behind(tmp_path: Path, monkeypatch: Any) -> None:
    save_steps(tmp_path, 1)

    def broken_rename(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "rename", broken_rename)
    with pytest.raises(OSError, match="disk full"):
        save_steps(tmp_path, 2)
    monkeypatch.undo()
    assert names(tmp_path) == ["step-000000001"]


def test_failed_replacement_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch: Any) -> None:
    save_steps(tmp_path, 1)
    real = os.rename

    def rename_fails_into_place(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-step-"):
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", rename_fails_into_place)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 1, *state(2), {"v": 2})
    monkeypatch.undo()
    assert names(tmp_path) == ["step-000000001"]
    found = latest(tmp_path)
    assert found is not None and digest(found[1]) == digest(state(1)[0])


def corrupt_truncate(path: Path) -> None:
    data = (path / STATE_FILE).read_bytes()
    (path / STATE_FILE).write_bytes(data[: len(data) // 2])


def corrupt_flip(path: Path) -> None:
    data = bytearray((path / STATE_FILE).read_bytes())
    data[-3] ^= 0x40
    (path / STATE_FILE).write_bytes(bytes(data))


def corrupt_header_and_hash(path: Path) -> None:
    """A state file that fails to decode, with a matching recorded hash (the decoder is the last guard)."""
    (path / STATE_FILE).write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]" + b"\x00" * 6)
    file_hash = hashlib.blake2b((path / STATE_FILE).read_bytes(), digest_size=32).hexdigest()
    rewrite_meta(path, file_size=16, file_blake2b=file_hash)


def corrupt_digest(path: Path) -> None:
    rewrite_meta(path, digest="0" * 64)


def rewrite_meta(path: Path, **changes: Any) -> None:
    meta = json.loads((path / META_FILE).read_text())
    meta.update(changes)
    (path / META_FILE).write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncated state": corrupt_truncate,
    "flipped bit": corrupt_flip,
    "undecodable state": corrupt_header_and_hash,
    "digest mismatch": corrupt_digest,
    "missing state": lambda p: (p / STATE_FILE).unlink(),
    "missing meta": lambda p: (p / META_FILE).unlink(),
    "empty meta": lambda p: (p / META_FILE).write_bytes(b""),
    "meta not json": lambda p: (p / META_FILE).write_bytes(b"\xff{"),
    "meta is a list": lambda p: (p / META_FILE).write_text("[]"),
    "meta wrong step": lambda p: rewrite_meta(p, step=3),
    "meta step bool": lambda p: rewrite_meta(p, step=True),
    "meta bad size": lambda p: rewrite_meta(p, file_size="big"),
    "meta bad hash": lambda p: rewrite_meta(p, file_blake2b="xyz"),
    "meta no info": lambda p: rewrite_meta(p, info=[]),
    "meta other format": lambda p: rewrite_meta(p, format="other"),
    "state is a directory": lambda p: ((p / STATE_FILE).unlink(), (p / STATE_FILE).mkdir()),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, corrupt: Any, caplog: Any) -> None:
    save_steps(tmp_path, 1, 2)
    corrupt(tmp_path / "step-000000002")
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        found = latest(tmp_path)
    assert found is not None and found[0] == 1 and digest(found[1]) == digest(state(1)[0])
    assert "step-000000002 is unusable" in caplog.text


def test_all_corrupt_gives_none_with_an_error(tmp_path: Path, caplog: Any) -> None:
    save_steps(tmp_path, 1, 2)
    for path in tmp_path.iterdir():
        corrupt_flip(path)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert latest(tmp_path) is None
    assert "none of the 2 checkpoints" in caplog.text


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: Any) -> None:
    save_steps(tmp_path, 1)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("unpickling during checkpoint load")

    for module, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(module, name, forbidden)
    found = latest(tmp_path)
    assert found is not None and found[0] == 1


def test_save_fsyncs_files_and_directories(tmp_path: Path, monkeypatch: Any) -> None:
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording)
    save(tmp_path, 9, *state(9), {})
    files, tmp_dir, folder = [Path(p) for p in synced[:2]], Path(synced[2]), synced[3]
    assert len(synced) == 4
    assert sorted(f.name for f in files) == [META_FILE, STATE_FILE] and {f.parent for f in files} == {tmp_dir}
    assert tmp_dir.name.startswith(".tmp-step-000000009")  # contents durable before the rename ...
    assert folder == str(tmp_path)  # ... and the rename itself made durable after it


def test_file_modes(tmp_path: Path) -> None:
    path = save(tmp_path, 1, *state(1), {})
    for file in (path / STATE_FILE, path / META_FILE):
        mode = stat.S_IMODE(file.stat().st_mode)
        assert mode & 0o600 == 0o600 and mode & 0o022 == 0 and mode & 0o111 == 0, oct(mode)
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0


@pytest.mark.parametrize(
    ("step", "keep", "info", "match"),
    [
        (-1, 2, {}, "step"),
        (True, 2, {}, "step"),
        (1.0, 2, {}, "step"),
        (1, 0, {}, "keep"),
        (1, 2, {"x": object()}, "JSON"),
    ],
)
def test_save_rejects_bad_arguments(tmp_path: Path, step: Any, keep: int, info: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        save(tmp_path, step, *state(1), info, keep=keep)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("step-")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
