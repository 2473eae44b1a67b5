"""Step results in the compact, lossless forms that int8 and top-k rounds leave them in (for replay).

Theory of operation. A committed round's result is what every member applies: the average each reducer
published, decoded from the round's wire form (``averaging.compression``). Under int8 that is, per block
of ``INT8_BLOCK`` elements of each chunk, ``scale * q`` with ``q`` in [-127, 127]; under top-k, a vector
that is zero outside the few slots the members filled. Kept as float32, a replay of such a result moved
four bytes per parameter, about a third of a sync AdamW state: little gain over a download. So a result
is kept in the smallest of these forms that gives back *exactly* its float32 values (checked when it is
packed; a form that does not is not used):

- ``sparse``: the count of nonzero values (uint32), their indices (uint32, strictly increasing) and
  their float32 values. Top-k results: about 8 bytes per filled slot.
- ``int8``: the segments (a round's partitions, which begin anywhere: uint32 count, uint32 lengths),
  each on blocks of ``INT8_BLOCK`` elements counted from its start, as the round's wire had them: all
  blocks' float32 scales, then every value's int8 code. About 1.004 bytes per value. Values that are
  not of that form (a segment's edge cannot be found, or a block is not ``q * scale`` exactly) are not
  packed.

Unpacking treats the bytes as hostile (:func:`unpack`): exact sizes, indices in range and increasing,
finite values, segments that cover the values, no int8 code -128, scales finite and not negative;
anything else raises :class:`RemoteProtocolError` before a value is returned. Whatever comes out is
still checked against the trusted digest once applied (``replay``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
import torch

from ...averaging.compression import INT8_BLOCK
from ...errors import RemoteProtocolError

SPARSE = "sparse"
INT8 = "int8"
PACKED = (SPARSE, INT8)
MAX_INDEX = 2**32 - 1  # indices travel as uint32: a larger result is kept unpacked


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def pack_sparse(flat: torch.Tensor) -> bytes | None:
    """``flat`` (1-D float32) as its nonzero indices and values; None when that is not smaller."""
    n = flat.numel()
    if n == 0 or n > MAX_INDEX:
        return None
    if 4 + 8 * int(torch.count_nonzero(flat)) >= 4 * n:
        return None  # (counted first: a dense result's indices would be twice its size)
    idx = torch.nonzero(flat).view(-1)
    vals = flat[idx].contiguous()
    return _u32(idx.numel()) + idx.to(torch.int32).numpy().tobytes() + vals.numpy().tobytes()


MAX_SEGMENTS = 1024  # int8 segments (a round's partitions, groups of up to 64) one result may have
WINDOW = 4096 * INT8_BLOCK  # values checked at once while packing
MAX_SHORT = 8  # segments shorter than a block one result may have


def _candidates(absmax: torch.Tensor) -> list[torch.Tensor]:
    """The encoder's scale for blocks of that absmax, and one float32 step either side (the decoded
    absmax is ``scale * 127`` rounded)."""
    scale = absmax / 127.0
    return [scale, torch.nextafter(scale, torch.zeros_like(scale)), torch.nextafter(scale, absmax * 2)]


def _quantize(rows: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    divisor = torch.where(s > 0, s, torch.ones_like(s))
    return torch.div(rows, divisor[:, None]).round_().clamp_(-127, 127)


def _blocks_on(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` on blocks counted from its start: which are exactly ``q * scale``, their scales and codes
    (zero where not exact). Every block tries the encoder's scale first; only the blocks it does not
    give exactly try the others (most blocks of a round's result are exact under the first, and the
    values are read in place: a window of a result is a whole number of blocks but at its end)."""
    n = x.numel()
    nb = -(-n // INT8_BLOCK)
    if n == nb * INT8_BLOCK:
        rows = x.reshape(nb, INT8_BLOCK)
    else:
        rows = torch.zeros(nb * INT8_BLOCK, dtype=torch.float32)
        rows[:n] = x
        rows = rows.view(nb, INT8_BLOCK)
    lo, hi = torch.aminmax(rows, dim=1)
    first, *others = _candidates(torch.maximum(lo.abs(), hi.abs()))
    scales, codes = first, _quantize(rows, first)
    exact = (codes * scales[:, None] == rows).all(dim=1)
    if bool(exact.all()):
        return exact, scales, codes
    for s in others:  # (the blocks no candidate so far gave exactly)
        todo = (~exact).nonzero().view(-1)
        r, c = rows[todo], s[todo]
        q = _quantize(r, c)
        ok = (q * c[:, None] == r).all(dim=1)
        at = todo[ok]
        scales[at], codes[at] = c[ok], q[ok]
        exact[at] = True
        if bool(exact.all()):
            return exact, scales, codes
    scales[~exact], codes[~exact] = 0.0, 0.0
    return exact, scales, codes


def _longest_exact_prefix(w: torch.Tensor) -> int:
    """The longest start of ``w`` (at most one block) that is one block of ``q * scale`` (a partition's
    last block ends there); 0 if none."""
    m = w.numel()
    prefix_max = torch.cummax(w.abs(), dim=0).values
    beyond = torch.arange(m)[None, :] > torch.arange(m)[:, None]  # row L-1: columns past L-1
    rows = w[None, :].expand(m, m)
    best = 0
    for s in _candidates(prefix_max):
        ok = ((_quantize(rows, s) * s[:, None] == rows) | beyond).all(dim=1)
        hits = ok.nonzero()
        if hits.numel():
            best = max(best, int(hits[-1]) + 1)
    return best


def int8_form(flat: torch.Tensor, put_codes: Callable[[int, bytes], None]) -> tuple[bytes, int] | None:
    """``flat`` (1-D float32) as an int8 round leaves it: segments (its partitions, which begin anywhere),
    each on blocks of ``INT8_BLOCK`` counted from its start, each block a float32 scale and int8 codes
    that give its values exactly. The codes go to ``put_codes(at, codes)`` a window at a time, in order
    (value ``at`` on); returns what comes before them (the segments and every block's scale: about 1/64
    of the codes) and the packed size, or None when the values are not of that form (found out within the
    first block that is not, or after ``MAX_SEGMENTS`` segments)."""
    n = flat.numel()
    if n == 0 or n > MAX_INDEX:
        return None
    segments: list[int] = []
    scales: list[torch.Tensor] = []
    start = at = 0  # the open segment's start, and how far it is checked (on its grid)
    short = 0  # segments shorter than a block (not the last): a few partitions are; values not int8 are

    def put(q: torch.Tensor) -> None:
        put_codes(at, q.to(torch.int8).numpy().tobytes())

    while at < n:
        window = flat[at : at + WINDOW]
        exact, s, q = _blocks_on(window)
        bad = (~exact).nonzero()
        whole = int(bad[0]) if bad.numel() else exact.numel()
        scales.append(s[:whole])
        put(q[:whole].reshape(-1)[: min(window.numel(), whole * INT8_BLOCK)])
        at += min(window.numel(), whole * INT8_BLOCK)
        if whole == exact.numel() and at < n:
            continue  # the segment goes on past this window (a multiple of blocks: the same grid)
        if whole < exact.numel():  # the segment ends inside that block: its last, short block
            tail = _longest_exact_prefix(flat[at : at + INT8_BLOCK])
            ok, s, q = _blocks_on(flat[at : at + tail]) if tail else (torch.zeros(1, dtype=torch.bool), s, q)
            short += at + tail < n and at + tail - start < INT8_BLOCK
            if not bool(ok.all()) or len(segments) + 1 >= MAX_SEGMENTS or short > MAX_SHORT:
                return None
            scales.append(s[:1])
            put(q[:1].reshape(-1)[:tail])
            at += tail
        segments.append(at - start)
        start = at
    head = b"".join(
        [
            _u32(len(segments)),
            torch.tensor(segments, dtype=torch.int64).to(torch.int32).numpy().tobytes(),
            torch.cat(scales).numpy().tobytes(),
        ]
    )
    return head, len(head) + n


def int8_head_room(n: int) -> int:
    """The most bytes :func:`int8_form`'s head may take for ``n`` values (its codes may be written past
    this before the head is known)."""
    return 4 + 4 * MAX_SEGMENTS + 4 * (-(-n // INT8_BLOCK) + MAX_SEGMENTS)


def pack_int8(flat: torch.Tensor) -> bytes | None:
    """:func:`int8_form` in memory: the packed bytes, or None when the values are not of that form or it
    is not smaller than float32."""
    codes = bytearray(flat.numel())

    def put(at: int, data: bytes) -> None:
        codes[at : at + len(data)] = data

    form = int8_form(flat, put)
    if form is None or form[1] >= 4 * flat.numel():
        return None
    return form[0] + codes


def pack(flat: torch.Tensor, kinds: tuple[str, ...]) -> tuple[str, bytes] | None:
    """The smallest of ``kinds`` that holds ``flat`` (1-D float32) exactly, and its bytes; None if none
    is smaller than float32."""
    best: tuple[str, bytes] | None = None
    for kind in kinds:
        data = pack_sparse(flat) if kind == SPARSE else pack_int8(flat) if kind == INT8 else None
        if data is not None and (best is None or len(data) < len(best[1])):
            best = (kind, data)
    return best


def max_size(kind: str, count: int) -> int:
    """The most bytes a ``kind`` result of ``count`` values may have (it is never kept when larger
    than float32)."""
    return 4 * count


def _finite(t: torch.Tensor, what: str) -> None:
    if t.numel() and not math.isfinite(float(t.abs().max())):
        raise RemoteProtocolError(f"a packed result holds {what} that are not finite")


def _indices(buf: memoryview, at: int, k: int, limit: int) -> torch.Tensor:
    idx = torch.from_numpy(np.frombuffer(buf, dtype="<u4", count=k, offset=at).astype(np.int64))
    if k and (int(idx[-1]) >= limit or (k > 1 and not bool((idx[1:] > idx[:-1]).all()))):
        raise RemoteProtocolError("a packed result's indices are out of range or not increasing")
    return idx


def unpack(
    kind: str, data: bytes | bytearray | memoryview, count: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 values of a packed result of ``count`` values: written into ``out`` (``count``
    float32 values, e.g. in a mapped file; no temporary as large as it) and returned, or a new tensor;
    RemoteProtocolError when the bytes are not a well-formed ``kind`` result of that count (``out`` then
    holds anything)."""
    buf = memoryview(data).cast("B")
    size = len(buf)
    if size < 4 or size > max_size(kind, count):
        raise RemoteProtocolError(f"a {kind} result of {count} values cannot be {size} bytes")
    if out is None:
        out = torch.zeros(count, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != count:
        raise ValueError(f"unpack into {count} float32 values, not {out.numel()} of {out.dtype}")
    else:
        out.zero_()
    if kind == SPARSE:
        (k,) = struct.unpack_from("<I", buf, 0)
        if k > count or size != 4 + 8 * k:
            raise RemoteProtocolError(f"a sparse result of {k} values cannot be {size} bytes")
        idx = _indices(buf, 4, k, count)
        vals = torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=k, offset=4 + 4 * k).copy())
        _finite(vals, "values")
        out[idx] = vals
        return out
    if kind != INT8:
        raise RemoteProtocolError(f"no packed result kind {kind!r}")
    (k,) = struct.unpack_from("<I", buf, 0)
    if not 1 <= k <= min(MAX_SEGMENTS, count) or size < 4 + 4 * k:
        raise RemoteProtocolError(f"an int8 result of {count} values cannot have {k} segments")
    lengths = np.frombuffer(buf, dtype="<u4", count=k, offset=4).astype(np.int64)
    if int(lengths.min()) < 1 or int(lengths.sum()) != count:
        raise RemoteProtocolError("an int8 result's segments do not cover its values")
    nb = int((-(-lengths // INT8_BLOCK)).sum())
    if size != 4 + 4 * k + 4 * nb + count:
        raise RemoteProtocolError(f"an int8 result of {count} values in {k} segments cannot be {size} bytes")
    at = 4 + 4 * k
    scales = torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=nb, offset=at).copy())
    if not bool(((scales >= 0) & torch.isfinite(scales * 127)).all()):
        raise RemoteProtocolError("an int8 result has a negative, non-finite or oversized scale")
    codes = np.frombuffer(buf, dtype=np.int8, count=count, offset=at + 4 * nb)
    q = torch.from_numpy(codes if codes.flags.writeable else codes.copy())
    if int(q.min()) < -127:
        raise RemoteProtocolError("an int8 result holds -128, outside the symmetric range")
    values = out.copy_(q)  # (decoded in place: the codes, then each segment's blocks scaled)
    start, block = 0, 0
    for length in lengths.tolist():
        seg = values[start : start + length]
        full = length // INT8_BLOCK
        if full:
            seg[: full * INT8_BLOCK].view(full, INT8_BLOCK).mul_(scales[block : block + full, None])
        if length % INT8_BLOCK:
            seg[full * INT8_BLOCK :].mul_(scales[block + full])
        start, block = start + length, block + -(-length // INT8_BLOCK)
    return out
