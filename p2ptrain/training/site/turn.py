"""Whose turn it is to enter a site's collectives, on rank 0.

Theory of operation. The other ranks of a site run one command at a time and enter its collectives in
the order rank 0's commands name them (``commands``). So rank 0 must never have two collectives of the
site's group in flight at once, from two threads, nor enter them in another order than it sent the
commands. The invariant: **every collective of a site's group is issued by one owner at a time, in the
order the commands were sent.** The right to send commands and run rank 0's part of them is a *turn*;
:class:`Turn` gives it to one :class:`Owner` at a time:

- ``TRAINING``, the training loop: a batch's turn, taken by its TRAIN, lasts until the loop is between
  two batches again (``SiteRank.start_batch`` to ``SiteRank.end_batch``: the batch's FSDP2
  all-gathers and reduce-scatters run in a worker thread, the clip's norm in the inner step after it);
  each EVAL, SAVE, LOAD, SEED and STOP, and the outer step's commands sent between two batches
  (CONTRIBUTE, LAND, ALONE, ADOPT), take a turn of their own. The training loop is one actor over its
  tasks and threads, so its turns nest.
- ``HASH``: the state's digest, one turn for the whole assembly of every chunk (HASH), which runs in a
  worker thread: seconds at 1B parameters during which the event loop keeps serving.
- ``DOWNLOAD``: one downloaded chunk placed in the ranks' staging shards (PLACE).

The turn's state lives on the event loop's thread; a worker thread takes and gives a turn through
``trio.from_thread``. Those that wait are served first come first served (each sends its command once
it has the turn, so the commands go out in that order). Code on the event loop's thread that cannot
wait (a sync method) takes a free turn at once, ahead of waiters that were woken but did not run yet
(nothing of theirs was sent), and raises if another owner is inside its turn: that caller broke the
rule that nobody changes the site's state while its hash holds it (``SharedState.holds``: a hash's
turn and its hold are one span, see ``peer.SiteState``). With no event loop at all (a rank driven by a
test, one thread) a turn is taken at once or refused the same way.
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import trio


class Owner(enum.Enum):
    TRAINING = "the training loop"
    HASH = "the state's hash"
    DOWNLOAD = "a download's chunk"


@dataclass(eq=False)
class _Waiter:
    who: Owner
    woken: trio.Event = field(default_factory=trio.Event)


def _in_worker_thread() -> bool:
    """Whether this thread is one of ``trio.to_thread``'s (it reaches the loop through ``from_thread``)."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        pass
    else:
        return False  # the event loop's own thread
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:
        return False  # no event loop at all
    except trio.Cancelled:
        pass  # (its task is being cancelled: a turn given back still goes back)
    return True


class Turn:
    """Rank 0: who enters the site's collectives now (see the module's docstring)."""

    def __init__(self) -> None:
        self.owner: Owner | None = None
        self.depth = 0  # the owner's nested turns (the training loop's only)
        self._waiters: deque[_Waiter] = deque()

    def free_for(self, who: Owner) -> bool:
        """Whether ``who`` may enter now (the turn is free, or the training loop's and ``who`` is it)."""
        return self.owner is None or self.owner is who is Owner.TRAINING

    # ---- on the event loop's thread ----

    async def wait(self, who: Owner) -> None:
        """Wait for ``who``'s turn (after those already waiting); :meth:`give` it back."""
        if self.free_for(who) and (not self._waiters or self.owner is who):
            self._enter(who)
            return
        me = _Waiter(who)
        self._waiters.append(me)
        try:
            while self._waiters[0] is not me or not self.free_for(who):
                await me.woken.wait()
                me.woken = trio.Event()
        finally:
            self._waiters.remove(me)
            self._wake_first()  # (cancelled while first, or the next one's place moved up)
        self._enter(who)

    def enter_now(self, who: Owner) -> None:
        """Take ``who``'s turn without waiting; RuntimeError if another owner is inside its own."""
        if not self.free_for(who):
            assert self.owner is not None
            raise RuntimeError(
                f"{who.value} would enter the site's collectives while {self.owner.value} is inside its"
                " turn (the other ranks would see the two interleaved)"
            )
        self._enter(who)

    def give(self, who: Owner) -> None:
        """``who``'s turn ends; the first waiter is woken."""
        if self.owner is not who:
            raise RuntimeError(f"{who.value} gives back a turn it does not hold")
        self.depth -= 1
        if self.depth:
            return
        self.owner = None
        self._wake_first()

    def _enter(self, who: Owner) -> None:
        self.owner = who
        self.depth += 1

    def _wake_first(self) -> None:
        if self._waiters:
            self._waiters[0].woken.set()

    @contextlib.asynccontextmanager
    async def taken(self, who: Owner) -> AsyncIterator[None]:
        """``async with turn.taken(who):`` a turn waited for on the event loop, given back after."""
        await self.wait(who)
        try:
            yield
        finally:
            self.give(who)

    # ---- from any thread ----

    def take(self, who: Owner) -> None:
        """Take ``who``'s turn: a worker thread waits for it; the event loop's thread (which cannot
        wait) or a process with no event loop takes it at once or raises (see :meth:`enter_now`)."""
        if _in_worker_thread():
            trio.from_thread.run(self.wait, who)
        else:
            self.enter_now(who)

    def give_back(self, who: Owner) -> None:
        """:meth:`give`, from any thread."""
        if _in_worker_thread():
            trio.from_thread.run_sync(self.give, who)
        else:
            self.give(who)

    @contextlib.contextmanager
    def held(self, who: Owner) -> Iterator[None]:
        """``with turn.held(who):`` a turn for a block of sync code (see :meth:`take`)."""
        self.take(who)
        try:
            yield
        finally:
            self.give_back(who)
