"""A sync peer replaying onto the swarm's step joins that step's group and never leads it (issue 49).

The invariant: *a group of a step is led only by a peer on that step.* A peer replaying the missed
steps' results looks for the group of the step its replay lands it on (``RoundRunner.start_matchmaking``
with ``ahead``), to hand over the gradients it computed meanwhile; its view of that step is a
spectator's (its record is of the step before). Leading such a group, it counted itself among the
step's peers, and with the peers there already past their own group it formed a group of itself alone
and committed the step: a lineage of its own, which it left only by downloading the whole state again.
Now it joins as a client-only member (``Averager.form_group(lead=False)``: announced without an
address, nobody follows or waits for it), so the peers on the step decide whether a group of it forms.

And the chase ends: the home takes part in most of the swarm's rounds. A peer replaying a step's
result about as long as a step took was two steps behind whenever the swarm's group formed (on the
swarm's step at once), and nobody waited for it; now its record says the step it catches up to
(``ProgressRecord.toward``), so a leader of that step or the next waits for it until its deadline, and it
looks for that group as soon as the replay starts (a look for an earlier step's group is given up).

Checked over several home links whose one step result takes most of a step to fetch (the chase): every
peer holds the same parameters at every step, the home downloads the state once (its join), the chase
ends within a few of the swarm's steps (its first averaged step), and from then on the home averages in
at least two thirds of the swarm's steps (the issue's 80% is measured in the namespace lab). On the code
before, two of these links forked the home (a second download and two digests of one step), and it
averaged in none of the steps.

Why the two parts, over two minutes: the home's first steps after its join are always the chase (a
download, then two replays: 3 of the swarm's steps in every run measured), and after it the home misses
a round now and then (its round runs on a link slower than the others'; a missed round is replayed). In
a one-minute window of about 13 steps, the share counted from the join was 57 to 86% over 28 runs of
the 6 Mbit/s link on a busy machine, and 5 of them fell under two thirds (trio schedules the tasks ready
at one instant in a random order, so runs differ). After the chase, over two minutes (about 25 steps), it
was 83 to 92% over 6 runs.
"""

from __future__ import annotations

import argparse

import pytest
import trio
import trio.testing

from simulations.benchmarks.statesync_catchup import swarm

# (the home's access link in Mbit/s, the model's parameters, compute seconds per step): one step's
# result takes most of the swarm's step on the home's link (its state, 4.8 MB, is hashed inline)
LINKS = [(4.0, 400_000, 3.0), (6.0, 400_000, 2.0)]


CHASE_STEPS = 5  # the most swarm steps from the home's join to its first averaged step


@pytest.mark.timeout(300)  # ~20 s of CPU each
@pytest.mark.parametrize(("rate", "params", "step_s"), LINKS)
async def test_a_replaying_peer_never_leads_a_group_of_the_step_it_lands_on(
    autojump_clock: object, rate: float, params: int, step_s: float
) -> None:
    args = argparse.Namespace(
        rate_mbit=rate, params=params, fast=3, seconds=120.0, compute=1.0, step_s=step_s, access=True
    )
    with trio.fail_after(3600):  # virtual seconds
        result = await swarm(args, 4)
    assert result["identical"], (result["diverged"], result["home_outcomes"], result)
    assert result["downloads"] == 1, result
    assert result["replayed_steps"] >= 1, result  # it did chase (replay), the case this is about
    # and the chase ended: soon, and for good
    assert result["chase_steps"] is not None and result["chase_steps"] <= CHASE_STEPS, result
    assert result["averaged_after_chase"] >= 2 / 3 * result["steps_after_chase"], result
