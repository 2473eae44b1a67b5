"""The built-in task: a byte-level GPT trained on the Python standard library's own source files.

Theory of operation: every Python install ships megabytes of well-formed text, its standard library's
``.py`` sources, so the default task needs no download and no data set to agree on. The corpus is read
once per process (``load_corpus`` is cached, so several in-process peers share one copy) and kept in
memory as two uint8 tensors, one for training and one for validation.

The split must come out the same on every peer. Files are taken in sorted relative-path order, and a
file goes to validation when a keyed blake2b hash of its relative POSIX path falls below
``val_fraction``: a property of the file's name alone, not of the order of a directory listing, nor of
Python's per-process salted ``hash()``, nor of which other files happen to be installed. Directories that
distributions ship as separate packages (the test suites, IDLE, tkinter, ...) and that newer Pythons
removed (distutils, lib2to3) are skipped, so a Debian python3 and a python.org build read the same files.
Peers whose Python versions differ still read different bytes; ``Task.info["data_fingerprint"]`` (a hash
of the validation bytes) lets them notice.

Training batches are random windows of ``block_size + 1`` bytes drawn with a generator seeded by the
peer's seed (different peers, different data); validation windows sit at fixed, evenly spaced offsets of
the validation bytes, so every peer scores the same sequences.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .gpt import GPT, GPTConfig
from .task import Task

log = logging.getLogger(__name__)

#: Directory names skipped anywhere in the tree: installed third-party packages, bytecode caches, and
#: test suites (Debian and others move them to a separate package, so many installs lack them).
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
#: Top-level directories skipped: shipped separately by distributions, or removed in newer Pythons.
SKIP_TOP_DIRS = frozenset({"idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip"})
SEPARATOR = b"\n"
_SPLIT_KEY = b"p2ptrain.split"  # keys the split hash, so it is ours and not any other blake2b use


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes, and the files they came from. Shared: never modify the tensors."""

    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    train_files: tuple[str, ...]  # relative POSIX paths, in the order they were concatenated
    val_files: tuple[str, ...]
    fingerprint: str  # blake2b of the validation bytes, 8 bytes in hex


def stdlib_root() -> Path:
    """Where this interpreter's standard library sources live."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """Every ``*.py`` file under ``root`` (minus the skipped directories), as sorted relative POSIX paths."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        top = rel_dir == Path(".")
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not (top and d in SKIP_TOP_DIRS)]
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def is_validation(rel_path: str, val_fraction: float) -> bool:
    """Whether the file at ``rel_path`` belongs to the validation split (a pure function of its name)."""
    digest = hashlib.blake2b(rel_path.encode("utf-8"), digest_size=8, key=_SPLIT_KEY).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2**64


@functools.lru_cache(maxsize=8)
def load_corpus(max_bytes: int, val_fraction: float, val_bytes: int, root: Path | None = None) -> Corpus:
    """Read up to ``max_bytes`` of training and ``val_bytes`` of validation text from ``root``.

    ``root`` defaults to the standard library. Files are joined with a newline; each split stops at its
    byte budget (the last file is cut), and reading stops once both are full. Cached per process.
    """
    root = stdlib_root() if root is None else root
    start = time.perf_counter()
    caps = {True: val_bytes, False: max_bytes}
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    files: dict[bool, list[str]] = {True: [], False: []}
    sizes = {True: 0, False: 0}
    for rel in list_sources(root):
        if sizes[True] >= caps[True] and sizes[False] >= caps[False]:
            break
        val = is_validation(rel, val_fraction)
        if sizes[val] >= caps[val]:
            continue
        try:
            data = (root / rel).read_bytes()
        except OSError as exc:  # an unreadable file is left out, as if it were not installed
            log.debug("skipping %s: %s", rel, exc)
            continue
        parts[val].append(data)
        files[val].append(rel)
        sizes[val] += len(data) + len(SEPARATOR)
    train = SEPARATOR.join(parts[False])[:max_bytes]
    valid = SEPARATOR.join(parts[True])[:val_bytes]
    log.debug(
        "read %d training and %d validation bytes from %s in %.3f s",
        len(train),
        len(valid),
        root,
        time.perf_counter() - start,
    )
    return Corpus(
        train=_as_tensor(train),
        val=_as_tensor(valid),
        train_files=tuple(files[False]),
        val_files=tuple(files[True]),
        fingerprint=hashlib.blake2b(valid, digest_size=8).hexdigest(),
    )


def _as_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer over a private bytearray: no per-byte conversion, and a writable buffer (torch warns
    # about read-only ones).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def random_windows(
    data: torch.Tensor, block_size: int, seed: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (x, y) int64 batches of shape (batch_size, block_size): random windows, y = x shifted."""
    _check_batch_size(batch_size)
    if len(data) < block_size + 1:
        raise ConfigError(f"{len(data)} bytes of data cannot hold one window of {block_size + 1} bytes")
    gen = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any int seed, even negative
    return _random_windows(data, block_size, gen, batch_size)


def _random_windows(
    data: torch.Tensor, block_size: int, gen: torch.Generator, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    span = torch.arange(block_size)
    n_starts = len(data) - block_size  # a window of block_size + 1 bytes fits at [0, n_starts)
    while True:
        idx = torch.randint(0, n_starts, (batch_size, 1), generator=gen) + span
        # Two gathers rather than slicing one (B, T+1) window, so x and y come out contiguous.
        yield data[idx].long(), data[idx + 1].long()


def fixed_windows(
    data: torch.Tensor, block_size: int, count: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` windows at evenly spaced offsets of ``data``, as (x, y) batches of ``batch_size``."""
    _check_batch_size(batch_size)
    last_start = len(data) - block_size - 1
    if last_start < 0:
        raise ConfigError(f"{len(data)} bytes of data cannot hold one window of {block_size + 1} bytes")
    offsets = torch.arange(count) * last_start // max(count - 1, 1)
    idx = offsets[:, None] + torch.arange(block_size)
    x, y = data[idx].long(), data[idx + 1].long()
    # A list, not a generator: a caller may iterate it twice and must see the same batches both times.
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, count, batch_size)]


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError(f"batch_size must be a positive integer, not {batch_size!r}")


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy of the model's next-byte predictions."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"tiny-gpt option {name} must be a positive integer, not {value!r}")
    return value


def _fraction(name: str, value: object, *, low_open: bool) -> float:
    interval = "(0, 1)" if low_open else "[0, 1)"
    problem = ConfigError(f"tiny-gpt option {name} must be a number in {interval}, not {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise problem
    v = float(value)
    if not (0.0 < v < 1.0 if low_open else 0.0 <= v < 1.0):  # NaN fails both
        raise problem
    return v


def gpt_initial_values(model: torch.nn.Module) -> Iterator[tuple[str, Callable[[torch.Tensor], object]]]:
    """The task's ``initial_values``: the GPT's own (see :meth:`GPT.initial_values`)."""
    if not isinstance(model, GPT):
        raise TypeError(f"tiny-gpt's initial values are a GPT's, not a {type(model).__name__}'s")
    return model.initial_values()


def gpt_task(
    *,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    block_size: int = 128,
    dropout: float = 0.0,
    max_bytes: int = 4_000_000,
    val_fraction: float = 0.05,
    val_sequences: int = 64,
) -> Task:
    """The built-in ``tiny-gpt`` task: a byte-level GPT on the standard library's sources.

    Args:
        n_layer: Transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: The model's width.
        block_size: Bytes of context.
        dropout: Dropout probability, in [0, 1).
        max_bytes: Caps the training text.
        val_fraction: The validation text is about ``2 * val_fraction * max_bytes`` bytes.
        val_sequences: Fixed windows of the validation text that are scored.

    Returns:
        The task: model, batches (``(x, y)`` windows of bytes, ``y`` shifted by one), loss and
        validation.

    Raises:
        p2ptrain.errors.ConfigError: An option has a bad value.
    """
    for name, value in (
        ("n_layer", n_layer),
        ("n_head", n_head),
        ("n_embd", n_embd),
        ("block_size", block_size),
        ("max_bytes", max_bytes),
        ("val_sequences", val_sequences),
    ):
        _positive_int(name, value)
    if n_embd % n_head:
        raise ConfigError(f"tiny-gpt option n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    config = GPTConfig(
        block_size=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=_fraction("dropout", dropout, low_open=False),
    )
    val_fraction = _fraction("val_fraction", val_fraction, low_open=True)
    # Enough validation text for val_sequences disjoint windows even when max_bytes is small.
    val_bytes = max(round(2 * val_fraction * max_bytes), val_sequences * (block_size + 1))
    corpus = load_corpus(max_bytes, val_fraction, val_bytes)
    for split, data in (("training", corpus.train), ("validation", corpus.val)):
        if len(data) < block_size + 1:
            raise ConfigError(
                f"the {split} text read from {stdlib_root()} has {len(data)} bytes, fewer than one window "
                f"of block_size + 1 = {block_size + 1}; raise max_bytes or lower block_size"
            )

    def batches(seed: int, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return random_windows(corpus.train, block_size, seed, batch_size)

    def validation(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return fixed_windows(corpus.val, block_size, val_sequences, batch_size)

    info: dict[str, str | int | float] = {
        "model": f"GPT {n_layer} layers x {n_embd} wide, {n_head} heads, context {block_size} bytes",
        "parameters": config.num_parameters(),
        "corpus": f"Python {platform.python_version()} standard library sources",
        "train_bytes": len(corpus.train),
        "train_files": len(corpus.train_files),
        "val_bytes": len(corpus.val),
        "val_files": len(corpus.val_files),
        "val_sequences": val_sequences,
        "data_fingerprint": corpus.fingerprint,
    }
    return Task(
        name="tiny-gpt",
        model=functools.partial(GPT, config),
        batches=batches,
        loss=lm_loss,
        validation=validation,
        info=info,
        initial_values=gpt_initial_values,
    )
