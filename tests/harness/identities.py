"""Deterministic identities: a test names its peers, and a name always gives the same keys."""

from __future__ import annotations

import hashlib

from p2ptrain.identity import Identity


def identity(name: str) -> Identity:
    return Identity.from_seed(hashlib.blake2b(name.encode(), digest_size=32).digest())
