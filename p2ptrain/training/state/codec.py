"""Training state as safetensors bytes: encode, strict decode and digest.

Theory of operation
-------------------
A joining peer downloads the model and optimizer state from a donor that may be hostile, and a restarted
node reads its own checkpoints from disk. Both go through one format, safetensors: an 8-byte
little-endian header length ``N``, ``N`` bytes of JSON mapping each tensor name to its dtype, shape and
``[begin, end)`` byte range in the data section (plus an optional ``"__metadata__"`` str->str map), then
the raw little-endian tensor bytes. It carries no code, so reading it can never execute anything (no
pickle, no ``torch.load``), and it is a published format that other tools read.

:func:`decode` trusts nothing: the header length is bounded by :data:`MAX_HEADER` and the data, the JSON
is strict (no duplicate keys, no NaN literals), every entry needs a known dtype, a bounded shape and
offsets that tile the data section exactly (sorted by offset: contiguous from 0, no gap, no overlap,
ending at the last byte) with ``end - begin == numel * itemsize``. Every violation raises
:class:`StateError` (a :class:`RemoteProtocolError`) that says what is wrong. Tensors are copied out of
the buffer, so the result never aliases memory the caller reuses.

Capturing a model and its optimizers into tensors and metadata, and restoring them after a check
against the local ones, is :mod:`.capture`; this module is the byte format they travel in.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch

from ...errors import LocalProtocolError, RemoteProtocolError

if sys.byteorder != "little":  # safetensors is little-endian and encode() sends native memory as it is
    raise ImportError("p2ptrain's state format needs a little-endian host")

MAX_HEADER: int = 16 << 20
"""Largest JSON header (bytes) that :func:`decode` accepts."""

MAX_NAME: int = 512
"""Longest tensor name (characters)."""

MAX_NDIM: int = 64
"""Most dimensions a tensor may declare."""

TIED_KEY = "p2ptrain.tied"
"""``metadata[TIED_KEY]``: JSON mapping a model entry stored once to the entry it shares memory with."""

FORMAT_KEY = "p2ptrain.format"
FORMAT_VERSION = "1"
"""``metadata[FORMAT_KEY]`` written by ``capture.capture`` and required by ``capture.restore``."""

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_EMPTY: Mapping[str, Any] = MappingProxyType({})


class StateError(RemoteProtocolError):
    """State bytes are malformed, or a state does not fit the local model or optimizers."""


# ---- codec ---------------------------------------------------------------------------------------


def _check_name(name: object, error: type[Exception]) -> str:
    if not isinstance(name, str) or not name:
        raise error(f"tensor name {name!r} is not a non-empty string")
    if len(name) > MAX_NAME:
        raise error(f"tensor name {name[:40]!r}... is {len(name)} characters, over {MAX_NAME}")
    # Control and format characters (zero-width spaces, bidi overrides, lone surrogates) would let two
    # names that print alike differ, and break log lines; parameter names never need them.
    if name == "__metadata__" or not name.isprintable():
        raise error(f"tensor name {name!r} is reserved or has unprintable characters")
    return name


def _dtype_name(tensor: torch.Tensor, name: str) -> str:
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise LocalProtocolError(f"tensor {name!r} has dtype {tensor.dtype}, which the format cannot carry")
    if tensor.layout != torch.strided:
        raise LocalProtocolError(
            f"tensor {name!r} has layout {tensor.layout}; only dense tensors are carried"
        )
    return dtype_name


class Source(Protocol):
    """Tensors read from elsewhere than their memory (see ``file_tensors.FileTensors``): file-backed ones,
    whose pages reading them in place would map into the process."""

    def owns(self, t: torch.Tensor) -> bool: ...

    def read(self, t: torch.Tensor, lo: int, hi: int) -> bytes | bytearray: ...


READ_PIECE = 1 << 20
"""Bytes per read when a :class:`Source` supplies a tensor's bytes."""


def pieces_of(tensor: torch.Tensor, source: Source | None = None) -> Iterator[memoryview | bytes | bytearray]:
    """The tensor's bytes: :func:`raw_bytes` in one piece, or read through ``source`` piece by piece
    when it owns the tensor."""
    if source is None or not source.owns(tensor):
        yield raw_bytes(tensor)
        return
    nbytes = tensor.numel() * tensor.element_size()
    for lo in range(0, nbytes, READ_PIECE):
        yield source.read(tensor, lo, min(lo + READ_PIECE, nbytes))


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, zero-copy when it already is a contiguous CPU tensor.

    The memoryview keeps the tensor alive (through the NumPy array it views), so it stays valid after
    the caller drops the tensor; it reflects later in-place writes to the tensor, which is why callers
    encode snapshots (``capture.capture`` clones).
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def encode(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> list[memoryview | bytes]:
    """Encode tensors (and str->str metadata) as safetensors pieces: the header, then each tensor's bytes.

    Names are sorted, so equal inputs give equal bytes. Tensor pieces are zero-copy views of contiguous
    CPU tensors (others are copied once); send them in order without joining. Empty tensors contribute
    no piece. Raises :class:`LocalProtocolError` for names, dtypes or metadata the format cannot carry.
    """
    header: dict[str, Any] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise LocalProtocolError(f"metadata must map str to str, got {key!r}: {type(value).__name__}")
        header["__metadata__"] = dict(metadata)
    pieces: list[memoryview | bytes] = []
    offset = 0
    for name in sorted(_check_name(n, LocalProtocolError) for n in tensors):
        tensor = tensors[name]
        dtype_name = _dtype_name(tensor, name)
        raw = raw_bytes(tensor)
        header[name] = {
            "dtype": dtype_name,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
        if raw.nbytes:
            pieces.append(raw)
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"metadata is not valid Unicode: {exc}") from None
    # Pad with spaces (valid JSON whitespace) so the data section starts 8-byte aligned, as the reference
    # implementation does; readers that map the file can then view tensors in place.
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise LocalProtocolError(f"state header is {len(text)} bytes, over the {MAX_HEADER}-byte limit")
    return [struct.pack("<Q", len(text)) + text, *pieces]


def encoded_size(pieces: Iterable[memoryview | bytes]) -> int:
    """Total bytes of :func:`encode`'s pieces."""
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in pieces)


def _reject_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # a repeated name would be read differently by different parsers
            raise StateError(f"JSON object repeats the key {key[:MAX_NAME]!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise StateError(f"JSON holds the non-standard constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf without going through parse_constant
        raise StateError(f"JSON number {text[:20]} is out of the float range")
    return value


def parse_json(raw: bytes, what: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, finite numbers only; any failure is a :class:`StateError`."""
    try:
        text = raw.decode("utf-8")
        return json.loads(
            text, object_pairs_hook=_reject_pairs, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except UnicodeDecodeError as exc:
        raise StateError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise StateError(f"{what} nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and int() beyond the digit limit
        raise StateError(f"{what} is not valid JSON: {exc}") from None


def _int(value: object, what: str) -> int:
    if type(value) is not int:  # bool is an int subclass, and JSON true is not a size
        raise StateError(f"{what} is {value!r}, not an integer")
    return value


def _entry(name: str, entry: object, data_len: int) -> tuple[int, int, str, torch.dtype, list[int]]:
    """Validate one header entry; return (begin, end, name, dtype, shape)."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise StateError(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets (got {keys})")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise StateError(f"tensor {name!r}: unknown dtype {entry['dtype']!r} (known: {', '.join(DTYPES)})")
    shape = entry["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise StateError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} sizes")
    for dim in shape:
        if _int(dim, f"tensor {name!r}: a shape size") < 0 or dim >= 1 << 62:
            raise StateError(f"tensor {name!r}: shape size {dim} is out of range")
    # A zero-sized dimension makes numel 0 whatever the others are; torch still needs the product of
    # the non-zero sizes to fit in int64 to build strides.
    if math.prod(max(d, 1) for d in shape) >= 1 << 62:
        raise StateError(f"tensor {name!r}: shape {shape} is too large")
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise StateError(f"tensor {name!r}: data_offsets must be a [begin, end] pair")
    begin = _int(offsets[0], f"tensor {name!r}: data_offsets begin")
    end = _int(offsets[1], f"tensor {name!r}: data_offsets end")
    if not 0 <= begin <= end <= data_len:
        raise StateError(f"tensor {name!r}: data_offsets [{begin}, {end}] outside the {data_len}-byte data")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise StateError(
            f"tensor {name!r}: {end - begin} bytes declared, but {entry['dtype']} {shape} needs {expected}"
        )
    return begin, end, name, dtype, shape


def _header(mv: memoryview, max_tensors: int) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Parse and bound the header; return (data start, entries by name, metadata)."""
    if mv.nbytes < 8:
        raise StateError(f"state is {mv.nbytes} bytes, too short for the 8-byte header length")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > MAX_HEADER:
        raise StateError(f"header length {hlen} exceeds the {MAX_HEADER}-byte limit")
    if hlen > mv.nbytes - 8:
        raise StateError(f"header length {hlen} exceeds the {mv.nbytes - 8} bytes that follow it")
    header = parse_json(bytes(mv[8 : 8 + hlen]), "state header")
    if not isinstance(header, dict):
        raise StateError(f"state header is a JSON {type(header).__name__}, not an object")
    raw_meta = header.pop("__metadata__", None)
    if raw_meta is None:
        raw_meta = {}
    if not isinstance(raw_meta, dict) or not all(isinstance(v, str) for v in raw_meta.values()):
        raise StateError("state __metadata__ must be an object of strings")
    if len(header) > max_tensors:
        raise StateError(f"state declares {len(header)} tensors, over the limit of {max_tensors}")
    return 8 + hlen, header, raw_meta


def decode(
    data: bytes | bytearray | memoryview, *, max_tensors: int = 100_000
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Decode safetensors bytes into (tensors by name, metadata), validating everything.

    Raises :class:`StateError` for any malformed input. The tensors are fresh CPU copies.
    """
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise LocalProtocolError("decode() needs a contiguous buffer")
    mv = mv.cast("B")
    start, header, metadata = _header(mv, max_tensors)
    data_len = mv.nbytes - start
    entries = sorted(_entry(_check_name(n, StateError), e, data_len) for n, e in header.items())
    cursor = 0
    for begin, end, name, _, _ in entries:
        if begin != cursor:
            kind = "a gap" if begin > cursor else "an overlap"
            raise StateError(f"tensor {name!r} starts at byte {begin}: {kind} after byte {cursor}")
        cursor = end
    if cursor != data_len:
        raise StateError(f"data section is {data_len} bytes but the tensors cover {cursor}")
    tensors: dict[str, torch.Tensor] = {}
    for begin, end, name, dtype, shape in entries:
        tensor = torch.empty(shape, dtype=dtype)
        if end > begin:
            # A copy into a fresh (aligned, writable) tensor: the result never aliases the caller's buffer,
            # and no read-only buffer reaches torch.frombuffer (which warns about those).
            raw = tensor.reshape(-1).view(torch.uint8)
            raw.numpy().data[:] = mv[start + begin : start + end]
            if dtype == torch.bool and bool((raw > 1).any()):
                raise StateError(f"tensor {name!r}: BOOL bytes must be 0 or 1")
        tensors[name] = tensor
    return dict(sorted(tensors.items())), metadata


def digest(tensors: Mapping[str, torch.Tensor], source: Source | None = None) -> bytes:
    """BLAKE2b-256 over the sorted names, dtypes, shapes and raw bytes: equal states <=> equal digests.

    Every field is length-prefixed, so no two different states share an input stream. "Equal" is
    bitwise: 0.0 and -0.0, or two NaN payloads, differ. The tensors ``source`` owns are read through it.
    """
    h = hashlib.blake2b(digest_size=32, person=b"p2ptrain-state1")
    h.update(struct.pack("<Q", len(tensors)))
    for name in sorted(tensors):
        tensor = tensors[name]
        encoded = name.encode("utf-8", "surrogatepass")
        dtype_name = _dtype_name(tensor, name).encode()
        h.update(struct.pack("<QQ", len(encoded), len(dtype_name)) + encoded + dtype_name)
        h.update(struct.pack(f"<Q{tensor.dim()}q", tensor.dim(), *tensor.shape))
        for piece in pieces_of(tensor, source):
            h.update(piece)  # hashlib releases the GIL for large buffers
    return h.digest()


# ---- helpers shared with capture.py and the chunked layout (chunks.py) -------------------------------


def dtype_name(tensor: torch.Tensor, name: str) -> str:
    """The safetensors name of ``tensor``'s dtype; :class:`LocalProtocolError` if it has none."""
    return _dtype_name(tensor, name)


def check_name(name: object, error: type[Exception] = StateError) -> str:
    """A tensor name, checked (``error``, by default :class:`StateError`, if unusable)."""
    return _check_name(name, error)


def check_entry(name: str, entry: object, data_len: int) -> tuple[int, int, str, torch.dtype, list[int]]:
    """One header entry from the network, checked: (begin, end, name, dtype, shape)."""
    return _entry(name, entry, data_len)
