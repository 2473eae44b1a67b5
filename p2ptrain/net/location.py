"""Where a host stands in the network: the address its peers see it at, and whether they can dial it.

Theory of operation: a host cannot learn this alone. Its peers tell it the address its calls come from,
and a dial-back check (the DHT's, see ``dht.reachability``) finds out whether they can dial it at the
address it advertises. :class:`Location` holds what is known so far; the host owns it, hands it at
construction to those who read it (hole punching: ``punch``), and whoever finds things out reports into
it. A host with nobody checking (no DHT) knows nothing, and says so at once: ``checked`` is set.
"""

from __future__ import annotations

import trio


class Location:
    """What this host knows of its place in the network (see the module docstring)."""

    def __init__(self) -> None:
        self.observed_host: str | None = None  # the address the last peer that said so saw us at
        self.reachable: bool | None = None  # can peers dial us at our advertised address? None: not known
        self.checked = trio.Event()  # set once a check has finished (at once while nobody checks)
        self.checked.set()

    def checking(self) -> None:
        """A checker exists from now on: ``checked`` stays unset until its first check has finished."""
        if self.checked.is_set():
            self.checked = trio.Event()

    def seen_at(self, observed_host: str) -> None:
        """A peer said our calls come from ``observed_host`` (printable text only: it goes into log
        lines; empty: it did not say)."""
        if observed_host.isprintable():
            self.observed_host = observed_host or self.observed_host

    def found(self, reachable: bool) -> None:
        """A check found whether peers can dial us."""
        self.reachable = reachable
