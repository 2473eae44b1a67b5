"""Trust earned by verified useful work (``averaging.trust``): the usefulness check a reducer makes of
each contributor's slice, and the ledger that turns verified rounds into partners.

The property tests draw many seeded groups: honest-like slices (a shared signal plus noise of up to the
signal's size) always pass; zeros, pure noise of any scale and sign-flipped copies of an honest slice
never do, whatever mix of them joins the honest ones. Before this module, every contributor of an
applied round was trusted (``Averager.trained_with(result.contributors)``): zeros with weight 1 made a
client-only fresh key a partner after one round.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from p2ptrain.averaging.compression import Compression
from p2ptrain.averaging.reducer import PartitionReducer
from p2ptrain.averaging.trust import (
    ADMIT_PER_WINDOW,
    ADMIT_WINDOW,
    ALIGN_SIGMAS,
    BEYOND_PRIOR_FROM,
    HALF_LIFE,
    MAX_ALIGN,
    PER_SUBNET,
    TrustLedger,
    Verdict,
    gram,
    threshold,
    useful,
)
from p2ptrain.identity import Identity, PeerID

SEEDS = 300


def pid(n: int) -> PeerID:
    return Identity.from_seed(n.to_bytes(32, "big")).peer_id


def judge(rows: list[torch.Tensor], weights: list[float] | None = None) -> list[bool]:
    d = rows[0].numel()
    return [v.useful for v in useful(gram(rows), weights or [1.0] * len(rows), d)]


def honest_rows(rng: torch.Generator, k: int, d: int, noise: float) -> list[torch.Tensor]:
    """``k`` honest-like slices: one signal (a random direction of random scale), each with its own
    positive scale and noise of up to ``noise`` times its signal's norm."""
    signal = torch.randn(d, generator=rng, dtype=torch.float64)
    signal /= signal.norm()
    rows = []
    for _ in range(k):
        scale = 10 ** (torch.rand(1, generator=rng).item() * 2 - 1)  # a hundredfold spread
        n = torch.randn(d, generator=rng, dtype=torch.float64)
        rows.append((signal + noise * torch.rand(1, generator=rng).item() * n / n.norm()) * scale)
    return [r.float() for r in rows]


def test_the_bar_is_a_few_sigmas_of_pure_noise_capped_for_tiny_partitions() -> None:
    assert threshold(10_000) == pytest.approx(ALIGN_SIGMAS / 100)
    assert threshold(16) == MAX_ALIGN
    assert 0 < threshold(10**12) < 0.1


@pytest.mark.parametrize("seed", range(SEEDS))
def test_honest_like_slices_are_useful(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    d, k = draw.randint(256, 4096), draw.randint(2, 8)
    assert all(judge(honest_rows(rng, k, d, noise=1.0))), (d, k)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_zeros_noise_and_flipped_copies_are_never_useful(seed: int) -> None:
    """Any mix of attackers beside at least two honest slices: no attacker's slice passes. Honest
    slices still pass where no flipped copy cancels them and noise does not outnumber them."""
    rng = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    d, h = draw.randint(256, 4096), draw.randint(2, 6)
    honest = honest_rows(rng, h, d, noise=1.0)
    attackers: list[tuple[str, torch.Tensor]] = []
    for _ in range(draw.randint(1, 6)):
        kind = draw.choice(["zeros", "noise", "flip", "tiny"])
        if kind == "zeros":
            attackers.append((kind, torch.zeros(d)))
        elif kind == "tiny":  # an honest direction at a billionth of the scale: no work to speak of
            attackers.append((kind, honest[0] * 1e-9))
        elif kind == "noise":
            scale = 10 ** (torch.rand(1, generator=rng).item() * 8 - 4)
            attackers.append((kind, torch.randn(d, generator=rng) * scale))
        else:
            attackers.append((kind, -honest[draw.randrange(h)]))
    rows = [r for _, r in attackers] + honest
    order = list(range(len(rows)))
    draw.shuffle(order)  # member order does not matter
    verdicts = dict(zip(order, judge([rows[i] for i in order]), strict=True))
    kinds = [kind for kind, _ in attackers]
    # (a slice at a billionth of the honest scale is negligible next to the others' lower median
    # while such slices are fewer than the rest: more of them make the median theirs; they still
    # had to compute an honest direction to scale down)
    tiny_median = kinds.count("tiny") + kinds.count("zeros") >= h + kinds.count("noise") + kinds.count("flip")
    for i, kind in enumerate(kinds):
        if not (kind == "tiny" and tiny_median):
            assert not verdicts[i], f"a {kind} slice passed (d={d}, seed={seed})"
    if "flip" not in kinds and kinds.count("noise") <= h:
        assert all(verdicts[len(attackers) + j] for j in range(h)), (kinds, d)


def test_a_slice_needs_a_positive_finite_weight_and_finite_values() -> None:
    rng = torch.Generator().manual_seed(1)
    rows = honest_rows(rng, 3, 512, noise=0.5)
    assert judge(rows, [1.0, 0.0, 1.0]) == [True, False, True]
    assert judge(rows, [1.0, math.nan, 1.0])[1] is False
    bad = [*rows[:2], torch.full((512,), math.inf)]
    assert not any(judge(bad))  # (a reducer refuses such bytes on arrival; the check holds alone too)


def test_keys_of_one_origin_sending_the_same_values_do_not_vouch_for_each_other() -> None:
    """Eight keys of one host send one vector (100 in every coordinate) beside three honest slices:
    counted by id, each of them is aligned with the other seven; by origin, with the honest only."""
    rng = torch.Generator().manual_seed(3)
    d = 1024
    honest = honest_rows(rng, 3, d, noise=0.5)
    rows = [*honest, *(torch.full((d,), 100.0) for _ in range(8))]
    g, weights = gram(rows), [1.0] * len(rows)
    assert all(v.useful for v in useful(g, weights, d)[3:])  # (by id: they vouch for each other)
    by_origin = useful(g, weights, d, origins=[0, 1, 2] + [3] * 8)
    assert [v.useful for v in by_origin] == [True] * 3 + [False] * 8


def test_a_lone_slice_verifies_nothing() -> None:
    assert judge([torch.ones(300)]) == [False]


def reducer_with(rows: list[torch.Tensor], weights: list[float], mode: Compression) -> PartitionReducer:
    """A reducer holding ``rows[0]`` as its own slice and the others as received chunks."""
    red = PartitionReducer(rows[0].numel(), mode)
    red.add_local(0, rows[0], weights[0])
    for sender, row in enumerate(rows[1:], start=1):
        for index, (a, b) in enumerate(red.spans):
            data = row[a:b].numpy().tobytes() if mode is Compression.NONE else bytes(_enc(row[a:b], mode))
            red.add_chunk(sender, index, memoryview(bytearray(data)), weights[sender])
        red.complete(sender, weights[sender])
    return red


def _enc(values: torch.Tensor, mode: Compression) -> bytes:
    from p2ptrain.averaging.compression import encode

    return bytes(encode(values.contiguous(), mode))


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
@pytest.mark.parametrize("mode", [Compression.NONE, Compression.FP16])
def test_the_reducer_judges_the_decided_contributors_slices(aggregation: str, mode: Compression) -> None:
    """Members 0-2 honest, 3 sends zeros (weight 1, the attack), 4 noise, 5 a flipped copy of 1; member
    6 sent too but is not in the decision: it is not judged."""
    rng = torch.Generator().manual_seed(5)
    d = 3000  # several chunks
    honest = honest_rows(rng, 3, d, noise=0.8)
    rows = [*honest, torch.zeros(d), torch.randn(d, generator=rng), -honest[1], honest[2].clone()]
    weights = [8.0, 8.0, 8.0, 1.0, 8.0, 8.0, 8.0]
    red = reducer_with(rows, weights, mode) if aggregation == "mean" else _robust(rows, weights, mode)
    red.finalize(list(range(6)), weights[:6])
    assert {i: v.useful for i, v in red.verdicts.items()} == {
        0: True,
        1: True,  # its flipped copy does not cancel it: two other honest slices point its way
        2: True,
        3: False,
        4: False,
        5: False,
    }, {i: v.reason for i, v in red.verdicts.items()}
    assert "negligible" in red.verdicts[3].reason


def _robust(rows: list[torch.Tensor], weights: list[float], mode: Compression) -> PartitionReducer:
    red = PartitionReducer(rows[0].numel(), mode, aggregation="trimmed_mean")
    red.add_local(0, rows[0], weights[0])
    for sender, row in enumerate(rows[1:], start=1):
        for index, (a, b) in enumerate(red.spans):
            data = row[a:b].numpy().tobytes() if mode is Compression.NONE else _enc(row[a:b], mode)
            red.add_chunk(sender, index, memoryview(bytearray(data)), weights[sender])
        red.complete(sender, weights[sender])
    return red


def test_the_reducer_judges_a_pipelined_round_whose_early_chunks_are_the_result() -> None:
    rng = torch.Generator().manual_seed(9)
    d = 2000
    rows = [*honest_rows(rng, 2, d, noise=0.5), torch.zeros(d)]
    red = PartitionReducer(d, Compression.NONE)
    red.add_local(0, rows[0], 1.0)
    red.expect(range(3))
    for sender in (1, 2):
        for index, (a, b) in enumerate(red.spans):
            red.add_chunk(sender, index, memoryview(bytearray(rows[sender][a:b].numpy().tobytes())), 1.0)
        red.complete(sender, 1.0)
    red.finalize([0, 1, 2], [1.0, 1.0, 1.0])
    assert red.early_final
    assert [red.verdicts[i].useful for i in range(3)] == [True, True, False]


# ---- the ledger -------------------------------------------------------------------------------------

ME = pid(0)


def test_one_verified_round_makes_a_partner_and_a_round_counts_once() -> None:
    ledger = TrustLedger(ME)
    assert ledger.credit(b"r1", [(pid(1), "10.0.0.0/24"), (ME, "")], now=0.0) == [pid(1)]
    assert ledger.partners == {pid(1)}  # never itself
    ledger.credit(b"r1", [(pid(1), "10.0.0.0/24")], now=1.0)
    assert ledger.value(pid(1), 1.0) == pytest.approx(0.5 ** (1 / HALF_LIFE))  # the same round: no more


def test_credits_decay_and_a_partner_that_stops_working_is_one_no_more() -> None:
    ledger = TrustLedger(ME)
    ledger.credit(b"r1", [(pid(1), "a")], now=0.0)
    ledger.update(HALF_LIFE * 0.9)
    assert pid(1) in ledger.partners
    ledger.update(HALF_LIFE * 1.1)
    assert pid(1) not in ledger.partners
    for r in range(20):  # a long history saturates: it lasts a bounded time
        ledger.credit(bytes([r]), [(pid(2), "b")], now=float(r))
    ledger.update(HALF_LIFE * 5.1)
    assert pid(2) not in ledger.partners


def test_one_subnet_holds_a_few_partners_at_most() -> None:
    ledger = TrustLedger(ME)
    ledger.credit(b"r1", [(pid(i), "198.18.0.0/24") for i in range(1, 11)], now=0.0)
    ledger.credit(b"r2", [(pid(11), "198.18.1.0/24")], now=1.0)
    assert len(ledger.partners) == PER_SUBNET + 1 and pid(11) in ledger.partners


def test_new_partners_per_window_are_bounded() -> None:
    ledger = TrustLedger(ME)
    named = ledger.credit(b"r1", [(pid(i), f"net{i}") for i in range(1, 41)], now=0.0)
    assert len(named) == ADMIT_PER_WINDOW
    assert ledger.update(ADMIT_WINDOW / 2) == []
    # the others earn it again in a later window (their first credit decayed below the bar meanwhile)
    later = ledger.credit(b"r2", [(pid(i), f"net{i}") for i in range(1, 41)], now=ADMIT_WINDOW + 1)
    assert len(later) == ADMIT_PER_WINDOW and not set(later) & set(named)


@pytest.mark.parametrize("seed", range(40))
def test_newcomers_never_outnumber_the_partners_held_before_their_window(seed: int) -> None:
    """The invariant: the partners named within any window of ``ADMIT_WINDOW`` seconds number at most
    those held from before it, or ``ADMIT_PER_WINDOW``; and a member that verified everyone trusts them
    all within log2(n / ``ADMIT_PER_WINDOW``) + 1 windows (a flat 16 a minute held a 64-peer swarm's
    quorums at all of each peer's few trusted peers for minutes). Random rounds: who is verified, on
    which subnet, when, some keys sharing a subnet (their cap holds them back whatever the window)."""
    rng = random.Random(seed)
    n = rng.choice([8, 32, 64, 200, 1024])
    subnets = {i: f"net{i}" if rng.random() < 0.8 else f"shared{i % 5}" for i in range(1, n + 1)}
    ledger = TrustLedger(ME)
    named_at: list[tuple[float, PeerID]] = []
    now = 0.0
    for r in range(60):
        now += rng.uniform(1.0, 12.0)
        verified = [(pid(i), subnets[i]) for i in range(1, n + 1) if rng.random() < 0.7]
        named = ledger.credit(bytes([r % 256, r // 256]), verified, now=now)
        named_at += [(now, p) for p in named]
        window = [p for t, p in named_at if now - t < ADMIT_WINDOW]
        before = ledger.partners - set(window)
        assert len(window) <= max(ADMIT_PER_WINDOW, len(before)), (now, len(window), len(before))
    # every key verified in most rounds is a partner by now, within its subnet's cap
    own = sum(1 for i in subnets if subnets[i].startswith("net"))
    shared = len({subnets[i] for i in subnets if subnets[i].startswith("shared")})
    assert len(ledger.partners) >= min(own, n) * 0.9 + min(shared * PER_SUBNET, n - own) * 0.9 - 1


def test_a_member_that_verified_a_swarm_trusts_a_majority_of_it_within_a_few_steps() -> None:
    """64 peers, each verified in every round of a 10 s step: a majority are partners within 45 s of
    the first round (a flat 16 a minute took two minutes, and until then every peer's quorum needed
    all of the few peers it trusted)."""
    ledger = TrustLedger(ME)
    everyone = [(pid(i), f"net{i}") for i in range(1, 65)]
    t = 0.0
    while t <= 45.0:
        ledger.credit(int(t).to_bytes(4, "big"), everyone, now=t)
        t += 10.0
    assert len(ledger.partners) > 64 // 2, len(ledger.partners)


def test_peers_one_round_verified_become_partners_as_the_windows_allow_without_another_round() -> None:
    """One round verified 64 peers, and no round follows (the swarm's next step cannot form while its
    peers trust too few): the window holds most of them back, and they are named as it allows, not
    lost. Their credit decays below ``TRUST_AT`` at once, and the check against the decayed credit
    never named them: every peer of a 64-peer simulated swarm trusted 19 after its first round, for
    good."""
    ledger = TrustLedger(ME)
    ledger.credit(b"r1", [(pid(i), f"net{i}") for i in range(1, 65)], now=0.0)
    assert len(ledger.partners) == ADMIT_PER_WINDOW
    ledger.update(ADMIT_WINDOW + 1.0)
    assert len(ledger.partners) == 2 * ADMIT_PER_WINDOW
    ledger.update(3 * ADMIT_WINDOW + 1.0)
    assert len(ledger.partners) == 64
    ledger.update(HALF_LIFE * 1.1)  # below KEEP_AT: partners no more, like any
    assert not ledger.partners


def test_partners_a_checkpoint_remembers_are_partners_again() -> None:
    ledger = TrustLedger(ME)
    ledger.seed([pid(1), pid(2), ME], now=0.0)
    assert ledger.partners == {pid(1), pid(2)}
    ledger.update(HALF_LIFE * 0.5)
    assert ledger.partners == {pid(1), pid(2)}


def test_the_ledger_remembers_a_bounded_number_of_peers() -> None:
    from p2ptrain.averaging import trust

    ledger = TrustLedger(ME)
    for r in range(trust.MAX_TRACKED // 100 + 2):
        ledger.credit(
            bytes([r % 256, r // 256]), [(pid(1000 + r * 100 + i), f"n{r}.{i}") for i in range(100)], 0.0
        )
    assert len(ledger) <= trust.MAX_TRACKED


def test_keys_seen_only_through_one_relay_share_its_subnet_bound() -> None:
    """A key that only ever shows up through a relay's circuit counts in the relay's subnet, and one
    seen nowhere counts in one bucket all such keys share. Before, each got a subnet of its own
    (``?<peer>``), so an attacker's relay lent any number of its keys a partner's place each, past
    ``PER_SUBNET``."""
    from types import SimpleNamespace

    from p2ptrain.averaging.averager import seen_at

    relay_host, direct_host = "198.18.7.1", "198.18.9.5"
    conns = [SimpleNamespace(peer=pid(i), relayed=True, remote_host=relay_host) for i in range(1, 11)]
    # pid(1) was also reached directly (a punched connection): its own subnet wins over the relay's
    conns.append(SimpleNamespace(peer=pid(1), relayed=False, remote_host=direct_host))
    keys = [pid(i) for i in range(1, 21)]  # 11..20: connections already closed
    seen = dict(seen_at(conns, keys))  # type: ignore[arg-type]
    assert seen[pid(1)] == "198.18.9.0/24" and seen[pid(2)] == "198.18.7.0/24" and seen[pid(15)] == "?"
    ledger = TrustLedger(ME)
    named = ledger.credit(b"r1", list(seen.items()), now=0.0)
    # pid(1) on its own subnet, PER_SUBNET through the relay, PER_SUBNET seen nowhere
    assert len(named) == 1 + 2 * PER_SUBNET
    assert pid(1) in named


def test_a_key_seen_nowhere_keeps_the_subnet_it_was_seen_at_before() -> None:
    """Closing its connection before a round ends moves no key out of its subnet's bound."""
    ledger = TrustLedger(ME)
    ledger.credit(b"r1", [(pid(i), "198.18.0.0/24") for i in range(1, 6)], now=0.0)
    assert len(ledger.partners) == PER_SUBNET
    # the same keys seen nowhere in the next round, with four more seen nowhere: those four fill the
    # unseen bucket; the first five stay in their subnet, whose bound still holds the fifth out
    ledger.credit(b"r2", [(pid(i), "?") for i in range(1, 10)], now=1.0)
    first = {pid(i) for i in range(1, 6)}
    assert len(ledger.partners & first) == PER_SUBNET and len(ledger.partners - first) == PER_SUBNET


def judge_with_prior(rows: list[torch.Tensor], prior: torch.Tensor) -> list[Verdict]:
    d = rows[0].numel()
    return useful(gram([*rows, prior]), [1.0] * len(rows), d, prior=True)


@pytest.mark.parametrize("seed", range(100))
def test_echoes_of_the_last_result_are_never_useful_and_new_work_always_is(seed: int) -> None:
    """The echo attack: a key sends back the last averaged result it received (scaled, mixed with
    noise of any size), which points the way the honest peers' next gradients do, so the plain check
    passes it: it earned trust without computing. Each slice must now also carry work beyond the
    judging member's last result. Honest slices of the next step (a part along the last result of
    any sign and size, alike for all of them, plus the new step's direction, plus noise) always pass;
    echoes never do."""
    rng = torch.Generator().manual_seed(seed)
    draw = random.Random(seed)
    d, h = draw.randint(BEYOND_PRIOR_FROM, 4096), draw.randint(2, 6)
    prior = torch.randn(d, generator=rng)
    prior *= 10 ** (draw.random() * 4 - 2) / prior.norm()
    along = draw.uniform(-1.0, 3.0)  # how far the next step's gradients point along the last result
    honest = [
        r + prior * (along * draw.uniform(0.7, 1.3) * r.norm() / prior.norm())
        for r in honest_rows(rng, h, d, noise=1.0)
    ]
    echoes = []
    for _ in range(draw.randint(1, h)):
        base = prior * draw.choice([1.0, -1.0, draw.uniform(0.01, 100.0)])
        noise = torch.randn(d, generator=rng)
        echoes.append(base + noise * (draw.choice([0.0, 1e-3, 0.1, 1.0, 10.0]) * base.norm() / noise.norm()))
    rows = echoes + honest
    plain = judge(rows)
    verdicts = judge_with_prior(rows, prior)
    assert not any(v.useful for v in verdicts[: len(echoes)]), [v.reason for v in verdicts[: len(echoes)]]
    # An honest slice the plain check passes passes beyond the prior too (the plain check alone fails
    # one where many echoes of the opposite sign dilute the others' aggregate, as noise does)
    for v, passed in zip(verdicts[len(echoes) :], plain[len(echoes) :], strict=True):
        assert v.useful or not passed, v.reason
    assert any(v.useful for v in verdicts[len(echoes) :]) or not any(plain[len(echoes) :])


def test_an_exact_echo_passed_the_plain_check_and_fails_beyond_the_prior() -> None:
    rng = torch.Generator().manual_seed(7)
    d = 2048
    prior = torch.randn(d, generator=rng)
    honest = [r + 2.0 * prior * r.norm() / prior.norm() for r in honest_rows(rng, 3, d, noise=0.5)]
    rows = [prior.clone(), *honest]
    assert judge(rows) == [True, True, True, True]  # what the attack relied on
    verdicts = judge_with_prior(rows, prior)
    assert [v.useful for v in verdicts] == [False, True, True, True]
    assert "echo of the last result" in verdicts[0].reason


def test_a_reducer_judges_slices_against_the_prior_it_is_given() -> None:
    """The reducer's own Gram pass carries the prior as one more row (chunk by chunk)."""
    rng = torch.Generator().manual_seed(3)
    d = 5000
    prior = torch.randn(d, generator=rng)
    honest = [r + prior * r.norm() / prior.norm() for r in honest_rows(rng, 3, d, noise=0.5)]
    for given, echo_passes in ((None, True), (prior.to(torch.bfloat16), False)):
        red = PartitionReducer(d, Compression.NONE, prior=given, spill=False)
        for i, row in enumerate([prior * 3.0, *honest]):
            red.add_local(i, row.clone(), 1.0)
            red.complete(i, 1.0)
        red.finalize(list(range(4)), [1.0] * 4)
        assert red.verdicts[0].useful is echo_passes, red.verdicts[0].reason
        assert all(red.verdicts[i].useful for i in range(1, 4))


@pytest.mark.parametrize("seed", range(10))
def test_an_update_at_the_instant_of_the_last_one_changes_nothing(seed: int) -> None:
    """The ledger answers an update at the instant of the last one, with nothing credited or seeded
    since, from what that one settled: over random credits, seeds and updates (many at one instant, as a
    board asks several times a read), its partners are those of a ledger that works every update out."""
    rng = random.Random(seed)
    cached, worked = TrustLedger(pid(0)), TrustLedger(pid(0))
    now = 0.0
    for k in range(300):
        if rng.random() < 0.3:
            now += rng.choice([0.0, 1.0, ADMIT_WINDOW / 3, HALF_LIFE / 4])
        what = rng.random()
        if what < 0.2:
            verified = [
                (pid(rng.randint(1, 60)), f"10.0.{rng.randint(0, 9)}.0/24") for _ in range(rng.randint(1, 8))
            ]
            round_id = bytes([k % 256, k // 256]) * 8
            assert cached.credit(round_id, verified, now) == worked.credit(round_id, verified, now)
        elif what < 0.25:
            peers = [pid(rng.randint(1, 60)) for _ in range(rng.randint(1, 3))]
            cached.seed(peers, now)
            worked.seed(peers, now)
        else:
            worked._settled = None  # (every update worked out)
            assert cached.update(now) == worked.update(now)
        assert cached.partners == worked.partners, k
