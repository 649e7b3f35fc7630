"""relay.core.waiting: the first of several things, and a cancellation that is never swallowed."""

from __future__ import annotations

import asyncio

import pytest

from relay.core import waiting


async def test_any_event_returns_with_the_first_event_and_leaves_no_waiter_behind() -> None:
    first, second = asyncio.Event(), asyncio.Event()
    before = len(asyncio.all_tasks())
    waiter = asyncio.create_task(waiting.any_event((first, second), None))
    await asyncio.sleep(0)
    assert not waiter.done()
    second.set()
    await asyncio.wait_for(waiter, 5)
    assert len(asyncio.all_tasks()) == before


async def test_any_event_returns_after_its_deadline() -> None:
    await asyncio.wait_for(waiting.any_event((asyncio.Event(),), 0.01), 5)


@pytest.mark.parametrize("turns", range(8))
async def test_a_cancel_that_lands_while_the_waiters_are_put_away_is_kept(turns: int) -> None:
    # The doorbell's chore hung at shutdown (docs/decisions/0008): the relay let go of it, which
    # ended its wait, and the chore's cancel landed in the turn in which the wait put its waiters
    # away — and was swallowed. Each case cancels a given number of turns after the event.
    event, never = asyncio.Event(), asyncio.Event()

    async def sleeper() -> None:
        await waiting.any_event((event,), None)
        await never.wait()  # a swallowed cancel leaves the task here

    task = asyncio.create_task(sleeper())
    await asyncio.sleep(0)
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    assert task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done
    assert task.cancelled()
