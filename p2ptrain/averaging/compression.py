"""Compression of flat float32 slices for the streamed butterfly all-reduce.

Theory of operation
-------------------
A partition travels as chunks; each chunk is one contiguous slice of a flat float32 buffer, encoded on
its own so that a reducer can add it into its accumulator while the next chunk is still on the wire.
Every mode has a fixed encoded size for a given element count (:func:`encoded_size`), so sender and
receiver agree on chunk boundaries without telling each other, and a chunk of the wrong length is a
protocol error before a single value is read. (A top-k sum is the exception: it sends only the slots its
members filled, its header counts them, and a chunk is refused when its length is not what they take.)

- ``none``: raw float32. ``fp16`` / ``bf16``: a cast, half the bytes.
- ``int8``: blockwise symmetric quantization, about a quarter of the bytes. One scale per block of
  :data:`INT8_BLOCK` elements (``scale = absmax / 127``, ``q = round(x / scale)`` in [-127, 127]) keeps
  a single large value from flattening the resolution of the whole tensor, as one global scale would;
  a block of zeros gets scale 0. Wire layout: all ``ceil(n / INT8_BLOCK)`` float32 scales, then the ``n``
  int8 values. All multi-byte values are little-endian.

Reducers sum in float32 whatever the wire carries: rounding the running sum to 16 or 8 bits after every
addend would compound the error with the group size, while float32 keeps it at one quantization per
contribution. :func:`accumulate` multiplies and adds as two separately rounded float32 operations (never
a fused multiply-add): each step then has one correctly rounded IEEE result, so every machine that adds
the same chunks in the same order holds bit-identical sums, which commit-by-agreement relies on.

Error bounds (:func:`error_bound`, the largest per-element error of ``decode(encode(x))``, ``m = max|x|``):
``none`` 0; ``fp16`` ``m * 2**-11 + 2**-24`` (unit roundoff plus the subnormal spacing), or ``m - 65504``
when larger: values beyond the fp16 range are clamped to +-65504 rather than sent as infinities;
``bf16`` ``m * 2**-8 + 2**-133`` (values beyond the bf16 range are likewise clamped to its largest finite
value);
``int8`` ``absmax / 254`` per block (half a quantization step), reported as ``m * (1/254 + 2**-21) +
2**-140``: the extra terms cover float32 rounding of the scale and the product, and subnormal scales.

Decoding treats the bytes as hostile: wrong lengths, non-finite values, negative or oversized int8
scales and the int8 value -128 (outside the symmetric range) raise :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import enum
import math
import sys

import numpy as np
import torch

from ..errors import RemoteProtocolError
from . import sparse

if sys.byteorder != "little":  # the wire is little-endian and encode() sends native memory as it is
    raise ImportError("p2ptrain's tensor wire format needs a little-endian host")

INT8_BLOCK: int = 1024
"""Elements per int8 block; each block carries one float32 scale."""

_FP16_MAX = 65504.0
_BF16_MAX = torch.finfo(torch.bfloat16).max


class Compression(enum.StrEnum):
    """How a float32 slice is encoded on the wire."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    # top-k sparse (see ``sparse``): the percentage of each block kept, and the bits per kept value
    TOPK05_Q2 = "topk0.5-q2"
    TOPK1_Q2 = "topk1-q2"
    TOPK1_Q4 = "topk1-q4"
    TOPK3_Q2 = "topk3-q2"
    TOPK3_Q4 = "topk3-q4"

    @property
    def sparse(self) -> tuple[float, int] | None:
        """``(density, bits)`` of a top-k mode, else None."""
        if not self.value.startswith("topk"):
            return None
        pct, bits = self.value[4:].split("-q")
        return float(pct) / 100, int(bits)


DENSE = (Compression.NONE, Compression.FP16, Compression.BF16, Compression.INT8)
"""The modes that send every value (the others send the largest ones per block)."""


def parse_compression(text: str) -> Compression:
    """The mode named by ``text`` (case-insensitive); ValueError naming the choices otherwise."""
    try:
        return Compression(str(text).strip().lower())
    except ValueError:
        choices = ", ".join(m.value for m in Compression)
        raise ValueError(f"unknown compression {text!r}; choose one of: {choices}") from None


def encoded_size(mode: Compression, count: int, members: int = 0) -> int:
    """The exact byte size of :func:`encode` for ``count`` elements (``members``: see :func:`encode`); for
    a top-k mode's sum, the largest (it sends its used slots only)."""
    if count < 0:
        raise ValueError(f"element count must be >= 0, got {count}")
    mode = Compression(mode)  # a plain string would silently miss every `is` test below
    if mode.sparse:
        density, bits = mode.sparse
        if members:
            return sparse.sum_size(density, members, count)
        return sparse.contribution_size(density, bits, count)
    if mode is Compression.NONE:
        return 4 * count
    if mode is Compression.INT8:
        return 4 * -(-count // INT8_BLOCK) + count
    return 2 * count


def chunk_elements(mode: Compression, target_bytes: int) -> int:
    """Elements per streamed chunk so that a chunk's encoded size is about ``target_bytes`` (at most,
    unless that is below one element or one int8 block). A positive multiple of INT8_BLOCK for int8."""
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    mode = Compression(mode)
    if mode.sparse:  # whole blocks, as many as fit even when a group's sum fills every slot
        return max(1, target_bytes // (4 * sparse.BLOCK)) * sparse.BLOCK
    if mode is Compression.INT8:
        return max(1, target_bytes // (4 + INT8_BLOCK)) * INT8_BLOCK
    return max(1, target_bytes // encoded_size(mode, 1))


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu":
        raise ValueError(f"expected a 1-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.detach().contiguous()


def _absmax(t: torch.Tensor) -> float:
    """max|t| in one pass (NaN if ``t`` holds one, inf if it holds an infinity); much faster than
    ``isfinite(t).all()`` or ``abs().max()``, which allocate a temporary as large as ``t``."""
    lo, hi = (float(v) for v in torch.aminmax(t))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.view(torch.uint8).numpy().data  # zero-copy, format "B"; keeps the tensor's memory alive


def encode(x: torch.Tensor, mode: Compression, members: int = 0) -> memoryview | bytes:
    """The wire bytes of ``x`` (a 1-D float32 CPU slice); ValueError if it holds NaN or infinity.
    ``members``: for a top-k mode, encode the reduced sum of a group of that many (its blocks keep
    enough slots for all their contributions' values); 0: one member's contribution. Dense modes send
    both alike.

    For ``none`` the result is a zero-copy view of ``x``'s memory: do not modify ``x`` until it is sent.
    """
    x, mode = _check_input(x), Compression(mode)
    if x.numel() == 0:
        return b""
    if mode.sparse:
        density, bits = mode.sparse
        if members:
            return sparse.encode_sum(x, density, members)
        return sparse.encode_contribution(x, density, bits)
    if mode is Compression.INT8:
        return _encode_int8(x)
    absmax = _absmax(x)
    if not math.isfinite(absmax):
        raise ValueError("cannot encode a tensor that holds NaN or infinite values")
    if mode is Compression.NONE:
        return _bytes_of(x)
    limit = _FP16_MAX if mode is Compression.FP16 else _BF16_MAX
    if absmax > limit:
        x = x.clamp(-limit, limit)
    return _bytes_of(x.to(torch.float16 if mode is Compression.FP16 else torch.bfloat16))


def encoded_chunk(values: torch.Tensor, mode: Compression) -> bytes | memoryview:
    """One member's chunk on the wire: ``encode``, but a float32 chunk is its own memory (no copy)."""
    if mode is Compression.NONE:
        return values.view(torch.uint8).numpy().data  # zero-copy: the slice's own memory
    return encode(values.contiguous(), mode)


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or infinity in ``x``: min and max propagate NaN, and one pass is ~10x faster than isfinite."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def _blocks(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as 2-D views: the full blocks, then the short last block (if any), one row each."""
    full = t.numel() // INT8_BLOCK * INT8_BLOCK
    parts = [t[:full].view(-1, INT8_BLOCK)] if full else []
    return parts + ([t[full:].view(1, -1)] if full < t.numel() else [])


def _encode_int8(x: torch.Tensor) -> memoryview:
    n = x.numel()
    nb = -(-n // INT8_BLOCK)
    out = torch.empty(encoded_size(Compression.INT8, n), dtype=torch.uint8)
    scales = out[: 4 * nb].view(torch.float32)
    q = out[4 * nb :].view(torch.int8)
    row = 0
    for rows, qrows in zip(_blocks(x), _blocks(q), strict=True):  # at most two pieces, not per element
        lo, hi = torch.aminmax(rows, dim=1)
        absmax = torch.maximum(hi, -lo)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("cannot encode a tensor that holds NaN or infinite values")
        scale = scales[row : row + rows.shape[0]]
        torch.div(absmax, 127.0, out=scale)
        # near float32's max, absmax / 127 can round up so that decoding's scale * 127 overflows (and the
        # decoder refuses it): step such scales down one ulp; the clamp below absorbs the tiny excess
        too_big = torch.isinf(scale * 127)
        if bool(too_big.any()):
            scale.copy_(torch.where(too_big, torch.nextafter(scale, torch.zeros_like(scale)), scale))
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero blocks quantize to 0
        qrows.copy_(torch.div(rows, divisor[:, None]).round_().clamp_(-127, 127))
        row += rows.shape[0]
    return _bytes_of(out)


def _nbytes(buf: bytes | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def decode(
    buf: bytes | memoryview, mode: Compression, count: int, members: int = 0, *, checked: bool = False
) -> torch.Tensor:
    """A new 1-D float32 tensor of ``count`` elements from wire bytes (``members``: see :func:`encode`);
    RemoteProtocolError when the bytes have the wrong length or decode to anything but finite values.
    ``checked``: these very bytes were decoded and found finite before (a reducer reading back what it
    kept): the pass over the values for that is skipped."""
    mode = Compression(mode)
    expected = encoded_size(mode, count, members)
    # a top-k sum sends its used slots only: up to ``expected`` bytes, its block counts say how many
    # (``sparse`` checks them); every other chunk has exactly its size
    at_most = bool(mode.sparse and members)
    if _nbytes(buf) > expected or (_nbytes(buf) != expected and not at_most):
        bound = "at most " if at_most else ""
        raise RemoteProtocolError(
            f"a {mode.value} chunk of {count} elements must be {bound}{expected} bytes, got {_nbytes(buf)}"
        )
    if count == 0:
        return torch.empty(0, dtype=torch.float32)
    if mode.sparse:
        density, bits = mode.sparse
        if members:
            return sparse.decode_sum(buf, density, members, count)
        return sparse.decode_contribution(buf, density, bits, count)
    raw = torch.empty(expected, dtype=torch.uint8)  # one copy: writable, aligned, ours (no aliasing)
    raw.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    if mode is Compression.INT8:
        return _decode_int8(raw, count)
    if mode is Compression.NONE:
        out = raw.view(torch.float32)
    else:
        out = raw.view(torch.float16 if mode is Compression.FP16 else torch.bfloat16).to(torch.float32)
    if not checked and not math.isfinite(_absmax(out)):
        raise RemoteProtocolError(f"a {mode.value} chunk holds NaN or infinite values")
    return out


def _decode_int8(raw: torch.Tensor, count: int) -> torch.Tensor:
    nb = -(-count // INT8_BLOCK)
    scales = raw[: 4 * nb].view(torch.float32)
    # scale * 127 is exactly the largest product decoding computes: finite there means finite everywhere
    if not bool(((scales >= 0) & torch.isfinite(scales * 127)).all()):  # NaN fails both tests
        raise RemoteProtocolError("an int8 chunk has a negative, non-finite or oversized scale")
    q = raw[4 * nb :].view(torch.int8)
    if int(q.min()) < -127:
        raise RemoteProtocolError("an int8 chunk holds -128, outside the symmetric range [-127, 127]")
    out = q.to(torch.float32)
    row = 0
    for rows in _blocks(out):
        rows.mul_(scales[row : row + rows.shape[0], None])
        row += rows.shape[0]
    return out


def roundtrip(x: torch.Tensor, mode: Compression) -> torch.Tensor:
    """``decode(encode(x))`` as one member's contribution: what ``x`` becomes on the wire. For a top-k
    mode, on blocks counted from ``x``'s start, as a sparse round's partitions count them."""
    return decode(encode(x, mode), mode, x.numel())


def accumulate(acc: torch.Tensor, buf: bytes | memoryview, mode: Compression, weight: float) -> None:
    """``acc += weight * decode(buf)`` in place, in float32, as a rounded multiply then a rounded add.

    The bytes are validated in full before ``acc`` is touched: a bad chunk leaves it unchanged. Bounding
    ``weight`` (and so the size of the product) is the caller's part.
    """
    if acc.dtype != torch.float32 or acc.dim() != 1:
        raise ValueError(f"the accumulator must be a 1-D float32 tensor, got {acc.dtype} {tuple(acc.shape)}")
    if not math.isfinite(weight):
        raise ValueError(f"the weight must be finite, got {weight}")
    tmp = decode(buf, mode, acc.numel())
    tmp.mul_(weight)
    acc.add_(tmp)


def error_bound(x: torch.Tensor, mode: Compression) -> float:
    """The largest absolute per-element error that ``decode(encode(x, mode))`` can introduce."""
    m = _absmax(x.detach()) if x.numel() else 0.0
    mode = Compression(mode)
    if mode.sparse:
        raise ValueError(f"{mode.value} drops values: no per-element bound (see sparse.roundtrip)")
    if mode is Compression.NONE:
        return 0.0
    if mode is Compression.FP16:
        return max(m * 2.0**-11 + 2.0**-24, m - _FP16_MAX)
    if mode is Compression.BF16:
        return m * 2.0**-8 + 2.0**-133
    return m * (1 / 254 + 2.0**-21) + 2.0**-140
