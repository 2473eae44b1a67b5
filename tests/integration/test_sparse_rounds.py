"""Top-k rounds (``compression = "topk..."``) on the in-memory network: each member sends its largest
values per block, reducers sum them and serve the sum once encoded, so every member that commits holds
the same bits, whatever fails; the hostile-input checks of dense rounds hold for sparse chunks too."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging import sparse
from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.compression import Compression, roundtrip
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, TensorSpec
from p2ptrain.errors import RemoteProtocolError, RoundAborted
from tests.harness.averaging import (
    PHASES,
    check_invariant,
    contributors_of,
    crash_at,
    make_tensors,
    open_group,
    run_round,
    sign_manifest,
)

pytestmark = pytest.mark.timeout(300)

MODES = [Compression.TOPK1_Q2, Compression.TOPK3_Q4]


def expected_mean(originals, weights, members, mode):
    """The mean of what each member sends: its whole vector compressed on the global block grid."""
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in originals]
    total = sum(weights[i] for i in members)
    return sum(roundtrip(flat[i], mode).double() * weights[i] for i in members) / total


def check_sparse_mean(group, originals, inputs, weights, outcomes, mode):
    res = next(o for o in outcomes if isinstance(o, RoundResult))
    want = expected_mean(originals, weights, contributors_of(group, res), mode)
    for i, o in enumerate(outcomes):
        if isinstance(o, RoundResult):
            got = torch.cat([t.reshape(-1) for t in inputs[i]]).double()
            # the sum travels in e4m3 over its block's largest value: 4 significant bits, and values
            # below 2**-9 / 448 of that largest one round to 0 (far below what 2-bit levels resolve)
            assert not bool(((got != 0) & (want == 0)).any()), "a value appeared that no member sent"
            atol = float(want.abs().max()) * 2.0**-17
            torch.testing.assert_close(got, want, rtol=2**-4, atol=atol)


def four_members(seed: int):
    """Four members' tensors (five blocks and a short one), their working copies and their weights."""
    originals = [make_tensors(seed + i, [(5 * sparse.BLOCK + 77,)], [torch.float32]) for i in range(4)]
    return originals, [[t.clone() for t in ts] for ts in originals], [1.0, 2.0, 1.0, 3.0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("n", "client_only", "in_place"), [(4, (), False), (5, (2,), True), (2, (), True)])
async def test_a_topk_round_gives_every_member_the_mean_of_what_was_sent(
    autojump_clock, mode, n, client_only, in_place
):
    size = 3 * sparse.BLOCK * n + 1234  # partitions of whole blocks, and a short last one
    async with open_group(n, client_only=client_only) as group:
        originals = [make_tensors(30 + i, [(size,)], [torch.float32]) for i in range(n)]
        inputs = [[t.clone() for t in ts] for ts in originals]
        weights = [1.0 + i for i in range(n)]
        signed = sign_manifest(group.peers, inputs[0], compression=mode.value)
        outcomes = await run_round(group, signed, inputs, weights, in_place=in_place)
    assert check_invariant(originals, inputs, weights, outcomes, in_place=in_place) == "commit"
    check_sparse_mean(group, originals, inputs, weights, outcomes, mode)
    # a tiny fraction of the values, so a tiny fraction of the bytes of a dense round
    sent = sum(c.bytes_sent for p in group.peers for c in p.host.connections())
    assert sent < 0.15 * 4 * size * n


@pytest.mark.parametrize("phase", PHASES)
async def test_a_member_crashing_in_a_topk_round_never_splits_the_group(autojump_clock, phase):
    mode = Compression.TOPK1_Q2
    async with open_group(4) as group:
        originals, inputs, weights = four_members(50)
        victim = group.peers[2]
        victim.averager.fault = crash_at(group, victim, phase)
        signed = sign_manifest(group.peers, inputs[0], compression=mode.value, timeout=20.0)
        outcomes = await run_round(group, signed, inputs, weights, in_place=True)
    verdict = check_invariant(originals, inputs, weights, outcomes, in_place=True)
    if verdict == "commit":
        check_sparse_mean(group, originals, inputs, weights, outcomes, mode)
    if phase == "before_send":  # a member that dies before sending anything is simply left out
        assert verdict == "commit", outcomes


def test_a_topk_manifest_must_start_partitions_on_whole_blocks_and_average_plainly() -> None:
    """A leader that cuts a top-k round off the block grid would make members re-select their values
    on other blocks (dropping some they counted as sent): refused, as are the rules it cannot serve."""
    members = tuple(MemberMsg(bytes([i + 1]) * 32, f"198.18.0.{i + 1}:1", 1.0) for i in range(2))
    good = dict(
        round_id=bytes(16),
        group_key="k",
        members=members,
        schema=(TensorSpec((3 * sparse.BLOCK,), "float32"),),
        compression="topk1-q2",
        sizes=tuple(partition_sizes(3 * sparse.BLOCK, [1.0, 1.0], [True, True], sparse.BLOCK)),
    )
    Manifest(**good).check()
    with pytest.raises(RemoteProtocolError, match="whole blocks"):
        Manifest(**{**good, "sizes": (sparse.BLOCK + 1, 2 * sparse.BLOCK - 1)}).check()
    with pytest.raises(RemoteProtocolError, match="aggregation 'mean'"):
        Manifest(**{**good, "aggregation": "trimmed_mean"}).check()
    with pytest.raises(RemoteProtocolError, match="cannot be audited"):
        Manifest(**{**good, "audit": True}).check()


def test_aligned_partitions_follow_bandwidth_and_cover_everything_once() -> None:
    for total in (1, sparse.BLOCK, 10 * sparse.BLOCK + 5, 77 * sparse.BLOCK - 1):
        sizes = partition_sizes(total, [1.0, 3.0, 2.0, 1.0], [True, True, False, True], sparse.BLOCK)
        assert sum(sizes) == total and sizes[2] == 0
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        assert all(s % sparse.BLOCK == 0 for s, z in zip(starts, sizes, strict=True) if z)
        last = max(i for i, z in enumerate(sizes) if z)
        assert all(z % sparse.BLOCK == 0 for z in sizes[:last])


def _negative_scale(piece: bytes) -> bytes:
    return b"\x00\x00\x80\xbf" + piece[4:]  # the first block's scale: -1.0


@pytest.mark.parametrize(
    "spoil", [_negative_scale, lambda piece: piece[:-1]], ids=["negative scale", "short"]
)
async def test_a_member_sending_malformed_topk_chunks_is_left_out_and_the_rest_commit(autojump_clock, spoil):
    mode = Compression.TOPK1_Q2
    async with open_group(4) as group:
        originals, inputs, weights = four_members(70)
        liar = group.peers[1]

        async def hook(rnd, point):
            if point == "before_send":
                honest = rnd.tensors.pieces

                def pieces(p, values=None):
                    chunks, commit = honest(p, values)
                    return [spoil(bytes(c)) for c in chunks], commit

                rnd.tensors.pieces = pieces

        liar.averager.fault = hook
        signed = sign_manifest(group.peers, inputs[0], compression=mode.value)
        outcomes = await run_round(group, signed, inputs, weights)
    assert check_invariant(originals, inputs, weights, outcomes) == "commit"
    res = next(o for i, o in enumerate(outcomes) if i != 1 and isinstance(o, RoundResult))
    assert contributors_of(group, res) == [0, 2, 3]  # every reducer refused the liar's bytes
    check_sparse_mean(group, originals, inputs, weights, outcomes, mode)


class _Spoiling:
    """A stream whose every chunk sent is spoilt (a negative first scale); ``sent`` counts them."""

    def __init__(self, stream, sent):
        self._stream, self._sent = stream, sent

    async def send(self, chunk):
        self._sent.append(len(chunk))
        await self._stream.send(_negative_scale(bytes(chunk)))

    def __getattr__(self, name):
        return getattr(self._stream, name)


async def test_a_reducer_serving_malformed_sums_never_splits_the_group(autojump_clock):
    mode = Compression.TOPK1_Q2
    async with open_group(4) as group:
        originals, inputs, weights = four_members(90)
        spoilt: list[int] = []

        async def hook(rnd, point):
            if point != "before_send":
                return
            for name in ("on_fetch_early", "on_fetch"):  # what it serves, not what it holds
                honest = getattr(rnd.server, name)

                async def serve(ctx, req, stream, honest=honest):
                    return await honest(ctx, req, _Spoiling(stream, spoilt))

                setattr(rnd.server, name, serve)

        group.peers[2].averager.fault = hook
        signed = sign_manifest(group.peers, inputs[0], compression=mode.value, timeout=20.0)
        outcomes = await run_round(group, signed, inputs, weights)
    assert spoilt, "the reducer served nothing"
    # The liar keeps what it holds (its own business); the honest members either all commit the same
    # mean or all abort with their tensors untouched: none takes a value it could not decode.
    honest = [0, 1, 3]
    if all(isinstance(outcomes[i], RoundResult) for i in honest):
        check_sparse_mean(
            group, originals, [inputs[i] for i in honest], weights, [outcomes[i] for i in honest], mode
        )
        return
    for i in honest:
        assert isinstance(outcomes[i], RoundAborted), outcomes
        assert all(torch.equal(a, b) for a, b in zip(inputs[i], originals[i], strict=True))
