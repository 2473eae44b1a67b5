"""Who reduces which part of the flattened tensors, and how the parts travel in chunks.

Theory of operation: the tensors of a round are flattened into one float32 vector of ``total`` elements
and cut into one contiguous partition per member, in member order. A member's partition is proportional
to its bandwidth, because in a butterfly all-reduce a reducer receives its partition from every other
member and sends the result back to each: its traffic grows with its share, so the slowest link should
carry the least. A client-only member (nobody can dial it) reduces nothing: its partition is empty, but
it still sends its slices to the reducers and fetches the results.

Partitions are streamed in chunks whose element counts follow from the partition's size and the round's
compression alone, so sender and receiver agree on every chunk's size without telling each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from ..net.channel import MAX_CHUNK
from .compression import Compression, chunk_elements, encoded_size


def partition_sizes(
    total: int, bandwidths: Sequence[float], reducers: Sequence[bool], align: int = 1
) -> list[int]:
    """Split ``total`` elements in proportion to the bandwidth of the members that reduce.

    Largest-remainder rounding: the sizes sum to ``total`` exactly and each is within one element (one
    ``align``-element unit) of its exact share; with ``align``, every partition starts on a multiple of
    it (the last one with elements ends at ``total``). Raises ValueError when nobody can reduce or a
    bandwidth is not a positive finite number.
    """
    if align > 1:
        units = partition_sizes(-(-total // align), bandwidths, reducers)
        sizes = [u * align for u in units]
        last = max(i for i, s in enumerate(sizes) if s) if total else 0
        sizes[last] -= sum(sizes) - total
        return sizes
    if len(bandwidths) != len(reducers):
        raise ValueError("one bandwidth per member")
    if total < 0:
        raise ValueError("total must be non-negative")
    for bw, red in zip(bandwidths, reducers, strict=True):
        if red and not (math.isfinite(bw) and bw > 0):
            raise ValueError(f"a reducer's bandwidth must be positive and finite, not {bw!r}")
    weights = [bw if red else 0.0 for bw, red in zip(bandwidths, reducers, strict=True)]
    norm = sum(weights)
    if norm <= 0:
        raise ValueError("at least one member must be able to reduce (accept connections)")
    exact = [total * w / norm for w in weights]
    sizes = [math.floor(x) for x in exact]
    short = total - sum(sizes)
    # hand the remaining elements to the largest fractional parts (ties: lower index), reducers only
    order = sorted((i for i in range(len(sizes)) if weights[i] > 0), key=lambda i: (sizes[i] - exact[i], i))
    for i in order[:short]:
        sizes[i] += 1
    return sizes


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each partition in the flat vector (plus the end, as a last element)."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def chunk_size(mode: Compression) -> int:
    """Elements per chunk: one chunk is one frame of at most ``MAX_CHUNK`` bytes on the wire."""
    n = chunk_elements(mode, MAX_CHUNK)
    step = max(1, n // 64)
    while n > step and encoded_size(mode, n) > MAX_CHUNK:
        n -= step
    return n


def chunks(size: int, mode: Compression) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each chunk of a partition of ``size`` elements."""
    step = chunk_size(mode)
    for start in range(0, size, step):
        yield start, min(size, start + step)


def wire_bytes(size: int, mode: Compression) -> int:
    """Bytes one partition of ``size`` elements takes on the wire."""
    return sum(encoded_size(mode, b - a) for a, b in chunks(size, mode))
