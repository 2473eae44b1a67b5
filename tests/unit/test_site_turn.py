"""A site's turn (``site.turn``): one owner at a time enters the site's collectives, first come first
served; the training loop's turns nest; a sync section on the event loop never waits and refuses to
enter another owner's turn; a worker thread waits for its turn through the loop."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2ptrain.training.site.turn import Owner, Turn

pytestmark = pytest.mark.timeout(30)


async def test_turns_go_first_come_first_served(autojump_clock: trio.testing.MockClock) -> None:
    turn, entered = Turn(), []
    turn.enter_now(Owner.TRAINING)

    async def wait_for(who: Owner) -> None:
        async with turn.taken(who):
            entered.append(who)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for who in (Owner.HASH, Owner.DOWNLOAD, Owner.HASH):
            nursery.start_soon(wait_for, who)
            await trio.sleep(0.1)
        async with turn.taken(Owner.TRAINING):  # (the training loop's turns nest)
            assert (turn.owner, turn.depth) == (Owner.TRAINING, 2)
        assert entered == []
        turn.give(Owner.TRAINING)
    assert entered == [Owner.HASH, Owner.DOWNLOAD, Owner.HASH]
    assert turn.owner is None


async def test_a_sync_section_never_enters_another_owners_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    turn = Turn()
    turn.enter_now(Owner.HASH)
    with pytest.raises(RuntimeError, match=r"the training loop would enter .* while the state's hash"):
        turn.enter_now(Owner.TRAINING)
    with pytest.raises(RuntimeError, match="does not hold"):
        turn.give(Owner.DOWNLOAD)
    got = trio.Event()

    async def download() -> None:
        async with turn.taken(Owner.DOWNLOAD):
            got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(download)
        await trio.sleep(0.1)
        turn.give(Owner.HASH)  # (the waiter is woken, but has not run yet)
        with turn.held(Owner.TRAINING):  # a sync section goes first: nothing of the waiter's was sent
            assert turn.owner is Owner.TRAINING and not got.is_set()
        await got.wait()
    assert turn.owner is None


async def test_a_cancelled_waiter_passes_its_place_on(autojump_clock: trio.testing.MockClock) -> None:
    turn, entered, scopes = Turn(), [], []
    turn.enter_now(Owner.HASH)

    async def wait_for(who: Owner) -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            async with turn.taken(who):
                entered.append(who)

    async with trio.open_nursery() as nursery:
        for who in (Owner.DOWNLOAD, Owner.TRAINING):
            nursery.start_soon(wait_for, who)
            await trio.sleep(0.1)
        scopes[0].cancel()  # (the first in line gives up its place)
        await trio.sleep(0.1)
        turn.give(Owner.HASH)
    assert entered == [Owner.TRAINING] and turn.owner is None


async def test_a_worker_thread_waits_for_its_turn() -> None:
    turn, order = Turn(), []
    turn.enter_now(Owner.HASH)

    def batch() -> None:
        with turn.held(Owner.TRAINING):
            order.append("batch")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, batch)
            await trio.sleep(0.2)
            order.append("hash")
            turn.give(Owner.HASH)
    assert order == ["hash", "batch"] and turn.owner is None


def test_without_an_event_loop_a_turn_is_taken_at_once_or_refused() -> None:
    turn = Turn()
    with turn.held(Owner.TRAINING), turn.held(Owner.TRAINING):
        assert turn.depth == 2
        with pytest.raises(RuntimeError):
            turn.take(Owner.HASH)
    assert turn.owner is None
