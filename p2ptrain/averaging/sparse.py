"""Top-k sparse encodings of flat float32 slices: what a member sends, and the reduced sum it gets back.

Theory of operation
-------------------
A slice is cut into blocks of :data:`BLOCK` elements (the last one may be shorter), counted from the
slice's start. Partitions of a sparse round start on multiples of BLOCK (see ``partition_sizes``), so a
block of a slice is a block of the whole flattened vector: a member that compressed its whole vector
before the round (:func:`roundtrip`) sends exactly those values, and knows what it sent.

**Contribution** (``density`` d, ``bits`` b): each block of ``L`` elements keeps ``k = ceil(d * L)``
slots. A slot is an element index within the block and a b-bit level. The block's scale ``s`` is the
largest magnitude it keeps; a level ``q`` in ``[0, 2**b)`` stands for ``s * (2q - (2**b - 1)) /
(2**b - 1)``: evenly spaced, symmetric, zero excluded (a kept value is never zero). Zeros are never kept:
a block with fewer than k non-zeros fills its last slots with the index ``EMPTY`` and level 0. Kept
indices increase strictly, so a slice has one encoding for a given choice of values. Wire layout of a
chunk: the blocks' float32 scales, then all slots' uint16 indices, then all levels packed ``8 / b`` to a
byte, low bits first. Re-encoding a decoded contribution gives the same bytes (the same non-zeros, the
same scale, the same levels): compressing before the round loses nothing more in it.

**Sum** (for a group of ``members``): a block keeps ``min(L, members * k)`` slots, enough for every
non-zero that ``members`` contributions can hold. A block's used slots come first: their indices
increase strictly, a block's count says how many there are, and unused slots are all zero bits. Each
value is an 8-bit float (e4m3) of the value over the block's scale ``s`` (the largest magnitude it
keeps) times 448, e4m3's largest, so a value carries about two significant digits whatever its size
(the members' 2- or 4-bit levels carry less). Wire layout of a chunk: the blocks' float32 scales, their
uint16 counts, all slots' indices at 12 bits each (two in three bytes, low bits first, the last half
byte zero when the count is odd), then all slots' codes. 2.5 bytes a slot, against 4 for a 16-bit index
and a bfloat16 value. The reducer encodes its result once and serves those bytes, so every member
decodes the same values. If there are more non-zeros than slots (a member that averages dense values
in a sparse round, the reducer's own included), the largest magnitudes are kept, ties by index.

Decoding treats the bytes as hostile: wrong lengths, indices out of range, out of order or repeated,
empty slots with a level, negative or non-finite scales and non-finite values raise
:class:`RemoteProtocolError`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import RemoteProtocolError

BLOCK: int = 4096
"""Elements per sparse block (indices fit 16 bits)."""
EMPTY: int = 0xFFFF
"""The index of an unused slot."""

FP8_TOP: float = 448.0
"""The largest e4m3 value: a sum's block scale maps to it."""
_FP8_NAN = (0x7F, 0xFF)


def kept(density: float, length: int) -> int:
    """Slots of a contribution's block of ``length`` elements."""
    return min(length, max(1, math.ceil(density * length))) if length else 0


def _blocks(count: int) -> list[int]:
    full, rest = divmod(count, BLOCK)
    return [BLOCK] * full + ([rest] if rest else [])


def contribution_size(density: float, bits: int, count: int) -> int:
    """The exact byte size of a contribution of ``count`` elements."""
    lengths = _blocks(count)
    slots = sum(kept(density, n) for n in lengths)
    return 4 * len(lengths) + 2 * slots + -(-slots * bits // 8)


def sum_slots(density: float, members: int, length: int) -> int:
    return min(length, members * kept(density, length))


def sum_size(density: float, members: int, count: int) -> int:
    """The exact byte size of a group's reduced sum of ``count`` elements."""
    lengths = _blocks(count)
    slots = sum(sum_slots(density, members, n) for n in lengths)
    return 6 * len(lengths) + (3 * slots + 1) // 2 + slots


def _levels(bits: int) -> torch.Tensor:
    top = (1 << bits) - 1
    return torch.div(torch.arange(0, top + 1, dtype=torch.float32) * 2 - top, float(top))


def _slots(x: torch.Tensor, k: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` (rows of ``length``): the ``k`` indices of the largest non-zero magnitudes (ties:
    lower index), ascending, then EMPTY; and the values there (0 for EMPTY)."""
    key = x.abs()
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    picked = torch.gather(x, 1, order)
    idx = torch.where(picked != 0, order, EMPTY)
    idx = torch.sort(idx, dim=1).values
    safe = torch.where(idx == EMPTY, 0, idx)
    values = torch.where(idx == EMPTY, 0.0, torch.gather(x, 1, safe))
    return idx, values


def _rows(x: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """``x`` as 2-D views of whole blocks, then the short last block (if any)."""
    full = x.numel() // BLOCK * BLOCK
    parts = [(x[:full].view(-1, BLOCK), BLOCK)] if full else []
    return parts + ([(x[full:].view(1, -1), x.numel() - full)] if full < x.numel() else [])


def encode_contribution(x: torch.Tensor, density: float, bits: int) -> bytes:
    if x.numel() and not math.isfinite(float(x.abs().max())):
        raise ValueError("cannot encode a tensor that holds NaN or infinite values")
    scales, indices, codes = [], [], []
    top = (1 << bits) - 1
    for rows, length in _rows(x):
        idx, values = _slots(rows, kept(density, length), length)
        scale = values.abs().amax(dim=1)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.div(values, divisor[:, None]).mul_(top).add_(top).div_(2).round_().clamp_(0, top)
        q = torch.where(idx == EMPTY, 0, q.to(torch.int64))
        scales.append(scale)
        indices.append(idx.reshape(-1))
        codes.append(q.reshape(-1))
    if not scales:
        return b""
    packed = _pack(torch.cat(codes).to(torch.uint8).numpy(), bits)
    return (
        torch.cat(scales).numpy().astype("<f4").tobytes()
        + torch.cat(indices).numpy().astype("<u2").tobytes()
        + packed
    )


def _pack(codes: np.ndarray, bits: int) -> bytes:
    per = 8 // bits
    padded = np.zeros(-(-codes.size // per) * per, dtype=np.uint8)
    padded[: codes.size] = codes
    lanes = padded.reshape(-1, per)
    out = np.zeros(lanes.shape[0], dtype=np.uint8)
    for lane in range(per):
        out |= lanes[:, lane] << np.uint8(lane * bits)
    return out.tobytes()


def _unpack(raw: np.ndarray, bits: int, count: int) -> np.ndarray:
    per, mask = 8 // bits, (1 << bits) - 1
    lanes = np.stack([(raw >> np.uint8(lane * bits)) & np.uint8(mask) for lane in range(per)], axis=1)
    flat = lanes.reshape(-1)
    if flat[count:].any():
        raise RemoteProtocolError("a sparse chunk has bits set past its last level")
    return flat[:count]


def _check_indices(idx: torch.Tensor, length: int) -> torch.Tensor:
    """``idx`` (rows of slots) valid for blocks of ``length``: returns the mask of used slots."""
    used = idx != EMPTY
    if bool((idx[used] >= length).any()):
        raise RemoteProtocolError("a sparse chunk has an index outside its block")
    if idx.shape[1] > 1:
        steps = idx[:, 1:] - idx[:, :-1]
        # used slots strictly increase, and an empty slot is followed only by empty slots
        if bool(((steps <= 0) & used[:, 1:]).any()):
            raise RemoteProtocolError("a sparse chunk has indices out of order or repeated")
    return used


def decode_contribution(buf: memoryview | bytes, density: float, bits: int, count: int) -> torch.Tensor:
    raw = np.frombuffer(buf, dtype=np.uint8)
    lengths = _blocks(count)
    out = torch.zeros(count, dtype=torch.float32)
    if not lengths:
        return out
    nb = len(lengths)
    slots = [kept(density, n) for n in lengths]
    total = sum(slots)
    scales = torch.from_numpy(raw[: 4 * nb].view("<f4").astype(np.float32))
    if not bool(((scales >= 0) & torch.isfinite(scales)).all()):
        raise RemoteProtocolError("a sparse chunk has a negative or non-finite scale")
    idx_all = torch.from_numpy(raw[4 * nb : 4 * nb + 2 * total].view("<u2").astype(np.int64))
    codes = torch.from_numpy(_unpack(raw[4 * nb + 2 * total :], bits, total).astype(np.int64))
    levels = _levels(bits)
    block, slot = 0, 0
    for rows, length in _rows(out):
        n, k = rows.shape[0], slots[block]
        idx = idx_all[slot : slot + n * k].view(n, k)
        q = codes[slot : slot + n * k].view(n, k)
        used = _check_indices(idx, length)
        if bool((q[~used] != 0).any()):
            raise RemoteProtocolError("a sparse chunk has a level in an empty slot")
        values = levels[q] * scales[block : block + n, None]
        if not bool(torch.isfinite(values).all()):
            raise RemoteProtocolError("a sparse chunk decodes to non-finite values")
        rows.scatter_add_(1, torch.where(used, idx, 0), torch.where(used, values, 0.0))
        block, slot = block + n, slot + n * k
    return out


def _pack12(idx: np.ndarray) -> bytes:
    """Indices below 4096, two in three bytes, low bits first (a zero index pads an odd count)."""
    pairs = np.zeros(-(-idx.size // 2) * 2, dtype=np.uint16)
    pairs[: idx.size] = idx
    a, b = pairs[0::2], pairs[1::2]
    out = np.empty((a.size, 3), dtype=np.uint8)
    out[:, 0] = a & 0xFF
    out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    out[:, 2] = b >> 4
    return out.tobytes()[: (3 * idx.size + 1) // 2]  # (an odd count's padding: its last byte is 0)


def _unpack12(raw: np.ndarray, count: int) -> np.ndarray:
    flat = np.zeros(-(-raw.size // 3) * 3, dtype=np.uint16)
    flat[: raw.size] = raw
    trio = flat.reshape(-1, 3)
    out = np.empty(trio.shape[0] * 2, dtype=np.uint16)
    out[0::2] = trio[:, 0] | ((trio[:, 1] & 0xF) << 8)
    out[1::2] = (trio[:, 1] >> 4) | (trio[:, 2] << 4)
    if out[count:].any():
        raise RemoteProtocolError("a sparse chunk has bits set past its last index")
    return out[:count]


def encode_sum(x: torch.Tensor, density: float, members: int) -> bytes:
    scales, counts, indices, codes = [], [], [], []
    for rows, length in _rows(x):
        idx, v = _slots(rows, sum_slots(density, members, length), length)
        if not bool(torch.isfinite(v).all()):
            raise ValueError("cannot encode a tensor that holds NaN or infinite values")
        used = idx != EMPTY  # (the used slots come first: _slots sorts EMPTY last)
        scale = v.abs().amax(dim=1)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.div(v, divisor[:, None]).mul_(FP8_TOP).to(torch.float8_e4m3fn).view(torch.uint8)
        scales.append(scale)
        counts.append(used.sum(dim=1))
        indices.append(torch.where(used, idx, 0).reshape(-1))
        codes.append(torch.where(used, q, 0).reshape(-1))
    if not scales:
        return b""
    return (
        torch.cat(scales).numpy().astype("<f4").tobytes()
        + torch.cat(counts).numpy().astype("<u2").tobytes()
        + _pack12(torch.cat(indices).numpy().astype(np.uint16))
        + torch.cat(codes).to(torch.uint8).numpy().tobytes()
    )


def decode_sum(buf: memoryview | bytes, density: float, members: int, count: int) -> torch.Tensor:
    raw = np.frombuffer(buf, dtype=np.uint8)
    out = torch.zeros(count, dtype=torch.float32)
    lengths = _blocks(count)
    if not lengths:
        return out
    nb, slots = len(lengths), [sum_slots(density, members, n) for n in lengths]
    total = sum(slots)
    scales = torch.from_numpy(raw[: 4 * nb].view("<f4").astype(np.float32))
    counts = torch.from_numpy(raw[4 * nb : 6 * nb].view("<u2").astype(np.int64))
    at = 6 * nb + (3 * total + 1) // 2
    idx_all = torch.from_numpy(_unpack12(raw[6 * nb : at], total).astype(np.int64))
    code_all = raw[at:]
    if not bool(((scales >= 0) & torch.isfinite(scales)).all()):
        raise RemoteProtocolError("a sparse chunk has a negative or non-finite scale")
    if bool(((scales > 0) != (counts > 0)).any()) or bool((counts > torch.tensor(slots)).any()):
        raise RemoteProtocolError("a sparse chunk has a block count that does not fit its slots or scale")
    if bool(np.isin(code_all, _FP8_NAN).any()):
        raise RemoteProtocolError("a sparse chunk holds NaN values")
    v_all = torch.from_numpy(code_all.copy()).view(torch.float8_e4m3fn).to(torch.float32)
    block, slot = 0, 0
    for rows, length in _rows(out):
        n, k = rows.shape[0], slots[block]
        idx = idx_all[slot : slot + n * k].view(n, k)
        v = v_all[slot : slot + n * k].view(n, k)
        used = torch.arange(k)[None, :] < counts[block : block + n, None]
        if bool((idx[~used] != 0).any()) or bool((v[~used] != 0).any()):
            raise RemoteProtocolError("a sparse chunk has an index or a value in an empty slot")
        _check_indices(torch.where(used, idx, EMPTY), length)
        v = v * (scales[block : block + n, None] / FP8_TOP)
        if not bool(torch.isfinite(v).all()):
            raise RemoteProtocolError("a sparse chunk decodes to non-finite values")
        rows.scatter_add_(1, torch.where(used, idx, 0), torch.where(used, v, 0.0))
        block, slot = block + n, slot + n * k
    return out
