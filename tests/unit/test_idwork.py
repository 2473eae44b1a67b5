"""Proof of work on peer ids (pure): a found nonce earns its bits, for that id only; bad nonces earn 0."""

from __future__ import annotations

import pytest

from p2ptrain.identity import Identity
from p2ptrain.idwork import MAX_WORK_BITS, WORK_BYTES, find_work, work_bits

A = Identity.from_seed(bytes([1]) * 32).peer_id
B = Identity.from_seed(bytes([2]) * 32).peer_id


@pytest.mark.parametrize("bits", [0, 1, 8, 14])
def test_a_found_nonce_earns_at_least_its_bits(bits: int) -> None:
    nonce = find_work(A, bits)
    assert len(nonce) == WORK_BYTES and work_bits(A, nonce) >= bits


def test_the_work_is_bound_to_the_id() -> None:
    nonce = find_work(A, 14)
    assert work_bits(A, nonce) >= 14
    assert work_bits(B, nonce) < 14  # another id gains nothing from it (2**-14 chance it does)


@pytest.mark.parametrize("nonce", [None, b"", b"\x00" * 7, b"\x00" * 9])
def test_a_missing_or_malformed_nonce_earns_nothing(nonce: bytes | None) -> None:
    assert work_bits(A, nonce) == 0


def test_an_impossible_difficulty_is_refused() -> None:
    with pytest.raises(ValueError, match="between 0 and"):
        find_work(A, MAX_WORK_BITS + 1)


def test_the_search_resumes_where_it_is_told() -> None:
    first = find_work(A, 8)
    again = find_work(A, 8, start=int.from_bytes(first, "little") + 1)
    assert again != first and work_bits(A, again) >= 8
