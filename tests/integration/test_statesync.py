"""State downloads between in-process peers over the in-memory network, on the virtual clock.

What is proved here: a state of several chunks downloads from several donors; a donor killed mid-transfer
leaves the rest to another donor without a chunk fetched twice; a donor serving a corrupted chunk is
caught on that chunk, named, and the download resumes elsewhere from where it stopped; a transfer over a
link so slow that it takes minutes completes (no deadline bounds a whole transfer, only each chunk); a
donor's event loop keeps answering while it writes a snapshot in a worker thread; an offer of an older
step than the one wanted is refused (the download loop of a peer behind); tied weights travel once.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading

import pytest
import torch
import trio

from p2ptrain.errors import PeerUnavailable
from p2ptrain.net.memory import LinkProfile
from p2ptrain.training.optimizer.progress import PeerProgress
from p2ptrain.training.state import chunks, serve
from p2ptrain.training.state.download import Fetcher
from tests.harness.training import Peer, Swarm, run_config, swarm, take_local_steps

WIDTH = 768  # ~0.6M parameters: with AdamW's moments the state is 7 chunks


def big_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 1)
    )


async def donors_and_joiner(s: Swarm, donors: int) -> tuple[list[Peer], Peer]:
    first = await s.start(train=False)
    await take_local_steps(first, 2)
    others = [await s.start(train=False) for _ in range(donors - 1)]
    for peer in others:
        peer.opt.restore(*first.opt.capture())
        # (a state "large" for the test is hashed in a worker thread: its digest is b"" until then)
        assert await peer.opt.shared.hashed_digest() == await first.opt.shared.hashed_digest()
    joiner = await s.start(train=False)
    return [first, *others], joiner


def fetcher(joiner: Peer, *, max_donors: int = 4, chunk_timeout: float = 5.0) -> Fetcher:
    return Fetcher(
        joiner.node.host,
        max_size=joiner.opt.max_state_bytes(),
        chunk_timeout=chunk_timeout,
        max_donors=max_donors,
    )


def records(peers: list[Peer]) -> list[PeerProgress]:
    """Their progress records, as a joiner reads them (with the address to download from)."""
    return [
        PeerProgress(p.node.peer_id, dataclasses.replace(p.opt.record(), addr=str(p.node.addresses[0])))
        for p in peers
    ]


def chunks_served(peer: Peer) -> int:
    assert peer.opt.server is not None
    return peer.opt.server.served_chunks


async def test_a_donor_killed_mid_transfer_leaves_the_rest_to_another(autojump_clock: object) -> None:
    async with swarm(run_config("sync"), model=big_model) as s:
        (a, b), joiner = await donors_and_joiner(s, 2)
        f = fetcher(joiner)
        victim: list[Peer] = []

        def kill_the_donor_after_three_chunks(got: int, size: int) -> None:
            if got >= 3 * chunks.CHUNK and not victim:
                victim.append(next(p for p in (a, b) if chunks_served(p)))  # one range holds every chunk
                s.crash(victim[0])

        f.on_progress = kill_the_donor_after_three_chunks
        got = await f.fetch(records([a, b]), want_epoch=2, expected=lambda e: a.opt.digest)
        survivor = b if victim[0] is a else a
        assert got.delivered[victim[0].node.peer_id] >= 3 * chunks.CHUNK
        assert survivor.opt.server is not None
        assert survivor.opt.server.served_bytes == got.delivered[survivor.node.peer_id] > 0  # none twice
        assert sum(got.delivered.values()) == sum(t.numel() * t.element_size() for t in got.tensors.values())
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.opt.digest == survivor.opt.digest and joiner.opt.epoch == 2


async def test_a_corrupted_chunk_is_named_and_the_download_resumes_elsewhere(
    autojump_clock: object, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with swarm(run_config("sync"), model=big_model) as s:
        (honest, liar), joiner = await donors_and_joiner(s, 2)
        # A donor takes a snapshot only when a joiner asks it: the first fetch asks the liar alone, so
        # the snapshots written until then are the liar's.
        liars_turn = True
        real_write = serve.write_snapshot

        def corrupting_write(live: serve.LiveState) -> serve.Snapshot:
            snap = real_write(live)
            if not liars_turn:
                return snap
            read = snap.read

            def bad_read(i: int) -> bytes:
                data = read(i)
                return data[:100] + bytes([data[100] ^ 1]) + data[101:] if i == 3 else data

            snap.read = bad_read  # type: ignore[method-assign]
            return snap

        monkeypatch.setattr(serve, "write_snapshot", corrupting_write)
        f = fetcher(joiner)
        download_log = caplog.at_level(logging.WARNING, "p2ptrain.training.state.download")
        with download_log, pytest.raises(PeerUnavailable):
            await f.fetch(records([liar]), want_epoch=2, expected=lambda e: honest.opt.digest)
        named = f"{liar.node.peer_id.short()}: sent a corrupted chunk 3"
        assert any(line.startswith(named) for line in f.failures) and f.blamed == {liar.node.peer_id}
        assert f.partial is not None and list(f.partial.have[:4]) == [1, 1, 1, 0]  # kept what checked out
        liars_turn = False
        total = f.partial.layout.chunks
        # the liar is not asked again; the honest donor sends only what is still missing
        got = await f.fetch(records([liar, honest]), want_epoch=2, expected=lambda e: honest.opt.digest)
        assert chunks_served(honest) == total - 3 and set(got.delivered) == {honest.node.peer_id}
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.opt.digest == honest.opt.digest


async def test_a_transfer_far_longer_than_any_fixed_deadline_completes(autojump_clock: object) -> None:
    """7 MB at 50 kB/s: about 150 s, five times the old whole-transfer deadline; each chunk ~21 s. The
    download says how long it took on the run's clock."""
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        s.net.set_link("t0", "t1", LinkProfile(bandwidth=50_000))
        f = fetcher(joiner, chunk_timeout=30.0)
        began = trio.current_time()
        got = await f.fetch(records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest)
        took = trio.current_time() - began
        size = sum(t.numel() * t.element_size() for t in got.tensors.values())
        assert took >= size / 50_000 > 120
        # the time it reports is the transfer's on the run's clock (virtual here), not the host's
        assert took - 1.0 <= got.seconds <= took
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.opt.digest == donor.opt.digest


async def test_a_peer_fetches_only_the_chunks_its_own_state_lacks(autojump_clock: object) -> None:
    """As after a streaming step it missed: the joiner holds the donor's state but for one tensor."""
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        tensors, meta = donor.opt.capture()
        joiner.opt.restore(tensors, meta)
        last = [name for name in tensors if name.endswith(".bias")][-1]  # a few bytes: one chunk
        tensors[last] = tensors[last] + 1.0
        donor.opt.restore(tensors, meta)
        assert donor.opt.digest != joiner.opt.digest
        f = fetcher(joiner)
        got = await f.fetch(
            records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest, reuse=joiner.opt.shared.reuse
        )
        size = sum(t.numel() * t.element_size() for t in got.tensors.values())
        assert 0 < got.delivered[donor.node.peer_id] <= chunks.CHUNK < size / 4
        assert chunks_served(donor) == 1
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.opt.digest == donor.opt.digest

        # A fresh peer's state has another layout (its optimizer holds no moments yet): it reuses
        # nothing, and downloads the whole state.
        fresh = await s.start(train=False)
        got = await fetcher(fresh).fetch(
            records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest, reuse=fresh.opt.shared.reuse
        )
        assert sum(got.delivered.values()) == size
        fresh.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert fresh.opt.digest == donor.opt.digest


async def test_a_donor_answers_pings_while_it_writes_a_snapshot(
    autojump_clock_through_threads: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot is written in a worker thread (states over THREAD_BYTES; lowered here), held up
    until the test has pinged the donor: the ping is answered meanwhile, then the download completes."""
    monkeypatch.setattr(serve, "THREAD_BYTES", 1)
    release = threading.Event()
    entered = threading.Event()
    real_write = serve.write_snapshot

    def slow_write(live: serve.LiveState) -> serve.Snapshot:
        entered.set()
        assert release.wait(timeout=60)
        return real_write(live)

    monkeypatch.setattr(serve, "write_snapshot", slow_write)
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        # hashed in threads too (one per step taken): wait until the last of them is done
        await s.until(lambda: bool(donor.opt.digest) and not donor.opt.shared.holds, timeout=30)
        f = fetcher(joiner, chunk_timeout=600.0)
        result: list[object] = []

        async def download() -> None:
            result.append(await f.fetch(records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(download)
            while not entered.is_set():  # noqa: ASYNC110  (a thread sets it)
                await trio.sleep(0.01)
            conn = await joiner.node.host.connect(donor.node.addresses[0])
            await conn.ping(timeout=5)
            assert not release.is_set() and not result  # answered while the snapshot is being written
            assert donor.opt.shared.holds == 1  # and the state is held still meanwhile
            release.set()
        assert result and donor.opt.shared.holds == 0


async def test_an_offer_older_than_the_wanted_step_is_refused(autojump_clock: object) -> None:
    """A peer behind on step 3 must not download step 2 again (and again): the download loop of a donor
    whose record was newer than the state it served."""
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        f = fetcher(joiner)
        with pytest.raises(PeerUnavailable, match="offers step 2, older than step 3"):
            await f.fetch(records([donor]), want_epoch=3, expected=lambda e: donor.opt.digest)
        with pytest.raises(PeerUnavailable, match="most peers did not start from"):
            await f.fetch(records([donor]), want_epoch=2, expected=lambda e: b"\x01" * 32)
        assert chunks_served(donor) == 0


async def test_tied_weights_travel_once(autojump_clock: object) -> None:
    def tied_model() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256, bias=False))
        model[1].weight = model[0].weight
        return model

    async with swarm(run_config("sync"), model=tied_model) as s:
        donor = await s.start(train=False)
        tensors, meta = donor.opt.capture()
        assert "model.1.weight" not in tensors and "p2ptrain.tied" in meta
        joiner = await s.start(train=False)
        got = await fetcher(joiner).fetch(records([donor]), want_epoch=0, expected=lambda e: donor.opt.digest)
        assert sum(t.numel() for t in got.tensors.values()) == 256 * 64
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.model[1].weight is joiner.model[0].weight
        assert joiner.opt.digest == donor.opt.digest


async def test_a_late_joiner_behind_a_slow_link_catches_up(autojump_clock: object) -> None:
    """The whole path: a training joiner finds itself behind, downloads 7 MB over 50 kB/s links from
    two donors (over a minute; a whole-transfer deadline of 30 s cut such downloads forever) and lands
    the state, computing on meanwhile."""
    async with swarm(run_config("sync"), model=big_model) as s:
        donors, _ = await donors_and_joiner(s, 2)
        joiner = await s.start(compute=1.0)
        for donor in donors:
            s.net.set_link(f"t{donor.index}", f"t{joiner.index}", LinkProfile(bandwidth=50_000))
        began = trio.current_time()
        await s.until(lambda: joiner.opt.stats.syncs >= 1, timeout=600)
        assert trio.current_time() - began > 60  # both links together: 100 kB/s for 7 MB
        assert joiner.opt.epoch == 2 and joiner.opt.digest == donors[0].opt.digest


async def test_a_downloaded_state_is_not_hashed_again(autojump_clock: object, monkeypatch) -> None:
    """The download checked every chunk against the hashes its root commits to, and that root against
    the trusted records: the state restored from it publishes that root as it lands, with no hash of its
    own (a large state's hash runs in a thread, its digest unknown meanwhile, and a replay from it
    waited for it: a second on a busy machine after a 45M download)."""
    from p2ptrain.training.optimizer.shared_state import SharedState

    monkeypatch.setattr(serve, "THREAD_BYTES", 1)  # (every state "large": hashed in a thread)
    hashed: list[object] = []
    original = SharedState.hash_in_thread

    async def counting(self, live, version):
        hashed.append(self)
        await original(self, live, version)

    monkeypatch.setattr(SharedState, "hash_in_thread", counting)
    async with swarm(run_config("sync"), model=big_model) as s:
        donors, _ = await donors_and_joiner(s, 2)
        joiner = await s.start(compute=1.0)
        await s.until(lambda: joiner.opt.stats.syncs >= 1, timeout=600)
        assert joiner.opt.epoch == 2
        assert joiner.opt.shared.digest == donors[0].opt.digest  # (known as it landed)
        assert joiner.opt.shared not in hashed, "the joiner hashed the state it had just downloaded"
        assert any(h is donors[0].opt.shared for h in hashed)  # (a state that changed otherwise is hashed)


async def test_an_offer_newer_than_the_records_is_taken_once_they_name_it(autojump_clock: object) -> None:
    """A donor that stepped since the joiner read the records offers a step no record names yet: the
    joiner downloads it at once (every chunk checked against the donor's own root) and hands it over
    when its records name that root, instead of failing the attempt and starting over (the retry loop of
    "offers step N, for which no peer published a digest", each retry finding the swarm a step further)."""
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        known_from = trio.current_time() + 5.0

        def records_catch_up(epoch: int) -> bytes:
            return donor.opt.digest if trio.current_time() >= known_from else b""

        f = fetcher(joiner)
        got = await f.fetch(records([donor]), want_epoch=2, expected=records_catch_up)
        assert got.epoch == 2 and trio.current_time() >= known_from
        assert not any("no peer published a digest" in line for line in f.failures)
        joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
        assert joiner.opt.digest == donor.opt.digest


async def test_a_state_no_record_names_is_never_handed_over_and_not_fetched_twice(
    autojump_clock: object,
) -> None:
    """Never named: the attempt ends after ``CONFIRM_WAIT`` with the complete state kept, not handed
    over; once the records name it, the next attempt hands it over without a byte more. A root the
    records refute is dropped and its donor blamed."""
    async with swarm(run_config("sync"), model=big_model) as s:
        (donor,), joiner = await donors_and_joiner(s, 1)
        named = False
        f = fetcher(joiner)
        with pytest.raises(PeerUnavailable, match="no trusted record names its digest yet"):
            await f.fetch(
                records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest if named else b""
            )
        assert f.partial is not None and f.partial.complete
        served = chunks_served(donor)
        named = True
        got = await f.fetch(records([donor]), want_epoch=2, expected=lambda e: donor.opt.digest)
        assert got.epoch == 2 and chunks_served(donor) == served
        # a root the records refute: nothing handed over, the donor blamed
        other = fetcher(joiner)

        def refuted_once_in(epoch: int) -> bytes:
            return b"\x02" * 32 if other.partial is not None and other.partial.complete else b""

        with pytest.raises(PeerUnavailable, match="not the one the trusted records name"):
            await other.fetch(records([donor]), want_epoch=2, expected=refuted_once_in)
        assert other.partial is None and other.blamed == {donor.node.peer_id}


async def test_a_split_swarms_download_takes_any_state_a_trusted_record_names_and_no_other(
    autojump_clock: object,
) -> None:
    """A swarm split into regions holds one state a region of a step: every one a trusted record names
    is a state to download (``roots``), and none other is ever applied. Random donors of three states of
    one step, random sets of named roots (seeded): a download lands on a named root whenever a donor
    offers one, and is refused, with nothing served, whenever none does. Held to one root (the
    majority's, ``expected``), the download refused the other named states (a split swarm's peers
    retried until a donor of the majority's served them)."""
    async with swarm(run_config("sync"), model=big_model) as s:
        donors, joiner = await donors_and_joiner(s, 3)
        for i, donor in enumerate(donors[1:], 1):  # (same step, states of their own)
            tensors, meta = donor.opt.capture()
            name = next(iter(tensors))
            tensors[name] = tensors[name] + i
            donor.opt.restore(tensors, meta, epoch=donor.opt.epoch, owned=True)
            await donor.opt.shared.hashed_digest()
        digests = [await d.opt.shared.hashed_digest() for d in donors]
        assert len(set(digests)) == 3 and {d.opt.epoch for d in donors} == {2}
        rng = random.Random(7)
        landed = refused = 0
        for _ in range(8):
            asked = rng.sample(donors, rng.randint(1, 3))
            named = frozenset(rng.sample(digests, rng.randint(1, 3)))
            f = fetcher(joiner)
            before = sum(chunks_served(d) for d in donors)
            offered = {d.opt.digest for d in asked}
            if offered & named:
                got = await f.fetch(
                    records(asked),
                    want_epoch=2,
                    expected=lambda e: digests[0],
                    roots=lambda e, named=named: named,
                )
                joiner.opt.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
                assert await joiner.opt.shared.hashed_digest() in named & offered
                landed += 1
            else:
                with pytest.raises(PeerUnavailable, match="did not start from"):
                    await f.fetch(
                        records(asked),
                        want_epoch=2,
                        expected=lambda e: digests[0],
                        roots=lambda e, named=named: named,
                    )
                assert sum(chunks_served(d) for d in donors) == before
                refused += 1
        assert landed and refused  # (the seed draws both)
        # one root (no ``roots``): a donor of another named state is refused
        f = fetcher(joiner)
        with pytest.raises(PeerUnavailable, match="did not start from"):
            await f.fetch(records([donors[1]]), want_epoch=2, expected=lambda e: digests[0])
