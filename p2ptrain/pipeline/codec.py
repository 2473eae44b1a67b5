"""Activations, their gradients and token ids on the wire, and the checks every one of them passes.

Theory of operation: a tensor travels as the bytes of ``averaging.compression`` (raw float32, fp16,
bf16, or blockwise int8: one float32 scale per 1024 values, about a quarter of float32's bytes), beside
a header that gives its shape. Whatever arrives is hostile until checked: :func:`decode_tensor` takes
the shape the *receiver* expects (never the one the sender claims), refuses bytes that are not the exact
encoded size of that shape, values that are NaN or infinite, and values beyond ``max_abs``; it raises
:class:`RemoteProtocolError` with the reason, so the caller drops the peer that sent it. Token ids
travel as little-endian int32 and must lie in ``[0, vocab)``.

:func:`tolerance` is how far two honest peers' answers to the same micro-batch may differ: each was
quantized once, so twice the compression's bound, plus a small relative slack for hardware that does
not compute bit for bit alike.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..averaging.compression import Compression, decode, encode, encoded_size, error_bound
from ..errors import RemoteProtocolError

MAX_ELEMENTS = 1 << 31  # no activation a stage could send has more values than this


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def check_shape(shape: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
    if tuple(shape) != tuple(expected):
        raise RemoteProtocolError(f"{what} has shape {tuple(shape)}, expected {tuple(expected)}")


def encode_tensor(x: torch.Tensor, mode: Compression) -> bytes | memoryview:
    """The wire bytes of a float tensor of any shape (flattened, as float32). ValueError on NaN/inf."""
    flat = x.detach().to(torch.float32).reshape(-1).contiguous()
    return encode(flat, mode)


def wire_size(mode: Compression, shape: tuple[int, ...]) -> int:
    return encoded_size(mode, numel(shape))


def decode_tensor(
    buf: bytes | memoryview, mode: Compression, shape: tuple[int, ...], max_abs: float, what: str
) -> torch.Tensor:
    """The tensor of ``shape`` in ``buf``, checked (see the module docstring)."""
    n = numel(shape)
    if not 0 < n <= MAX_ELEMENTS:
        raise RemoteProtocolError(f"{what}: {n} values is out of bounds")
    try:
        flat = decode(buf, mode, n)
    except RemoteProtocolError as e:
        raise RemoteProtocolError(f"{what}: {e}") from None
    if flat.numel():
        lo, hi = (float(v) for v in torch.aminmax(flat))
        if max(-lo, hi) > max_abs:
            raise RemoteProtocolError(f"{what} holds a value of magnitude {max(-lo, hi):.3g} > {max_abs:g}")
    return flat.view(shape)


def encode_tokens(idx: torch.Tensor) -> bytes:
    return idx.to(torch.int32).contiguous().numpy().astype("<i4", copy=False).tobytes()


def decode_tokens(buf: bytes | memoryview, shape: tuple[int, ...], vocab: int, what: str) -> torch.Tensor:
    n = numel(shape)
    raw = memoryview(buf).cast("B")
    if len(raw) != 4 * n:
        raise RemoteProtocolError(f"{what}: {len(raw)} bytes for {n} token ids, expected {4 * n}")
    ids = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64)).view(shape)
    if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise RemoteProtocolError(f"{what} holds token ids outside [0, {vocab})")
    return ids


def tolerance(a: torch.Tensor, mode: Compression) -> float:
    """How far an honest peer's answer may lie from ``a``, another honest peer's answer to the same
    input with the same weights (see the module docstring)."""
    m = float(a.abs().max()) if a.numel() else 0.0
    return 2 * error_bound(a.reshape(-1).to(torch.float32), mode) + 1e-4 * m + 1e-6


def agree(a: torch.Tensor, b: torch.Tensor, mode: Compression) -> bool:
    """Whether two answers to one micro-batch agree within :func:`tolerance`."""
    if a.shape != b.shape:
        return False
    return float((a - b).abs().max()) <= tolerance(a, mode) if a.numel() else True
