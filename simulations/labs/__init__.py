"""Emulated networks for real node processes on one machine: ``wan`` (a userspace switch shaping every
peer's link, no root), ``netns`` (one network namespace per peer, links shaped by ``tc tbf``; root) and
``natlab`` (home peers behind their own MASQUERADE routers; root)."""
