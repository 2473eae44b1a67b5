"""The coordinator's decision: one agreed set of contributors, or an abort (pure, no I/O).

Theory of operation: after the scatter phase each reducer knows whose slices of its partition arrived
complete. Those sets can differ: a sender that died half-way delivered to some reducers only. The
coordinator (the leader, ``members[0]``) collects one report per reducer and decides:

- contributors = the senders every reporting reducer received, with the same weight everywhere;
- a reducer that did not report (dead or too slow) is failed: its own slices died with it, so it is no
  contributor, and its partition goes to a surviving reducer, to which every contributor sends its
  slice again (each member still holds its own tensors);
- with no contributor or no surviving reducer, the round aborts;
- a contributor's weight is capped at what the coordinator's ``caps`` allow (for sample counts: what the
  sender's own signed progress records make plausible), so a peer cannot buy influence by lying. The
  coordinator does not cap itself: every reducer refuses a slice whose weight is more than
  :data:`WEIGHT_SLACK` times what the reducer finds plausible for its sender, so a hostile coordinator's
  own slice is left out like anyone's (a reducer that refused it reports it undelivered; a decision
  that counts it anyway cannot be finalized and the round aborts for all).

The decision is signed and is the only thing that turns reduced partitions into results: a reducer
computes the mean over exactly the decided contributors, so every member that commits holds the same
bits. Members that lose the coordinator ask each other for the decision (see ``deciding``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from .protocol import Decision


@dataclass
class Coordinator:
    """Collects the reducers' reports for one round and makes the decision."""

    round: bytes
    sizes: Sequence[int]
    reports: dict[int, dict[int, float]] = field(default_factory=dict)
    unreachable: set[int] = field(default_factory=set)  # reducers some member could not reach
    decision: Decision | None = None
    caps: dict[int, float] = field(default_factory=dict)  # the most weight each member may carry
    capped: dict[int, tuple[float, float]] = field(default_factory=dict)  # member -> (claimed, allowed)

    @property
    def reducers(self) -> list[int]:
        return [i for i, s in enumerate(self.sizes) if s > 0]

    def report(self, reducer: int, delivered: dict[int, float]) -> str | None:
        """Record a reducer's report; returns why it was ignored, or None."""
        if self.decision is not None:
            return "the round is already decided"
        if reducer not in self.reducers:
            return f"member {reducer} reduces nothing"
        if reducer in self.reports:
            return f"reducer {reducer} already reported"
        n = len(self.sizes)
        for i, w in delivered.items():
            if not 0 <= i < n or not (math.isfinite(w) and w > 0):
                return f"reducer {reducer} reported an invalid sender or weight"
        self.reports[reducer] = dict(delivered)
        return None

    def ready(self) -> bool:
        """Every reducer reported (or was reported unreachable and has not reported since)."""
        return all(r in self.reports or r in self.unreachable for r in self.reducers)

    def decide(self, why_missing: str = "did not report in time") -> Decision:
        """The decision now: reducers that have not reported are failed."""
        if self.decision is None:
            self.decision = self._decide(why_missing)
        return self.decision

    def abort(self, reason: str) -> Decision:
        if self.decision is None:
            self.decision = Decision(self.round, abort=reason)
        return self.decision

    def _decide(self, why_missing: str) -> Decision:
        live = sorted(self.reports)
        failed = [r for r in self.reducers if r not in self.reports]
        if not live:
            return Decision(self.round, abort="no reducer reported")
        senders = set.intersection(*(set(self.reports[r]) for r in live)) - set(failed)
        contributors, weights = [], []
        for i in sorted(senders):
            ws = {self.reports[r][i] for r in live}
            if len(ws) == 1:  # a sender that told reducers different weights is left out
                claimed = ws.pop()
                allowed = self.caps.get(i, claimed)
                if claimed > allowed:
                    self.capped[i] = (claimed, allowed)
                contributors.append(i)
                weights.append(min(claimed, allowed))
        if not contributors:
            return Decision(self.round, abort="no member delivered its slices to every reducer")
        # each failed partition goes to the live reducer with the least to do so far
        load = {r: float(self.sizes[r]) for r in live}
        replacements = []
        for f in failed:
            r = min(live, key=lambda x: (load[x], x))
            replacements.append(r)
            load[r] += self.sizes[f]
        return Decision(
            self.round,
            contributors=tuple(contributors),
            weights=tuple(weights),
            failed=tuple(failed),
            replacements=tuple(replacements),
        )


def excluded_reasons(
    decision: Decision, n: int, names: Sequence[str], signed_out: Collection[int] = ()
) -> dict[int, str]:
    """Why each member that is not a contributor was left out, in words."""
    out = {}
    for i in range(n):
        if i in decision.contributors:
            continue
        if i in signed_out:
            out[i] = f"{names[i]} was signed out by the leader: the others cannot meet its quorum"
        elif i in decision.failed:
            out[i] = f"{names[i]} reduced a partition but did not report (failed or too slow)"
        else:
            out[i] = f"{names[i]} did not deliver every slice in time (or sent inconsistent weights)"
    return out


WEIGHT_SLACK = 2.0
"""A reducer refuses a slice that claims more than this many times the weight it finds plausible for
its sender: honest peers claim no more than this over what their own records make plausible, and
reducers read the same signed records a little apart in time, so honest views differ a little."""
