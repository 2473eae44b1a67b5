"""Proof of work on peer ids: what an identity costs in an open swarm.

Theory of operation: a key pair costs microseconds, so without a price an attacker holds as many ids as
it likes. A run file may set ``[run] id_work = B``: then every peer shows a *work nonce* for its peer id,
an 8-byte value such that BLAKE2b("p2ptrain-idwork": peer id digest, nonce) starts with at least ``B``
zero bits. Finding one takes about ``2**B`` hashes (this module's search: about a microsecond each in
CPython, so 20 bits take a second or two and 28 bits several minutes); checking one takes one hash. The
nonce is bound to the id (the hash covers it), so one search buys one id, and a peer keeps its nonce
for as long as it keeps its key.

Where it is checked: in the handshake (both ways: a peer whose id carries less work than the run asks is
refused, and a listener tells a dialer how much it asks, so a node or a command-line tool can do the work
and dial again), and in the progress records the training layer counts (records of ids without the
work count for nothing). A dedicated attacker hashes faster than CPython: choose ``B`` for what an honest
volunteer may spend once (a minute of a core is 2**25 or so here), not for what stops a GPU.
"""

from __future__ import annotations

import hashlib

from .identity import PeerID

WORK_BYTES = 8
MAX_WORK_BITS = 40  # a run file may not ask for more (about 2**40 hashes: days of a core)
_PERSON = b"p2ptrain-idwork"


def work_bits(peer: PeerID, nonce: bytes | None) -> int:
    """How many leading zero bits ``nonce`` earns ``peer`` (0 for a missing or malformed nonce)."""
    if nonce is None or len(nonce) != WORK_BYTES:
        return 0
    digest = hashlib.blake2b(peer.digest + nonce, digest_size=32, person=_PERSON).digest()
    value = int.from_bytes(digest, "big")
    return 256 - value.bit_length()


def find_work(peer: PeerID, bits: int, *, start: int = 0) -> bytes:
    """A nonce that earns ``peer`` at least ``bits`` bits of work (about ``2**bits`` hashes)."""
    if not 0 <= bits <= MAX_WORK_BITS:
        raise ValueError(f"id work must be between 0 and {MAX_WORK_BITS} bits, got {bits}")
    base = hashlib.blake2b(peer.digest, digest_size=32, person=_PERSON)
    limit = 1 << (256 - bits)  # the digest, read as a number, must be below this
    counter = start
    while True:
        nonce = counter.to_bytes(WORK_BYTES, "little")
        h = base.copy()
        h.update(nonce)
        if int.from_bytes(h.digest(), "big") < limit:
            return nonce
        counter += 1
