"""Where a member's values live during one round: what it sends, what it reduces, where averages land.

Theory of operation: the round works on one flat float32 vector, ``flat``, cut into the manifest's
partitions. A member sends its own values of each partition (``own``: from ``source``, which is
``flat`` itself unless the caller's contiguous tensor is sent from where it lies), reduces the
partitions it holds in :class:`~p2ptrain.averaging.reducer.PartitionReducer`\\ s (our own partition right
in ``flat`` where its mean goes, when nothing still needs to be sent from there), and receives every
average into ``flat`` (``slice``). In an audited round the encoded pieces it sends are kept, with its
signed commitment, for the audit after the round.

Bounds (see ``bounds``): before anything of the round lands, the size of this member's own values in
each partition is measured (:attr:`RoundTensors.own_scales`); a partition's result is accepted only within the
:class:`~p2ptrain.averaging.bounds.Limit` that gives (:meth:`RoundTensors.limit`), and the scale of each
accepted one is kept (:attr:`RoundTensors.results`) for the member's history.

In place (``backup`` given: ``flat`` is the caller's own tensor): own values that early averages overwrite
go to the backup file first, since a failed reducer's replacement needs them again. The memory is given
back (to the pool, or by closing the backup) only once the round retired and no handler still streams
from it (:meth:`RoundTensors.reading`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ..errors import RemoteProtocolError
from ..identity import Identity
from .audit import hash_pieces, seal_commit
from .bounds import (
    NOTHING,
    Limit,
    Scale,
    base,
    cap,
    limit,
    open_table,
    over_cap,
    result_limit,
    seal_table,
    table_tag,
    typical,
)
from .buffers import BufferPool
from .compression import Compression, encoded_chunk
from .partition import chunks, offsets
from .protocol import TAG_BYTES, Decision, Manifest
from .reducer import PartitionReducer
from .spill import Spilled, SpillFile


def partition_scales(source: torch.Tensor, sizes: Sequence[int]) -> list[Scale]:
    """The scale of each partition of ``source`` (partitions of ``sizes`` values, in order)."""
    at = offsets(list(sizes))
    return [Scale.of(source[at[p] : at[p + 1]]) for p in range(len(sizes))]


class RoundTensors:
    """The round's memory and the partitions reduced here (no I/O: the driver reads and writes it)."""

    def __init__(
        self,
        identity: Identity,
        manifest: Manifest,
        digest: bytes,
        me: int,
        weight: float,
        flat: torch.Tensor,
        tensors: list[torch.Tensor],
        *,
        pool: BufferPool | None = None,
        source: torch.Tensor | None = None,
        backup: SpillFile | None = None,
        own_saved: Spilled | None = None,
        history: Scale | None = None,
        prior: torch.Tensor | None = None,
        own_scales: list[Scale] | None = None,
    ) -> None:
        """``flat`` receives the averaged values (and holds this member's own values too unless
        ``source``, a flat float32 view of them, is given: then nothing of ``source`` is written).
        ``own_saved``: in place, this member's values of its own partition, already in ``backup``: the
        partition is then reduced right where its mean goes, in ``flat``. ``history``: the scale of this
        member's last accepted result of these tensors (bounds results where it sends only zeros);
        ``prior``: its values (the slices reduced here must carry work beyond them, see ``trust``);
        ``own_scales``: :func:`partition_scales` of ``source``, if measured already."""
        self.identity, self.digest, self.me, self.weight = identity, digest, me, weight
        self.mode = manifest.settings.mode
        self.aggregation = manifest.settings.aggregation
        self.origins = manifest.origins
        self.audit = manifest.audit
        self.n = len(manifest.members)
        self.peers = manifest.peers()
        self.signed_out = frozenset(manifest.out)
        self.sizes = list(manifest.sizes)
        self.offsets = offsets(self.sizes)
        self.pool = pool  # where ``flat`` and the accumulators go back once nothing reads them
        self.flat, self.tensors = flat, tensors
        self.source = flat if source is None else source
        self.backup = backup
        self.saved: dict[int, Spilled] = {}  # in place: partition -> own values overwritten by results
        if own_saved is not None:
            self.saved[me] = own_saved
        self.overwritten: set[int] = set()  # partitions whose early results overwrote our own values
        self.reducers: dict[int, PartitionReducer] = {}
        self.sent: dict[int, tuple[list[bytes], bytes]] = {}  # audited: partition -> (pieces, commitment)
        self.local: dict[int, bytes] = {}  # audited: partition reduced here -> own raw slice
        self._readers = 0  # handlers sending from ``flat`` or an accumulator right now
        self._retired = False
        self.released = False
        # Measured before anything is reduced or lands: nothing has written into ``source`` yet (the
        # caller may have measured them already, off the event loop: ``partition_scales``).
        self.own_scales = own_scales if own_scales is not None else partition_scales(self.source, self.sizes)
        if len(self.own_scales) != self.n:
            raise ValueError(f"{len(self.own_scales)} scales for {self.n} partitions")
        self.whole = Scale.total(self.own_scales)
        self.history = history
        self.prior = prior  # this member's last accepted result of these tensors (see ``trust.useful``)
        self.results: dict[int, Scale] = {}  # partition -> the scale of the result accepted here
        self.scales: dict[int, tuple[bytes, ...]] = {}  # partition held -> its contributors' table tags
        # Signed scale tables (``bounds.ScaleTable``), each opened once: member -> tag -> its scales
        # (normally one a member; another if it signed two, see ``bounds``), and tag -> the signed bytes
        self.tables: dict[int, dict[bytes, tuple[Scale, ...]]] = {}
        self.sealed: dict[bytes, bytes] = {}
        self._own_tag: bytes | None = None
        self._tables_asked: set[int] = set()  # members that asked this one for the round's tables

    def limit(self, p: int) -> Limit | None:
        """The most partition ``p``'s result may be for this member (None: nothing to bound it by)."""
        return limit(self.own_scales[p], self.whole, self.history)

    def own_table(self) -> tuple[bytes, bytes]:
        """This member's signed scales of its slices (measured before anything landed), and their tag."""
        if self._own_tag is None:
            sealed = seal_table(self.identity, self.digest, self.own_scales)
            self._own_tag = table_tag(sealed) if sealed else b""
            if sealed:
                self.sealed[self._own_tag] = sealed
                self.tables.setdefault(self.me, {})[self._own_tag] = tuple(self.own_scales)
        return self.sealed.get(self._own_tag, b""), self._own_tag

    def open_table(self, member: int, sealed: bytes | memoryview) -> tuple[bytes, tuple[Scale, ...]]:
        """The tag and scales of ``member``'s signed table ``sealed``, checked once (``bounds.open_table``:
        RemoteProtocolError if it is not exactly its own for this round)."""
        tag = table_tag(sealed)
        held = self.tables.get(member, {}).get(tag)
        if held is None:
            held = open_table(bytes(sealed), self.peers[member], self.digest, self.sizes)
            self.tables.setdefault(member, {})[tag] = held
            self.sealed[tag] = bytes(sealed)
        return tag, held

    def have(self) -> bytes:
        """The tags of the tables this member holds, one per member in the manifest's order (zeros for
        none): a fetch names them, and its server sends only the tables missing here."""
        none = bytes(TAG_BYTES)
        return b"".join(next(iter(self.tables.get(i, {})), none) for i in range(self.n))

    def lacks(self, contributors: Iterable[int]) -> bool:
        """Whether this member holds no signed table of some of ``contributors``."""
        return any(not self.tables.get(i) for i in contributors)

    def missing(self, tags: Sequence[bytes], contributors: Sequence[int], have: bytes) -> list[bytes]:
        """The signed tables among ``tags`` (of ``contributors``, in order) that a fetcher holding
        ``have`` (:meth:`have`) lacks: each is sent once, after the result."""
        out: dict[bytes, bytes] = {}
        for tag, i in zip(tags, contributors, strict=True):
            if tag in self.sealed and have[i * TAG_BYTES : (i + 1) * TAG_BYTES] != tag:
                out[tag] = self.sealed[tag]
        return list(out.values())

    def first_ask(self, member: int) -> bool:
        """Whether ``member`` asks this one for the round's signed tables (``TABLES``) for the first
        time. Each is answered once a round: an honest member asks each member at most once
        (``Gatherer.tables_for``), and answered again and again, a member could make this one send it up
        to n tables a call for as long as the round lasts."""
        if member in self._tables_asked:
            return False
        self._tables_asked.add(member)
        return True

    def take_tables(
        self, served: Sequence[bytes | memoryview], tags: Sequence[bytes], decision: Decision
    ) -> None:
        """Open the signed tables a fetch's server sent (``served``) for the decided contributors whose
        ``tags`` it named; RemoteProtocolError for one that is not the table of the contributor it names."""
        whose = dict(zip(tags, decision.contributors, strict=False))
        for sealed in served:
            i = whose.get(table_tag(sealed))
            if i is None:
                raise RemoteProtocolError("signed scales of no contributor the result names")
            self.open_table(i, sealed)

    def base(self, p: int) -> Limit | None:
        """This member's own size in partition ``p`` (``bounds.base``)."""
        return base(self.own_scales[p], self.whole, self.history)

    def cap_problem(self, p: int, sender: int, claims: dict[int, tuple[Scale, float]]) -> str:
        """Why ``sender``'s signed scale of ``p`` is beyond what this member, reducing ``p``, believes of
        it ('' if it is not): ``bounds.cap`` over its own size and the typical signed scale among
        ``claims`` (sender -> (signed scale, weight), those at hand)."""
        scales, weights = zip(*claims.values(), strict=True)
        claim, weight = claims[sender]
        usual = typical(scales, weights)
        return over_cap(claim, cap(self.base(p), weight, self.weight, usual))

    def result_limit(self, p: int, decision: Decision, scales: tuple[bytes, ...] | None) -> Limit | None:
        """The most partition ``p``'s result may be: from ``scales``, the tags of its decided contributors'
        signed tables as its holder served them (RemoteProtocolError if this member holds no table of
        that contributor under that tag), each entry believed up to this member's cap on it
        (``bounds.result_limit``). ``scales`` None (the chunks before the tags): NOTHING where this
        member accepts nothing, else None."""
        b = self.base(p)
        if b is NOTHING:
            return NOTHING
        if scales is None:
            return None
        if len(scales) != len(decision.contributors):
            n = len(decision.contributors)
            raise RemoteProtocolError(f"{len(scales)} signed scales for the decision's {n} contributors")
        claims = []
        for tag, i in zip(scales, decision.contributors, strict=True):
            table = self.tables.get(i, {}).get(bytes(tag))
            if table is None:
                raise RemoteProtocolError(f"no signed scales of {self.peers[i].short()} with the tag served")
            claims.append(table[p])
        usual = typical(claims, decision.weights)
        caps = [cap(b, w, self.weight, usual) for w in decision.weights]
        origins = [self.origins[i] for i in decision.contributors] if self.origins else []
        return result_limit(claims, decision.weights, caps, self.aggregation, self.mode, origins)

    def _buffer(self, numel: int) -> torch.Tensor | None:
        return None if self.pool is None else self.pool.take(numel)

    def reduced_in_flat(self, p: int) -> bool:
        """Partition ``p`` accumulates right where its mean goes, in ``flat`` (no copy at the end): our
        own partition, unless ``flat`` is also what we send from (it must stay intact until the decision)."""
        return p == self.me and (self.source is not self.flat or p in self.saved)

    def reduce(self, p: int, weight: float | None, *, expect: bool = False) -> PartitionReducer:
        """Reduce partition ``p`` here, holding this member's own slice if ``weight`` is given.
        ``expect``: publish its mean chunk by chunk as every member's chunk arrives (pipelined rounds)."""
        size = self.sizes[p]
        buffer = self.slice(p) if self.reduced_in_flat(p) else self._buffer(size)
        red = PartitionReducer(
            size,
            self.mode,
            buffer,
            self.aggregation,
            members=self.n,
            origins=self.origins,
            canonical=self.audit,
            bound=self.limit(p),
            prior=None if self.prior is None else self.prior[self.offsets[p] : self.offsets[p + 1]],
        )
        if weight is not None:
            # Reduced in place: its own values are in ``flat``, where the mean goes, and in the backup. (A
            # failed reducer's partition we replace: in the backup alone, if early averages overwrote them.)
            in_place = self.reduced_in_flat(p) and p in self.saved
            own = self.slice(p) if in_place else self.own(p)
            if self.audit:
                raw = bytes(encoded_chunk(own, Compression.NONE))
                self.local[p] = raw
                red.commits[self.me] = seal_commit(self.identity, self.digest, p, weight, hash_pieces([raw]))
            red.claims[self.me] = self.own_table()[1]
            red.claimed[self.me] = (self.own_scales[p], weight)
            red.add_local(self.me, own, weight, kept=self.saved[p] if in_place else None)
        if expect:
            red.expect([i for i in range(self.n) if i not in self.signed_out])  # (signed out: sends none)
        self.reducers[p] = red
        return red

    def stop_reducing(self, p: int) -> None:
        self.reducers.pop(p, None)

    def delivered(self, p: int) -> dict[int, float] | None:
        """Whom the partition ``p`` reduced here received complete (None if we do not reduce it)."""
        red = self.reducers.get(p)
        return None if red is None else red.delivered

    def pieces(
        self, p: int, values: torch.Tensor | None = None
    ) -> tuple[Iterable[bytes | memoryview], bytes]:
        """The encoded chunks of this member's slice of ``p`` (``values``, else read by ``own``), and its
        signed commitment (audited rounds: computed once, kept for the audit). Else encoded as they are
        sent: a compressed copy of the whole slice would cost memory for nothing."""
        values = self.own(p) if values is None else values
        if not self.audit:
            return (encoded_chunk(values[a:b], self.mode) for a, b in chunks(self.sizes[p], self.mode)), b""
        if p not in self.sent:
            pieces = [
                bytes(encoded_chunk(values[a:b], self.mode)) for a, b in chunks(self.sizes[p], self.mode)
            ]
            commit = seal_commit(self.identity, self.digest, p, self.weight, hash_pieces(pieces))
            self.sent[p] = (pieces, commit)
        pieces, commit = self.sent[p]
        return list(pieces), commit

    def needs_read_back(self, p: int) -> bool:
        """Our values of ``p`` must be read back from the backup (a worker thread's job) to send them."""
        return p in self.saved and p not in self.sent

    def own(self, p: int) -> torch.Tensor:
        """This member's own values in partition ``p`` (what it sends)."""
        if p in self.saved:  # (read back on the rare path that needs them: a failed reducer's replacement)
            return torch.frombuffer(self.saved[p].read(), dtype=torch.float32)
        if p in self.overwritten:  # early results went where we send from: take them from the tensors
            return self._own_from_tensors(p)
        return self.source[self.offsets[p] : self.offsets[p + 1]]

    def _own_from_tensors(self, p: int) -> torch.Tensor:
        """Our values of partition ``p`` as float32, from the caller's tensors (left alone until commit)."""
        lo, hi = self.offsets[p], self.offsets[p + 1]
        out = torch.empty(hi - lo, dtype=torch.float32)
        off = 0
        with torch.no_grad():
            for t in self.tensors:
                a, b = max(lo, off), min(hi, off + t.numel())
                if a < b:
                    out[a - lo : b - lo].copy_(t.detach().reshape(-1)[a - off : b - off])
                off += t.numel()
        return out

    def slice(self, p: int) -> torch.Tensor:
        """Where partition ``p``'s average goes (the same memory as ``own`` unless a source was given)."""
        return self.flat[self.offsets[p] : self.offsets[p + 1]]

    def early_target(self, p: int) -> None:
        """Early averages of ``p`` are about to land where we send from: our values come from the
        caller's tensors from now on."""
        if self.source is self.flat:
            self.overwritten.add(p)

    def keep_saved(self, p: int, saved: Spilled) -> None:
        self.saved[p] = saved

    def write_result(self, p: int, result: torch.Tensor, scales: tuple[bytes, ...] = ()) -> None:
        """A partition reduced here holds its result: into ``flat`` (unless reduced right there);
        ``scales``: its contributors' table tags (served with it to relays' fetchers)."""
        if result.data_ptr() != self.slice(p).data_ptr():  # (compressed, or not reduced in flat)
            self.slice(p).copy_(result)
        self.results[p] = Scale.of(result)
        self.scales[p] = scales

    def restore(self, p: int) -> None:
        """A result of ``p`` that landed where our own values were (in place, early) is refused: our own
        values go back there (the backup has them), so nothing of it stays in the caller's tensor."""
        if self.backup is not None and p in self.saved and self.flat.numel():
            self.slice(p).copy_(torch.frombuffer(self.saved[p].read(), dtype=torch.float32))

    def commit(self) -> list[torch.Tensor]:
        """Write the averages into the caller's tensors."""
        off = 0
        with torch.no_grad():
            for t in self.tensors:
                k = t.numel()
                if t.data_ptr() != self.flat[off:].data_ptr():  # (in place: already there)
                    t.copy_(self.flat[off : off + k].view(t.shape))
                off += k
        return self.tensors

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around a handler that streams from this memory: it is not given back meanwhile."""
        self._readers += 1
        try:
            yield
        finally:
            self._readers -= 1
            self._release()

    def retire(self) -> None:
        """No new reader from now on; the memory is given back once the last stream ends."""
        for red in self.reducers.values():
            if not red.finalizing:  # (one finalizing in a worker thread is let go of once it is done)
                red.drop()
        self._retired = True
        self._release()

    def _release(self) -> None:
        if self.released or self._readers or not self._retired:
            return
        self.released = True
        if self.pool is not None:
            for p, red in self.reducers.items():
                if not self.reduced_in_flat(p):  # (else its accumulator is part of ``flat``)
                    self.pool.give(red.acc)
            if self.backup is None:  # (in place, ``flat`` is the caller's)
                self.pool.give(self.flat)
        if self.backup is not None:  # (after the above: what was reduced in place depends on it)
            self.backup.close()
            self.saved.clear()
        for red in self.reducers.values():  # (one that was finalizing when the round retired, too)
            red.drop()
        # Whatever still refers to this round (a late call's context, a log record) must not keep the
        # caller's tensors or the buffers alive: they are model-sized.
        self.flat = self.source = torch.empty(0)
        self.tensors = []
        self.reducers.clear()
