"""Activations, their gradients and token ids on the wire, and the checks every one of them passes.

Theory of operation: a tensor travels as the bytes of ``averaging.compression`` (raw float32, fp16,
bf16, or blockwise int8: one float32 scale per 1024 values, about a quarter of float32's bytes), beside
a header that gives its shape. int8 of an activation or its gradient (a tensor of 2 or more dimensions)
takes one float32 scale per row of its last dimension (one token's vector) instead of the all-reduce's
one per 1024 values: with a block of 1024 values (16 tokens at width 64) one token's large values set the
scale of its neighbours, whose small values then quantized to nearly constant vectors, and the next
LayerNorm (which divides by a vector's spread) turned their error into gradients 10-400x the honest
ones (measured, after 8 steps of the ``pipeline`` benchmark: they broke the stage averages' bounds and
forked two stages). Per row costs 4 bytes per token more (6% at width 64, 0.5% at 768).

A value rounds to the nearest point of its row's grid (:class:`Rounding`), or, with ``pipeline.rounding
= "stochastic"``, to one of the two points around it at random, so that the decoded value's mean is the
value (unbiased). Nearest is the default: measured over five seeds at 40 steps of the ``pipeline``
benchmark (``bench_pipeline_rounding``) it shows no bias against data-parallel, and stochastic rounding
trains worse (most of a row's values lie far below its step: nearest sends them as 0, stochastic
rounding as a whole step now and then, far more noise). The wire format, and so every check of
:func:`decode_tensor`, is the same either way.

Whatever arrives is hostile until checked: :func:`decode_tensor` takes the shape the *receiver*
expects (never the one the sender claims), refuses bytes that are not the exact encoded size of that
shape, values that are NaN or infinite, and values beyond ``max_abs``; it raises
:class:`RemoteProtocolError` with the reason, so the caller drops the peer that sent it. Token ids
travel as little-endian int32 and must lie in ``[0, vocab)``.

:class:`Wire` is what a run's ``[pipeline]`` sends: the compression alone, or with ``rank`` r > 0 a
low-rank code (PowerSGD's and Pluralis' idea for activations): a boundary tensor of shape (..., C) is
taken as the matrix of its n = B*T rows by C columns, truncated to its r largest singular values, and
sent as two factors, ``U sqrt(S)`` (n x r) then ``sqrt(S) V^T`` (r x C), each coded with the
compression; the receiver multiplies them back. Its size follows from the shape alone (r*(n + C) values
instead of n*C: at r = 8, C = 64, about 8x fewer), each factor and the product are checked as above,
and the error is the truncation's (what the singular values past r held) plus the compression's.

:func:`tolerance` is how far two honest peers' answers to the same micro-batch may differ: each was
quantized once, so twice the compression's bound, plus a small relative slack for hardware that does
not compute bit for bit alike.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass

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


def _per_row(mode: Compression, shape: tuple[int, ...]) -> bool:
    """int8 of a tensor of 2 or more dimensions goes with one scale per row (its last dimension)."""
    return mode is Compression.INT8 and len(shape) >= 2 and shape[-1] > 0


class Rounding(enum.StrEnum):
    """How int8 of an activation or its gradient rounds a value to its row's grid (see the module
    docstring): to the nearest point, or to one of the two around it at random, with the probability
    that makes the decoded value's mean the value itself (unbiased)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


# The noise of stochastic rounding: a generator of its own, so that encoding does not move torch's
# global one (which builds models and draws data); seeded from the system unless a benchmark reseeds it.
_noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def seed_rounding(seed: int) -> None:
    """Make stochastic rounding's draws repeat (benchmarks that compare runs seed by seed)."""
    _noise.manual_seed(seed)


def encode_tensor(
    x: torch.Tensor, mode: Compression, rounding: Rounding = Rounding.NEAREST
) -> bytes | memoryview:
    """The wire bytes of a float tensor of any shape (as float32). ValueError on NaN/inf. ``rounding``
    applies to int8 with one scale per row (tensors of 2 or more dimensions)."""
    values = x.detach().to(torch.float32)
    if _per_row(mode, tuple(x.shape)):
        return _encode_rows(values.reshape(-1, x.shape[-1]), rounding)
    return encode(values.reshape(-1).contiguous(), mode)


def wire_size(mode: Compression, shape: tuple[int, ...]) -> int:
    if _per_row(mode, shape):
        return 4 * (numel(shape) // shape[-1]) + numel(shape)
    return encoded_size(mode, numel(shape))


def _encode_rows(m: torch.Tensor, rounding: Rounding = Rounding.NEAREST) -> bytes:
    """int8 with one float32 scale per row (``absmax / 127``; a row of zeros: scale 0): all the scales,
    then the int8 values, little-endian. Stochastic: ``v = x / scale`` goes to ``floor(v) + 1`` with
    probability ``v - floor(v)`` (exact in float32), else to ``floor(v)``: the mean is ``v``."""
    absmax = m.abs().amax(dim=1) if m.numel() else torch.zeros(m.shape[0])
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("cannot encode a tensor that holds NaN or infinite values")
    scale = absmax / 127.0
    # near float32's max, absmax / 127 can round up so that decoding's scale * 127 overflows (and the
    # decoder refuses it): step such scales down one ulp; the clamp below absorbs the tiny excess
    scale = torch.where(torch.isinf(scale * 127), torch.nextafter(scale, torch.zeros_like(scale)), scale)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = torch.div(m, divisor[:, None])
    if rounding is Rounding.STOCHASTIC:
        low = v.floor()
        up = torch.rand(v.shape, generator=_noise) < (v - low)
        v = low.add_(up)
    else:
        v = v.round_()
    # (|v| <= 127 but for float rounding at a row's largest value: the clamp keeps it on the grid)
    q = v.clamp_(-127, 127).to(torch.int8)
    return scale.numpy().astype("<f4", copy=False).tobytes() + q.numpy().tobytes()


def _decode_rows(buf: bytes | memoryview, rows: int, cols: int, what: str) -> torch.Tensor:
    raw = memoryview(buf).cast("B")
    if len(raw) != 4 * rows + rows * cols:
        raise RemoteProtocolError(f"{what}: {len(raw)} bytes, expected {4 * rows + rows * cols}")
    scales = torch.from_numpy(np.frombuffer(raw[: 4 * rows], dtype="<f4").astype(np.float32))
    # scale * 127 is exactly the largest product decoding computes: finite there means finite everywhere
    if not bool(((scales >= 0) & torch.isfinite(scales * 127)).all()):  # NaN fails both tests
        raise RemoteProtocolError(f"{what}: an int8 row has a negative, non-finite or oversized scale")
    q = torch.from_numpy(np.frombuffer(raw[4 * rows :], dtype=np.int8).copy()).view(rows, cols)
    if q.numel() and int(q.min()) < -127:
        raise RemoteProtocolError(f"{what}: an int8 value is -128, outside the symmetric range [-127, 127]")
    return q.to(torch.float32).mul_(scales[:, None])


def decode_tensor(
    buf: bytes | memoryview, mode: Compression, shape: tuple[int, ...], max_abs: float, what: str
) -> torch.Tensor:
    """The tensor of ``shape`` in ``buf``, checked (see the module docstring)."""
    n = numel(shape)
    if not 0 < n <= MAX_ELEMENTS:
        raise RemoteProtocolError(f"{what}: {n} values is out of bounds")
    if _per_row(mode, shape):
        flat = _decode_rows(buf, n // shape[-1], shape[-1], what).view(-1)
    else:
        try:
            flat = decode(buf, mode, n)
        except RemoteProtocolError as e:
            raise RemoteProtocolError(f"{what}: {e}") from None
    if flat.numel():
        lo, hi = (float(v) for v in torch.aminmax(flat))
        if max(-lo, hi) > max_abs:
            raise RemoteProtocolError(f"{what} holds a value of magnitude {max(-lo, hi):.3g} > {max_abs:g}")
    return flat.view(shape)


EXACT_SVD = 512  # matrices whose smaller side is at most this are factored exactly; larger: randomized


@dataclass(frozen=True)
class Wire:
    """How activations and their gradients travel (see the module docstring): ``mode`` for every value,
    and with ``rank`` > 0 as two low-rank factors."""

    mode: Compression
    rank: int = 0
    rounding: Rounding = Rounding.NEAREST  # int8 per row only (the low-rank factors round to nearest)

    @property
    def name(self) -> str:
        """What a request's ``compression`` field says (a server refuses any other)."""
        return self.mode.value if not self.rank else f"{self.mode.value}+r{self.rank}"

    def _dims(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """``(rows, columns, rank)`` of the low-rank code of ``shape``; None: sent whole."""
        if not self.rank or len(shape) < 2:
            return None
        c = shape[-1]
        n = numel(shape) // c if c else 0
        return n, c, min(self.rank, n, c)

    def size(self, shape: tuple[int, ...]) -> int:
        dims = self._dims(shape)
        if dims is None:
            return wire_size(self.mode, shape)
        n, c, r = dims
        return encoded_size(self.mode, n * r) + encoded_size(self.mode, r * c)

    def encode(self, x: torch.Tensor) -> bytes | memoryview:
        dims = self._dims(tuple(x.shape))
        if dims is None:
            return encode_tensor(x, self.mode, self.rounding)
        n, c, r = dims
        a, b = factor(x.detach().to(torch.float32).reshape(n, c), r)
        # (the factors as flat vectors: int8 in blocks of 1024, not per row: a row of the left factor
        # has only r values, and a scale per r values would cost more than the factor's bytes save)
        return bytes(encode_tensor(a.reshape(-1), self.mode)) + bytes(encode_tensor(b.reshape(-1), self.mode))

    def decode(
        self, buf: bytes | memoryview, shape: tuple[int, ...], max_abs: float, what: str
    ) -> torch.Tensor:
        """The tensor of ``shape`` in ``buf``, checked: each factor as :func:`decode_tensor` checks a
        tensor, then the product (its values within ``max_abs``)."""
        dims = self._dims(shape)
        if dims is None:
            return decode_tensor(buf, self.mode, shape, max_abs, what)
        n, c, r = dims
        view = memoryview(buf).cast("B")
        if len(view) != self.size(shape):
            raise RemoteProtocolError(f"{what}: {len(view)} bytes, expected {self.size(shape)}")
        if not 0 < n * c <= MAX_ELEMENTS:
            raise RemoteProtocolError(f"{what}: {n * c} values is out of bounds")
        split = encoded_size(self.mode, n * r)
        a = decode_tensor(view[:split], self.mode, (n * r,), max_abs, f"{what}'s left factor").view(n, r)
        b = decode_tensor(view[split:], self.mode, (r * c,), max_abs, f"{what}'s right factor").view(r, c)
        out = a @ b
        if not bool(torch.isfinite(out).all()):
            raise RemoteProtocolError(f"{what}: its factors multiply to values that are not finite")
        peak = float(out.abs().max()) if out.numel() else 0.0
        if peak > max_abs:
            raise RemoteProtocolError(f"{what} holds a value of magnitude {peak:.3g} > {max_abs:g}")
        return out.view(shape)

    def agree(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether two honest peers' decoded answers to one micro-batch agree: :func:`agree` for the
        compression alone; with a rank, within ``LOWRANK_SLACK`` of the answer's largest value (the
        truncations of two nearly equal matrices differ where their singular values r and r+1 are
        close: a coarser check, see docs/pipeline.md)."""
        if not self.rank:
            return agree(a, b, self.mode, self.rounding)
        if a.shape != b.shape:
            return False
        if not a.numel():
            return True
        return float((a - b).abs().max()) <= LOWRANK_SLACK * float(a.abs().max()) + tolerance(a, self.mode)


LOWRANK_SLACK = 0.05


def factor(m: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U sqrt(S), sqrt(S) V^T)`` of the rank-``r`` truncation of the matrix ``m`` (n x C): exact SVD
    for matrices up to ``EXACT_SVD`` on their smaller side (the same on every peer for the same input),
    a randomized one (``torch.svd_lowrank``, 2 power iterations) for larger ones."""
    if min(m.shape) <= EXACT_SVD:
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        u, s, vh = u[:, :r], s[:r], vh[:r]
    else:
        u, s, v = torch.svd_lowrank(m, q=min(r + 8, *m.shape), niter=2)
        u, s, vh = u[:, :r], s[:r], v[:, :r].T
    root = s.clamp_min(0).sqrt()
    return (u * root).contiguous(), (root[:, None] * vh).contiguous()


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


def tolerance(a: torch.Tensor, mode: Compression, rounding: Rounding = Rounding.NEAREST) -> float:
    """How far an honest peer's answer may lie from ``a``, another honest peer's answer to the same
    input with the same weights (see the module docstring). Stochastic rounding moves a value by up to
    one step of its row's grid, not half of one: twice the bound of rounding to nearest."""
    m = float(a.abs().max()) if a.numel() else 0.0
    times = 4 if rounding is Rounding.STOCHASTIC and mode is Compression.INT8 else 2
    return times * error_bound(a.reshape(-1).to(torch.float32), mode) + 1e-4 * m + 1e-6


def agree(a: torch.Tensor, b: torch.Tensor, mode: Compression, rounding: Rounding = Rounding.NEAREST) -> bool:
    """Whether two answers to one micro-batch agree within :func:`tolerance`."""
    if a.shape != b.shape:
        return False
    return float((a - b).abs().max()) <= tolerance(a, mode, rounding) if a.numel() else True
