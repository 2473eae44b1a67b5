"""Where a site's snapshot files go, and what a crash left there: a hash's file is unlinked as soon as
it is written, so one found at start is a crash's, and may be the size of the state; nothing else in the
data folder is touched."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.training.site.node import snapshot_folder
from p2ptrain.training.site.peer import SNAPSHOT_PREFIX


def test_no_data_folder_means_the_systems_temporary_folder() -> None:
    assert snapshot_folder(None) is None


def test_files_a_crash_left_are_removed_and_nothing_else(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    snapshots = checkpoints / "site" / "snapshots"
    snapshots.mkdir(parents=True)
    left = [snapshots / f"{SNAPSHOT_PREFIX}{k}" for k in ("a1b2", "zz")]
    for f in left:
        f.write_bytes(b"x" * 4096)
    other = snapshots / "notes.txt"
    other.write_text("kept")
    step = checkpoints / "site" / "step-3"
    step.mkdir()
    (step / "DONE").write_text("")
    assert snapshot_folder(checkpoints / "site") == str(snapshots)
    assert not any(f.exists() for f in left)
    assert other.read_text() == "kept" and (step / "DONE").is_file()


def test_a_folder_not_made_yet_is_named_all_the_same(tmp_path: Path) -> None:
    site = tmp_path / "checkpoints" / "site"
    assert snapshot_folder(site) == str(tmp_path / "checkpoints" / "site" / "snapshots")
