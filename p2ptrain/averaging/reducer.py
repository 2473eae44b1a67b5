"""One partition's reduction: accumulate slices as their chunks arrive, then the mean over the decision.

Theory of operation: chunks are added into a float32 accumulator the moment they arrive (weight times
value, multiply and add rounded separately, so the arithmetic is reproducible). The received chunks are
also kept until the decision (small partitions keep the frames' own buffers, large ones write them to a
spill file, see ``spill``): when it leaves out a sender
that had already sent part of its slice, or one that completed it, the reducer recomputes the sum over the
decided contributors alone, in member order. Only this reducer computes its partition's result, so every
member that fetches it gets the same bits, whatever order chunks arrived in.

The result is encoded once with the round's compression and served as those bytes; the reducer's own copy
is decoded from them, so with a lossy compression it holds exactly what the others decode.

A slice larger than the reducer accepts against its own values (``bounds``: the limit each member also
holds results to) is refused chunk by chunk before it is added (:class:`SliceOutOfBounds`): its sender
is left out of the round, and an honest reducer's mean stays within the bound of its own values, so a
contributor sending huge values cannot make the members refuse an honest reducer's result.

With a robust aggregation rule (see ``robust``) the kept slices of the decided contributors are stacked in
member order at the decision and the rule is applied to them instead of the running sum.

At the decision, before the kept slices go, the reducer judges each decided contributor's slice (see
``trust.useful``: finite, positive weight, a norm that is not negligible, aligned with the others): one
pass over the kept chunks builds their Gram matrix. ``verdicts`` holds the judgement; the round names
the contributors every partition reduced here found useful, and only those can earn this member's trust.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import RemoteProtocolError
from .bounds import Limit, ResultCheck, Scale, widened
from .compression import Compression, accumulate, all_finite, decode, encode, encoded_size
from .partition import chunks
from .robust import aggregate, by_origin, outliers
from .spill import SPILL_BYTES, Spilled, SpillFile
from .trust import Verdict, gram, useful

log = logging.getLogger(__name__)


class SliceOutOfBounds(RemoteProtocolError):
    """A contributor's slice is larger than this reducer accepts against its own values (``bounds``)."""


class PartitionReducer:
    """Accumulates the slices of one partition from the members of a round."""

    def __init__(
        self,
        size: int,
        mode: Compression,
        buffer: torch.Tensor | None = None,
        aggregation: str = "mean",
        *,
        members: int = 0,
        origins: Sequence[int] = (),
        canonical: bool = False,
        spill: bool | None = None,
        bound: Limit | None = None,
        prior: torch.Tensor | None = None,
    ) -> None:
        """``buffer``: ``size`` float32 elements to accumulate in (reused memory; whatever it holds is
        overwritten by the first slice added).
        ``members``: the group's size; the result is encoded as a sum of that many (``compression.encode``).
        ``origins``: robust rules: the manifest's origin of each member (() : each its own; see
        ``robust.by_origin``).
        ``canonical``: always sum in member order at the end (an auditor can then redo it bit for bit),
        not in the order chunks happened to arrive.
        ``spill``: keep received chunks in a spill file rather than in memory (default: for partitions
        of ``SPILL_BYTES`` or more).
        ``bound``: the most a contributor's slice may be (``bounds.limit`` of this reducer's own values);
        None: unchecked.
        ``prior``: this member's last accepted result of the partition (``size`` elements, any float
        dtype; None: none at hand): a slice must carry useful work beyond it (``trust.useful``)."""
        if prior is not None and prior.numel() != size:
            raise ValueError(f"the prior result must hold {size} elements, not {prior.numel()}")
        self.size = size
        self.prior = prior
        self.bound = bound
        self._checks: dict[int, ResultCheck] = {}  # sender -> its slice's check so far
        self.claims: dict[int, bytes] = {}  # sender -> the tag of its signed scales (``bounds.ScaleTable``)
        self.claimed: dict[int, tuple[Scale, float]] = {}  # sender -> that scale, and the weight it sent
        self.scales: tuple[bytes, ...] = ()  # finalized: the decided contributors' table tags, in order
        self.mode = mode
        self.members = members
        self.aggregation = aggregation
        self.origins = tuple(origins)
        self.canonical = canonical
        self.spans = list(chunks(size, mode))
        if buffer is not None and (buffer.numel() != size or buffer.dtype != torch.float32):
            raise ValueError(f"the accumulator must hold {size} float32 elements")
        self.acc = torch.zeros(size, dtype=torch.float32) if buffer is None else buffer
        self.touched: set[int] = set()  # senders with anything in ``acc``
        self.delivered: dict[int, float] = {}  # sender -> weight, for complete slices
        self._kept: dict[int, list[torch.Tensor | memoryview | Spilled | _Local]] = {}
        self._spill = SpillFile() if (size * 4 >= SPILL_BYTES if spill is None else spill) else None
        self.result: torch.Tensor | None = None
        # ``finalize`` runs (in a worker thread for a large partition): nothing is added meanwhile
        self.finalizing = False
        self.encoded: list[bytes | memoryview] | None = None
        self.commits: dict[int, bytes] = {}  # audited rounds: sender -> its signed commitment
        self.attestation = b""  # audited rounds: this reducer's signed attestation of its result
        self.outliers: list[tuple[int, float]] = []  # robust rules: senders far from the result (see robust)
        self.verdicts: dict[int, Verdict] = {}  # decided contributor -> was its slice useful work (trust)
        # Early results (see expect): chunks of the mean published before the decision.
        self._expected: tuple[int, ...] | None = None
        self._counts: dict[int, int] = {}  # sender -> chunks of its slice added so far
        self._weights: dict[int, float] = {}  # sender -> the weight it sent with its slice
        self._total = 0.0
        self._divided = 0  # chunks of ``acc`` divided in place (published early): a sum no longer
        self.early: list[bytes | memoryview] | None = None  # encoded mean chunks published so far
        self.early_final: bool | None = None  # set by finalize: are the early chunks the result?

    def bound_sender(self, sender: int, claim: Scale, tag: bytes, weight: float) -> None:
        """``sender``'s slice must stay within its signed scale ``claim`` (``tag``: of the table it signed
        it in; decoded with the round's compression, ``bounds.widened``); set before its first chunk."""
        self._checks[sender] = ResultCheck(widened(claim, self.mode))
        self.claims[sender] = tag
        self.claimed[sender] = (claim, weight)

    def chunk_bytes(self, index: int) -> int:
        a, b = self.spans[index]
        return encoded_size(self.mode, b - a)

    def add_local(
        self, sender: int, values: torch.Tensor, weight: float, kept: Spilled | None = None
    ) -> None:
        """The reducer's own slice: uncompressed, never on the wire. ``kept``: a copy of ``values`` in a
        spill file (raw float32), to recompute from: then ``values`` may be ``acc`` itself."""
        if values.numel() != self.size:
            raise ValueError("a slice must cover the whole partition")
        if not all_finite(values):  # refused as any other sender's would be: it is left out
            log.warning("this member's own slice holds NaN or infinite values: it reduces without it")
            return
        if self.touched:
            self.acc.add_(values * weight)
        else:  # the first slice: no temporary the size of the partition
            torch.mul(values, weight, out=self.acc)
        self.touched.add(sender)
        self._kept[sender] = [values if kept is None else _Local(kept)]
        self.delivered[sender] = weight
        self._counts[sender], self._weights[sender] = len(self.spans), weight
        self._advance()

    def expect(self, senders: Sequence[int]) -> None:
        """Publish the mean chunk by chunk, before any decision (plain means only): chunk k goes to
        ``early`` once every one of ``senders`` has sent chunk k, divided by the sum of their weights.
        Those chunks are the result only if the decision names exactly these senders with the weights
        they sent; ``finalize`` says so in ``early_final`` (else it recomputes, and the early chunks are
        void). No chunk can change once published: each sender sends each chunk once, in order."""
        if self.aggregation != "mean" or self.canonical:
            return
        self._expected = tuple(sorted(senders))
        self.early = []
        self._advance()

    def add_chunk(self, sender: int, index: int, data: memoryview, weight: float) -> bool:
        """Chunk ``index`` of ``sender``'s slice; raises RemoteProtocolError if it is malformed.
        Returns whether early chunks were published (see expect)."""
        if not 0 <= index < len(self.spans) or index != self._counts.get(sender, 0):
            raise RemoteProtocolError("a chunk out of order, or more chunks than the partition has")
        a, b = self.spans[index]
        if len(data) != encoded_size(self.mode, b - a):
            raise RemoteProtocolError(
                f"chunk {index} has {len(data)} bytes, expected {self.chunk_bytes(index)}"
            )
        if not self.touched:  # the first slice adds to zeros (add_local writes its product instead)
            self.acc.zero_()
        check = self._checks.get(sender)
        if check is None and self.bound is not None:
            check = self._checks[sender] = ResultCheck(self.bound)
        self._add(index, data, weight, check)
        self.touched.add(sender)
        self._kept.setdefault(sender, []).append(self._keep(data))
        self._counts[sender], self._weights[sender] = index + 1, weight
        return self._advance()

    def keep_own_copy(self, sender: int) -> None:
        """Keep a copy of the slices ``sender`` handed over in place (this member's own), so that what
        the reducer holds no longer changes with the sender's tensors (fault injection changes them)."""
        kept = self._kept.get(sender)
        if kept:
            self._kept[sender] = [t.clone() if isinstance(t, torch.Tensor) else t for t in kept]

    def _advance(self) -> bool:
        """Publish the early chunks every expected sender has now sent; True if there were any."""
        if self._expected is None or self.early is None or self.result is not None:
            return False
        ready = min(self._counts.get(i, 0) for i in self._expected)
        if ready <= len(self.early):
            return False
        if len(self.early) == 0:  # summed in member order, as finalize sums the decision's weights
            self._total = sum(self._weights[i] for i in self._expected)
        for a, b in self.spans[len(self.early) : ready]:
            mean = self.acc[a:b].div_(self._total)
            self._divided += 1
            if not all_finite(mean):  # (its own values changed under it, in place): none published
                self.early = None
                return True
            if self.mode is Compression.NONE:
                self.early.append(_view(mean))
                continue
            try:
                self.early.append(encode(mean, self.mode, self.members))
            except ValueError:  # the sum overflowed: no early results (finalize decides what happens)
                self.early = None
                return True
        return True

    @property
    def ready(self) -> int:
        """How many early chunks are published."""
        return 0 if self.early is None else len(self.early)

    def _add(self, index: int, data: memoryview, weight: float, check: ResultCheck | None = None) -> None:
        """Add a well-sized chunk's values times ``weight``; nothing is added if any value is bad, or
        (``check``) beyond the bound."""
        a, b = self.spans[index]
        if self.mode is Compression.NONE and len(data):  # straight from the frame: no decoded copy
            values = torch.frombuffer(data, dtype=torch.float32)
            if not all_finite(values):
                raise RemoteProtocolError("a slice holds NaN or infinite values")
            _bounded(check, values)
            self.acc[a:b].add_(values if weight == 1.0 else values * weight)
        elif check is None:
            accumulate(self.acc[a:b], data, self.mode, weight)
        else:  # (as ``accumulate``: a rounded multiply, then a rounded add)
            decoded = decode(data, self.mode, b - a)
            _bounded(check, decoded)
            decoded.mul_(weight)
            self.acc[a:b].add_(decoded)

    def _keep(self, data: memoryview) -> memoryview | Spilled:
        if self._spill is None or self._spill.closed:  # (closed: the result is out, nothing reads it)
            return data
        try:
            return self._spill.put(data)
        except OSError as e:  # (a full disk): kept in memory from now on
            log.warning("cannot spill received chunks (%s): keeping them in memory", e)
            self._spill.close()
            self._spill = None
            return data

    def complete(self, sender: int, weight: float) -> None:
        self.delivered[sender] = weight

    def finalize(self, contributors: Sequence[int], weights: Sequence[float]) -> torch.Tensor:
        """The weighted mean over exactly ``contributors``; returns the values every member will hold."""
        missing = [i for i in contributors if i not in self.delivered]
        if missing:
            raise ValueError(f"no complete slice from members {missing}")
        self.scales = tuple(self.claims.get(i, b"") for i in contributors)
        if self.aggregation != "mean":
            rows = torch.stack([self._slice_of(i) for i in contributors])
            g = gram([*rows, self.prior.float()] if self.prior is not None else rows)
            labels = [self.origins[i] if self.origins else i for i in contributors]
            rows, groups = by_origin(rows, labels)
            self.acc.copy_(aggregate(self.aggregation, rows))
            self.outliers = [
                (contributors[k], ratio) for row, ratio in outliers(rows, self.acc) for k in groups[row]
            ]
            self._judge(contributors, weights, g)
            del rows
            return self._publish(self.acc)
        self._judge(contributors, weights, self._gram(contributors))
        if self._expected is not None:
            self.early_final = (
                self.early is not None
                and len(self.early) == len(self.spans)
                and tuple(contributors) == self._expected
                and all(
                    self._weights[i] == self.delivered[i] == w
                    for i, w in zip(contributors, weights, strict=True)
                )
                and sum(weights) == self._total
            )
            if self.early_final:  # the chunks already published are the mean: acc holds them too
                assert self.early is not None
                self._forget()
                self.encoded = self.early
                self.result = self.acc if self.mode is Compression.NONE else self._decode_into_acc(self.early)
                return self.result
        streamed = all(self.delivered[i] == w for i, w in zip(contributors, weights, strict=True))
        # (not finite: values summed in place changed under it; the kept slices were checked on arrival)
        if (
            self.canonical
            or self.touched != set(contributors)
            or not streamed
            or self._divided
            or not all_finite(self.acc)
        ):
            self.acc.zero_()
            for i, w in zip(contributors, weights, strict=True):
                self._replay(i, w)
        return self._publish(self.acc.div_(sum(weights)))

    def _gram(self, contributors: Sequence[int]) -> torch.Tensor:
        """The Gram matrix of the kept slices of ``contributors``, chunk by chunk (no partition-sized
        temporary per contributor)."""
        k = len(contributors) + (self.prior is not None)  # (the prior result's row last)
        g = torch.zeros(k, k, dtype=torch.float64)
        if not contributors:
            return g
        for index, (a, b) in enumerate(self.spans):
            rows = [self._chunk_of(i, index, a, b) for i in contributors]
            if self.prior is not None:
                rows.append(self.prior[a:b].float())
            g += gram(rows)
        return g

    def _chunk_of(self, sender: int, index: int, a: int, b: int) -> torch.Tensor:
        kept = self._kept[sender]
        if len(kept) == 1 and isinstance(kept[0], torch.Tensor | _Local):
            own = kept[0]
            if isinstance(own, _Local):
                part = own.spilled
                return torch.frombuffer(part.file.read(part.offset + 4 * a, 4 * (b - a)), dtype=torch.float32)
            return own[a:b]
        return decode(_bytes(kept[index]), self.mode, b - a, checked=True)  # (checked on arrival)

    def _judge(self, contributors: Sequence[int], weights: Sequence[float], g: torch.Tensor) -> None:
        """``verdicts`` for ``contributors`` (see ``trust.useful``); a slice the robust rule bounded
        as an outlier is no useful work either."""
        if not self.size:
            self.verdicts = {i: Verdict(False, "an empty partition") for i in contributors}
            return
        labels = [self.origins[i] for i in contributors] if self.origins else ()
        verdicts = useful(g, weights, self.size, labels, prior=self.prior is not None)
        self.verdicts = dict(zip(contributors, verdicts, strict=True))
        for sender, _ in self.outliers:
            self.verdicts[sender] = Verdict(False, "an outlier the robust rule bounded")

    def _forget(self) -> None:
        """Drop the kept slices (the result is computed: nothing reads them again)."""
        self._kept.clear()
        if self._spill is not None:
            self._spill.close()

    def _publish(self, mean: torch.Tensor) -> torch.Tensor:
        self._forget()
        if self.mode is Compression.NONE:
            self.result = mean
            self.encoded = [_view(mean[a:b]) for a, b in self.spans]
        else:
            self.encoded = [
                bytes(encode(mean[a:b].contiguous(), self.mode, self.members)) for a, b in self.spans
            ]
            self.result = self._decode_into_acc(self.encoded)
        return self.result

    def _decode_into_acc(self, encoded: Sequence[bytes | memoryview]) -> torch.Tensor:
        """``acc`` set to the values members hold after decoding ``encoded`` (the compressed mean), chunk
        by chunk: no second buffer the size of the partition."""
        for e, (a, b) in zip(encoded, self.spans, strict=True):
            self.acc[a:b].copy_(decode(e, self.mode, b - a, self.members))
        return self.acc

    def _slice_of(self, sender: int) -> torch.Tensor:
        """A sender's whole slice as float32 (its kept chunks decoded; they were checked on arrival)."""
        kept = self._kept[sender]
        if len(kept) == 1 and isinstance(kept[0], torch.Tensor | _Local):
            return _values(kept[0]).to(torch.float32)
        parts = []
        for (a, b), data in zip(self.spans, kept, strict=True):
            parts.append(decode(_bytes(data), self.mode, b - a))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)

    def _replay(self, sender: int, weight: float) -> None:
        kept = self._kept[sender]
        if len(kept) == 1 and isinstance(kept[0], torch.Tensor | _Local):
            own = kept[0]
            for a, b in self.spans:  # chunk by chunk: no partition-sized temporary
                if isinstance(own, _Local):
                    part = own.spilled
                    values = torch.frombuffer(
                        part.file.read(part.offset + 4 * a, 4 * (b - a)), dtype=torch.float32
                    )
                else:
                    values = own[a:b]
                self.acc[a:b].add_(values * weight)
            return
        for index, data in enumerate(kept):
            self._add(index, _bytes(data), weight)

    def drop(self) -> None:
        """Free the buffers (the round ended)."""
        self._forget()
        self.encoded = None
        self.result = None
        self.early = None


def _bounded(check: ResultCheck | None, values: torch.Tensor) -> None:
    why = "" if check is None else check.add(values)
    if why:
        raise SliceOutOfBounds(why.replace("its result", "the slice"))


@dataclass(frozen=True)
class _Local:
    """The reducer's own slice, kept in a spill file as raw float32."""

    spilled: Spilled


def _values(kept: torch.Tensor | _Local) -> torch.Tensor:
    if isinstance(kept, _Local):
        return torch.frombuffer(kept.spilled.read(), dtype=torch.float32)
    return kept


def _bytes(data: torch.Tensor | memoryview | Spilled | _Local) -> memoryview:
    """A kept chunk's bytes (read back from the spill file if it went there)."""
    if isinstance(data, Spilled):
        return memoryview(data.read())
    assert isinstance(data, memoryview)
    return data


def _view(t: torch.Tensor) -> memoryview:
    return t.view(torch.uint8).numpy().data  # zero-copy bytes of a contiguous float32 slice
