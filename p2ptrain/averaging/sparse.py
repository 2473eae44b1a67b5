"""Top-k sparse encodings of flat float32 slices: what a member sends, and the reduced sum it gets back.

Theory of operation
-------------------
A slice is cut into blocks of :data:`BLOCK` elements (the last one may be shorter), counted from the
slice's start. Partitions of a sparse round start on multiples of BLOCK (see ``partition_sizes``), so a
block of a slice is a block of the whole flattened vector: a member that compressed its whole vector
before the round (:func:`roundtrip`) sends exactly those values, and knows what it sent.

**Slots.** A block of ``L`` elements has a fixed number ``k`` of slots; a slot is an element index
within the block and a code. Used slots come first, their indices strictly increasing; the count of used
slots is up to ``k``. So a block's non-zeros have exactly one encoding.

**Indices** (Elias-Fano): with ``low = floor(log2(L / k))``, an index's low ``low`` bits are stored as
they are, and its high part ``h = index >> low`` in unary: the ``i``-th used slot sets bit ``h + i`` of
the block's upper field of ``k + ((L - 1) >> low)`` bits. About ``2 + log2(L / k)`` bits an index
instead of a fixed 16 or 12: 9.5 bits at 21 of 4096 (a contribution at 0.5%), 6.5 at 168 (the sum of
eight of them).

**Contribution** (``density`` d, ``bits`` b): ``k = ceil(d * L)`` slots; the largest magnitudes are kept
(ties: lower index), zeros never. The block's scale ``s`` is the largest magnitude it keeps; a code
``q`` in ``[0, 2**b)`` stands for ``s * (2q - (2**b - 1)) / (2**b - 1)``: evenly spaced, symmetric, zero
excluded (a kept value is never zero). Re-encoding a decoded contribution gives the same bytes (the same
non-zeros, the same scale, the same levels): compressing before the round loses nothing more in it. A
contribution sends every slot (its blocks hardly ever hold fewer than k non-zeros), so its size depends
only on its element count.

**Sum** (for a group of ``members``): ``k = min(L, members * k_contribution)`` slots, enough for every
non-zero that ``members`` contributions can hold. Each code is an 8-bit float (e4m3) of the value over
the block's scale ``s`` (the largest magnitude it keeps) times 448, e4m3's largest, so a value carries
about two significant digits whatever its size (the members' 2- or 4-bit levels carry less). The reducer
encodes its result once and serves those bytes, so every member decodes the same values. If there are
more non-zeros than slots (a member that averages dense values in a sparse round, the reducer's own
included), the largest magnitudes are kept, ties by index. Members pick many of the same indices (the
union of eight members' picks was about half of their slots in a run of the built-in GPT, of four about
0.7), so a sum sends only its used slots: a block of ``c`` sends its upper field's first
``c + ((L - 1) >> low)`` bits, ``c`` low parts and ``c`` codes, a block of none nothing, and its header
counts them (``low`` stays the one for ``k``).

**Wire layout of a chunk**: every block's float32 scale (little-endian); a sum's, then every block's
uint16 count of used slots; then one bit string, packed eight to a byte, low bits first (and so is
every field in it), zero bits padding the last byte. A contribution's: for each block in order, its
upper field, its ``k`` low parts (``low`` bits each; zero for unused slots), its ``k`` codes (``b`` bits
each; zero for unused slots). A sum's, in three sections so that a decoder reads each with a few array
operations: every block's upper field cut to its used slots (above), in block order; then every used
slot's low part (its block's ``low`` bits); then every used slot's 8-bit code.

Decoding treats the bytes as hostile: wrong lengths (a sum's: not what its counts take), more indices
than slots, counts that differ from the indices, indices out of range or not increasing, low parts or
codes in unused slots, bits past the last block, a scale that is negative, non-finite, or zero with used
slots (non-zero without), NaN codes and non-finite values raise :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import RemoteProtocolError

BLOCK: int = 4096
"""Elements per sparse block (a block's indices fit 16 bits)."""
EMPTY: int = 0xFFFF
"""The index of an unused slot (in memory only: the wire counts used slots instead)."""

FP8_TOP: float = 448.0
"""The largest e4m3 value: a sum's block scale maps to it."""
_FP8_NAN = (0x7F, 0xFF)
_SUM_BITS = 8  # bits of a sum's code


def kept(density: float, length: int) -> int:
    """Slots of a contribution's block of ``length`` elements."""
    return min(length, max(1, math.ceil(density * length))) if length else 0


def sum_slots(density: float, members: int, length: int) -> int:
    """Slots of a group's sum's block of ``length`` elements."""
    return min(length, members * kept(density, length))


def _blocks(count: int) -> list[int]:
    full, rest = divmod(count, BLOCK)
    return [BLOCK] * full + ([rest] if rest else [])


def _low_bits(length: int, slots: int) -> int:
    """Elias-Fano's split for ``slots`` indices below ``length``: floor(log2(length / slots))."""
    return (length // slots).bit_length() - 1


def _upper_bits(length: int, slots: int) -> int:
    return slots + ((length - 1) >> _low_bits(length, slots))


def _block_bits(length: int, slots: int, code_bits: int) -> int:
    return _upper_bits(length, slots) + slots * (_low_bits(length, slots) + code_bits)


def _slots_for(density: float, members: int, length: int) -> int:
    """A sum's slots for ``members``; a contribution's for 0."""
    return sum_slots(density, members, length) if members else kept(density, length)


def _size(density: float, members: int, code_bits: int, count: int) -> int:
    lengths = _blocks(count)
    bits = sum(_block_bits(n, _slots_for(density, members, n), code_bits) for n in lengths)
    return (6 if members else 4) * len(lengths) + -(-bits // 8)


def contribution_size(density: float, bits: int, count: int) -> int:
    """The exact byte size of a contribution of ``count`` elements."""
    return _size(density, 0, bits, count)


def sum_size(density: float, members: int, count: int) -> int:
    """The largest byte size of a group's reduced sum of ``count`` elements (every slot used)."""
    return _size(density, members, _SUM_BITS, count)


def _levels(bits: int) -> torch.Tensor:
    top = (1 << bits) - 1
    return torch.div(torch.arange(0, top + 1, dtype=torch.float32) * 2 - top, float(top))


def _slots(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x``: the ``k`` indices of the largest non-zero magnitudes (ties: lower index),
    ascending, then EMPTY; and the values there (0 for EMPTY)."""
    order = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :k]
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


def _to_bits(v: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of ints as rows of ``width`` bits each, low bit first (uint8 0/1)."""
    shifts = torch.arange(width, dtype=torch.int64)
    return (
        ((v.to(torch.int64)[..., None] >> shifts) & 1).to(torch.uint8).reshape(v.shape[0], v.shape[1] * width)
    )


def _from_bits(bits: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """The inverse of :func:`_to_bits` for rows of ``k`` ints."""
    if width == 0:
        return torch.zeros(bits.shape[0], k, dtype=torch.int64)
    shifts = torch.arange(width, dtype=torch.int64)
    return (bits.view(bits.shape[0], k, width).to(torch.int64) << shifts).sum(dim=2)


def _block_row_bits(idx: torch.Tensor, codes: torch.Tensor, length: int, code_bits: int) -> torch.Tensor:
    """Blocks' slots (indices ascending then EMPTY, codes 0 there) as their bit strings, one row each."""
    rows, k = idx.shape
    low, upper = _low_bits(length, k), _upper_bits(length, k)
    used = idx != EMPTY
    safe = torch.where(used, idx, 0)
    at = torch.where(used, (safe >> low) + torch.arange(k), upper)  # unused: a column dropped below
    ones = torch.zeros(rows, upper + 1, dtype=torch.uint8).scatter_(1, at, 1)[:, :upper]
    return torch.cat([ones, _to_bits(safe & ((1 << low) - 1), low), _to_bits(codes, code_bits)], dim=1)


def _encode(
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], code_bits: int, counted: bool
) -> bytes:
    """``groups``: (scales, indices, codes, block length) of rows of blocks, in order. ``counted``: a
    sum's layout (counts in the header, then sections of the used slots only: see the module's doc)."""
    if not groups:
        return b""
    head = torch.cat([g[0] for g in groups]).numpy().astype("<f4").tobytes()
    if counted:
        counts, bits = _sum_sections(groups, code_bits)
        head += counts.numpy().astype("<u2").tobytes()
    else:
        bits = torch.cat([_block_row_bits(i, c, n, code_bits).reshape(-1) for _, i, c, n in groups])
    return head + np.packbits(bits.numpy(), bitorder="little").tobytes()


def _sum_sections(
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], code_bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sum's used slots per block, and its bit string: every block's upper field cut to its used
    slots, then every used slot's low part, then every used slot's code."""
    counts, uppers, lows, codes = [], [], [], []
    for _, idx, code, length in groups:
        low = _low_bits(length, idx.shape[1])
        used = idx != EMPTY
        c = used.sum(dim=1)
        ulen = torch.where(c > 0, ((length - 1) >> low) + c, 0)
        row, rank = used.nonzero(as_tuple=True)  # row-major: a block's used slots in order
        at = idx[row, rank]
        upper = torch.zeros(int(ulen.sum()), dtype=torch.uint8)
        upper[(torch.cumsum(ulen, 0) - ulen)[row] + (at >> low) + rank] = 1
        counts.append(c)
        uppers.append(upper)
        lows.append(_to_bits(at[:, None] & ((1 << low) - 1), low).reshape(-1))
        codes.append(_to_bits(code[row, rank][:, None], code_bits).reshape(-1))
    return torch.cat(counts), torch.cat(uppers + lows + codes)


def _check_indices(idx: torch.Tensor, used: torch.Tensor, length: int) -> None:
    if bool((idx[used] >= length).any()):
        raise RemoteProtocolError("a sparse chunk has an index outside its block")
    if idx.shape[1] > 1 and bool(((idx[:, 1:] <= idx[:, :-1]) & used[:, 1:]).any()):
        raise RemoteProtocolError("a sparse chunk has indices out of order or repeated")


def _read_rows(
    bits: torch.Tensor, k: int, length: int, code_bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`_block_row_bits`: indices (0 in unused slots), codes, the used slots' mask."""
    rows = bits.shape[0]
    low, upper = _low_bits(length, k), _upper_bits(length, k)
    ones = bits[:, :upper]
    counts = ones.sum(dim=1, dtype=torch.int64)
    if bool((counts > k).any()):
        raise RemoteProtocolError("a sparse chunk has more indices than slots in a block")
    lows = _from_bits(bits[:, upper : upper + k * low], k, low)
    codes = _from_bits(bits[:, upper + k * low :], k, code_bits)
    used = torch.arange(k)[None, :] < counts[:, None]
    if bool((lows[~used] != 0).any()) or bool((codes[~used] != 0).any()):
        raise RemoteProtocolError("a sparse chunk has an index or a value in an empty slot")
    row, col = ones.nonzero(as_tuple=True)  # row-major: a row's ones in order
    rank = torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts)[row]
    idx = torch.zeros(rows, k, dtype=torch.int64)
    idx[row, rank] = ((col - rank) << low) | lows[row, rank]
    _check_indices(idx, used, length)
    return idx, codes, used


def _read_sum_sections(
    bits: torch.Tensor, counts: torch.Tensor, shapes: list[tuple[int, int, int]], code_bits: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], int]:
    """The inverse of :func:`_sum_sections` for groups of ``(blocks, slots, length)``: per group its
    indices, codes and used slots (as :func:`_read_rows`), and the bits they took."""
    plan, block = [], 0
    for n, k, length in shapes:
        c = counts[block : block + n]
        if bool((c > k).any()):
            raise RemoteProtocolError("a sparse chunk has a block count past its slots")
        low = _low_bits(length, k)
        plan.append((n, k, length, low, c, torch.where(c > 0, ((length - 1) >> low) + c, 0)))
        block += n
    total = sum(int(u.sum()) + int(c.sum()) * (low + code_bits) for _, _, _, low, c, u in plan)
    if total > bits.numel():
        raise RemoteProtocolError("a sparse chunk is shorter than its block counts say")
    upper_at = 0
    low_at = sum(int(u.sum()) for *_, u in plan)
    code_at = low_at + sum(int(c.sum()) * low for _, _, _, low, c, _ in plan)
    out = []
    for n, k, length, low, c, ulen in plan:
        used_slots = int(c.sum())
        ends = torch.cumsum(ulen, 0)
        pos = bits[upper_at : upper_at + int(ends[-1])].nonzero().flatten()
        row = torch.searchsorted(ends, pos, right=True)
        if pos.numel() != used_slots or not torch.equal(torch.bincount(row, minlength=n), c):
            raise RemoteProtocolError("a sparse chunk has a block count that does not match its indices")
        rank = torch.arange(used_slots) - (torch.cumsum(c, 0) - c)[row]
        lows = _from_bits(bits[low_at : low_at + used_slots * low].view(used_slots, low), 1, low)[:, 0]
        code = _from_bits(
            bits[code_at : code_at + used_slots * code_bits].view(used_slots, code_bits), 1, code_bits
        )
        at = ((pos - (ends - ulen)[row] - rank) << low) | lows
        if bool((at >= length).any()):
            raise RemoteProtocolError("a sparse chunk has an index outside its block")
        if bool(((at[1:] <= at[:-1]) & (row[1:] == row[:-1])).any()):
            raise RemoteProtocolError("a sparse chunk has indices out of order or repeated")
        idx, codes = torch.zeros(n, k, dtype=torch.int64), torch.zeros(n, k, dtype=torch.int64)
        idx[row, rank], codes[row, rank] = at, code[:, 0]
        out.append((idx, codes, torch.arange(k)[None, :] < c[:, None]))
        upper_at, low_at, code_at = (
            upper_at + int(ends[-1]),
            low_at + used_slots * low,
            code_at + used_slots * code_bits,
        )
    return out, total


_Group = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _decode(
    buf: memoryview | bytes, density: float, members: int, code_bits: int, count: int
) -> tuple[torch.Tensor, list[_Group]]:
    """A zero output of ``count`` elements, and per group of equal blocks, checked: its rows of the
    output, scales, indices, codes and used slots' mask (``members``: see :func:`_slots_for`)."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    nb = len(_blocks(count))
    head = (6 if members else 4) * nb
    if raw.size < head:
        raise RemoteProtocolError(f"a sparse chunk of {raw.size} bytes, shorter than its {head}-byte header")
    scales = torch.from_numpy(raw[: 4 * nb].view("<f4").astype(np.float32))
    if not bool(((scales >= 0) & torch.isfinite(scales)).all()):
        raise RemoteProtocolError("a sparse chunk has a negative or non-finite scale")
    counts = torch.from_numpy(raw[4 * nb : head].view("<u2").astype(np.int64))
    bits = torch.from_numpy(np.unpackbits(raw[head:], bitorder="little"))
    out = torch.zeros(count, dtype=torch.float32)
    parts = _rows(out)
    if members:
        shapes = [(r.shape[0], _slots_for(density, members, n), n) for r, n in parts]
        slots, at = _read_sum_sections(bits, counts, shapes, code_bits)
    else:
        slots, at = [], 0
        for rows, length in parts:
            n, k = rows.shape[0], _slots_for(density, members, length)
            width = _block_bits(length, k, code_bits)
            slots.append(_read_rows(bits[at : at + n * width].view(n, width), k, length, code_bits))
            at += n * width
    if raw.size != head + -(-at // 8):
        raise RemoteProtocolError(
            f"a sparse chunk of {raw.size} bytes where its blocks take {head + -(-at // 8)}"
        )
    if bool(bits[at:].any()):
        raise RemoteProtocolError("a sparse chunk has bits set past its last block")
    groups: list[_Group] = []
    block = 0
    for (rows, _), (idx, codes, used) in zip(parts, slots, strict=True):
        s = scales[block : block + rows.shape[0]]
        if bool(((s > 0) != used[:, 0]).any()):
            raise RemoteProtocolError("a sparse chunk has a block scale that does not fit its slots")
        groups.append((rows, s, idx, codes, used))
        block += rows.shape[0]
    return out, groups


def encode_contribution(x: torch.Tensor, density: float, bits: int) -> bytes:
    if x.numel() and not math.isfinite(float(x.abs().max())):
        raise ValueError("cannot encode a tensor that holds NaN or infinite values")
    top = (1 << bits) - 1
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    for rows, length in _rows(x):
        idx, values = _slots(rows, kept(density, length))
        scale = values.abs().amax(dim=1)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.div(values, divisor[:, None]).mul_(top).add_(top).div_(2).round_().clamp_(0, top)
        groups.append((scale, idx, torch.where(idx == EMPTY, 0, q.to(torch.int64)), length))
    return _encode(groups, bits, counted=False)


def decode_contribution(buf: memoryview | bytes, density: float, bits: int, count: int) -> torch.Tensor:
    out, groups = _decode(buf, density, 0, bits, count)
    levels = _levels(bits)
    for rows, scales, idx, codes, used in groups:
        values = levels[codes] * scales[:, None]
        if not bool(torch.isfinite(values).all()):
            raise RemoteProtocolError("a sparse chunk decodes to non-finite values")
        rows.scatter_add_(1, idx, torch.where(used, values, 0.0))
    return out


def encode_sum(x: torch.Tensor, density: float, members: int) -> bytes:
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    for rows, length in _rows(x):
        idx, v = _slots(rows, sum_slots(density, members, length))
        if not bool(torch.isfinite(v).all()):
            raise ValueError("cannot encode a tensor that holds NaN or infinite values")
        scale = v.abs().amax(dim=1)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.div(v, divisor[:, None]).mul_(FP8_TOP).to(torch.float8_e4m3fn).view(torch.uint8)
        groups.append((scale, idx, torch.where(idx == EMPTY, 0, q.to(torch.int64)), length))
    return _encode(groups, _SUM_BITS, counted=True)


def decode_sum(buf: memoryview | bytes, density: float, members: int, count: int) -> torch.Tensor:
    out, groups = _decode(buf, density, members, _SUM_BITS, count)
    for rows, scales, idx, codes, used in groups:
        if bool(((codes == _FP8_NAN[0]) | (codes == _FP8_NAN[1])).any()):
            raise RemoteProtocolError("a sparse chunk holds NaN values")
        v = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        v = v * (scales[:, None] / FP8_TOP)
        if not bool(torch.isfinite(v).all()):
            raise RemoteProtocolError("a sparse chunk decodes to non-finite values")
        rows.scatter_add_(1, idx, torch.where(used, v, 0.0))
    return out
