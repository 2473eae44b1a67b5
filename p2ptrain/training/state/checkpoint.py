"""Checkpoints on disk: one directory per step, written atomically, verified when read.

Theory of operation
-------------------
:func:`save` writes ``folder/.tmp-step-000000123-<random>/`` holding ``state.safetensors`` (the
:mod:`~p2ptrain.training.state.codec` encoding) and ``meta.json`` (format, step, the file's size and BLAKE2b
hash, the state digest, the caller's info), fsyncs both files and that directory, renames it to
``folder/step-000000123``, and fsyncs ``folder`` so the rename itself is durable. A crash therefore
leaves either a complete ``step-*`` directory or none plus a ``.tmp-*`` leftover, which the next save
removes. Only then are older checkpoints pruned, newest ``keep`` kept.

:func:`latest` tries the step directories newest first. One that is incomplete or corrupt (missing
file, wrong size, hash mismatch: a disk that lied about fsync, a copy cut short, bit rot) is logged and
skipped for the next older one. Reading never unpickles: the state goes through the strict decoder and
its digest is checked against the one recorded when it was saved.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import P2PError
from . import codec

log = logging.getLogger(__name__)

FORMAT = "p2ptrain-checkpoint-1"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
MAX_META = 16 << 20
"""Largest ``meta.json`` that :func:`latest` reads."""

_STEP_DIR = re.compile(r"step-([0-9]{9,18})")
_TMP_PREFIX = ".tmp-"
_HEX64 = re.compile(r"[0-9a-f]{64}")

Checkpoint = tuple[int, dict[str, torch.Tensor], dict[str, str], dict[str, Any]]
"""(step, tensors, metadata, info) as :func:`latest` returns them."""


class CheckpointCorrupt(P2PError):
    """A checkpoint directory is incomplete or does not verify."""


# ---- writing -------------------------------------------------------------------------------------


def _write_file(path: Path, pieces: Iterable[memoryview | bytes | bytearray]) -> tuple[int, str]:
    """Write, flush and fsync a new file; return its size and BLAKE2b-256 hex digest."""
    h = hashlib.blake2b(digest_size=32)
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:
        for piece in pieces:
            f.write(piece)
            h.update(piece)
            size += piece.nbytes if isinstance(piece, memoryview) else len(piece)
        f.flush()
        os.fsync(f.fileno())
    return size, h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Remove a directory: renamed to a temporary name first, so it never lies there half deleted."""
    doomed = path.with_name(f"{_TMP_PREFIX}discard-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_temps(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir() and not entry.is_symlink():
            log.info("removing %s, left over from an interrupted checkpoint", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """Step directories (by name; not verified), newest first."""
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            match = _STEP_DIR.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found, reverse=True)


def _prune(folder: Path, saved: int, keep: int) -> None:
    # Only checkpoints older than the one just saved count: a newer one (left by a run that went further
    # before it was restarted from an older checkpoint) is not ours to judge, so it is kept and reported.
    dirs = _step_dirs(folder)
    newer = [path.name for step, path in dirs if step > saved]
    if newer:
        log.warning("checkpoints newer than step %d remain in %s: %s", saved, folder, ", ".join(newer))
    for _, path in [d for d in dirs if d[0] < saved][keep - 1 :]:
        log.debug("pruning checkpoint %s", path)
        _discard(path)


def save(
    folder: Path,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    info: Mapping[str, Any],
    *,
    keep: int = 2,
    source: codec.Source | None = None,
) -> Path:
    """Write ``folder/step-<step>`` atomically and durably, then prune to the newest ``keep``; return it.

    ``info`` must be JSON-serializable. Saving a step that already exists replaces it. One writer per
    folder: a save removes the temporary directories it finds there as crash leftovers. Raises
    :class:`ValueError` for a bad step, keep or info; :class:`OSError` from the filesystem. The tensors
    ``source`` owns are read through it (file-backed ones: see ``file_tensors``).
    """
    if type(step) is not int or not 0 <= step < 10**18:
        raise ValueError(f"checkpoint step must be an int in [0, 1e18), got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(folder)
    encoded = codec.encode(tensors, metadata)  # before touching the disk: bad names or dtypes raise here
    # encode's pieces: the header, then each non-empty tensor's bytes in name order
    streamed = (codec.pieces_of(tensors[n], source) for n in sorted(tensors) if tensors[n].numel())
    pieces = itertools.chain(encoded[:1], itertools.chain.from_iterable(streamed))
    meta: dict[str, Any] = {"format": FORMAT, "step": step, "digest": codec.digest(tensors, source).hex()}
    try:
        json.dumps(dict(info))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint info is not JSON-serializable: {exc}") from None
    final = folder / f"step-{step:09d}"
    tmp = folder / f"{_TMP_PREFIX}step-{step:09d}-{secrets.token_hex(6)}"
    tmp.mkdir(mode=0o755)
    displaced = None
    try:
        meta["file_size"], meta["file_blake2b"] = _write_file(tmp / STATE_FILE, pieces)
        meta["info"] = dict(info)
        _write_file(tmp / META_FILE, [json.dumps(meta, indent=1, sort_keys=True).encode() + b"\n"])
        _fsync_dir(tmp)
        if final.exists():  # a directory cannot be renamed over a non-empty one: move the old one aside
            displaced = folder / f"{_TMP_PREFIX}discard-{secrets.token_hex(6)}"
            os.rename(final, displaced)
        os.rename(tmp, final)
    except BaseException:
        if displaced is not None and not final.exists():
            os.rename(displaced, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(folder)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
    _prune(folder, step, keep)
    return final


# ---- reading -------------------------------------------------------------------------------------


def _read_meta(path: Path, step: int) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(MAX_META + 1)
    if len(raw) > MAX_META:
        raise CheckpointCorrupt(f"{META_FILE} is larger than {MAX_META} bytes")
    try:
        meta = json.loads(raw.decode("utf-8"))  # written by save(); NaN in the caller's info is allowed
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{META_FILE} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{META_FILE} is not a {FORMAT} record")
    if meta.get("step") != step or type(meta.get("step")) is not int:
        raise CheckpointCorrupt(f"{META_FILE} records step {meta.get('step')!r}, the directory says {step}")
    for key in ("digest", "file_blake2b"):
        if not isinstance(meta.get(key), str) or not _HEX64.fullmatch(meta[key]):
            raise CheckpointCorrupt(f"{META_FILE} has no valid {key}")
    if type(meta.get("file_size")) is not int or meta["file_size"] < 8:
        raise CheckpointCorrupt(f"{META_FILE} has no valid file_size")
    if not isinstance(meta.get("info"), dict):
        raise CheckpointCorrupt(f"{META_FILE} has no info object")
    return meta


def _read_state(path: Path, meta: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != meta["file_size"]:
            raise CheckpointCorrupt(f"{STATE_FILE} is {size} bytes, {META_FILE} says {meta['file_size']}")
        # Mapped rather than read: the page cache holds the bytes while decode() copies them into
        # tensors, instead of a second full copy of the state in process memory.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        with memoryview(mapped) as view:
            if hashlib.blake2b(view, digest_size=32).hexdigest() != meta["file_blake2b"]:
                raise CheckpointCorrupt(f"{STATE_FILE} does not match the hash in {META_FILE}")
            return codec.decode(view)
    finally:
        # A view can outlive this frame in a traceback; the map then closes when that view goes.
        with contextlib.suppress(BufferError):
            mapped.close()


def _load(path: Path, step: int) -> Checkpoint:
    meta = _read_meta(path / META_FILE, step)
    tensors, metadata = _read_state(path / STATE_FILE, meta)
    if codec.digest(tensors).hex() != meta["digest"]:
        raise CheckpointCorrupt("decoded state does not match the digest recorded when it was saved")
    return step, tensors, metadata, meta["info"]


def latest(folder: Path) -> Checkpoint | None:
    """The newest checkpoint in ``folder`` that verifies, as (step, tensors, metadata, info).

    Unusable newer checkpoints are skipped with a warning. None when the folder is missing or holds no
    usable checkpoint.
    """
    try:
        candidates = _step_dirs(Path(folder))
    except FileNotFoundError:
        return None
    for step, path in candidates:
        try:
            return _load(path, step)
        except (P2PError, OSError) as exc:
            log.warning("checkpoint %s is unusable (%s); trying an older one", path, exc)
    if candidates:
        log.error("none of the %d checkpoints in %s verifies", len(candidates), folder)
    return None
