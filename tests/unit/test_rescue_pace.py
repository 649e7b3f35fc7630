"""The rescue's pace: a look that costs more comes less often (a pinned horizon makes every look
read all the dead rows), within its bounds; a find wakes the loop; an outage waits the longest."""

from __future__ import annotations

import asyncio

import prometheus_client
import pytest

from relay.core import chores, errors, retry
from relay.ops import metrics, upkeep


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Store:
    """Each look takes `took` seconds of the clock and finds `found` rows, or raises `fails`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.took = 0.0
        self.found = 0
        self.fails: Exception | None = None

    async def rescue(self) -> int:
        self.clock.now += self.took
        if self.fails is not None:
            raise self.fails
        return self.found


def rescue() -> tuple[upkeep.Rescue, Store, asyncio.Event]:
    clock = Clock()
    store = Store(clock)
    wake = asyncio.Event()
    counters = metrics.Metrics(prometheus_client.CollectorRegistry())
    return upkeep.Rescue(store, counters, wake, soonest=1.0, clock=clock), store, wake


async def test_the_next_look_waits_a_hundred_times_the_last_within_bounds() -> None:
    chore, store, _ = rescue()
    waits = []
    for took in (0.001, 0.05, 0.2, 2.0):
        store.took = took
        await chore.run_once()
        waits.append(chore.next_delay)
    assert waits == pytest.approx([1.0, 5.0, 20.0, retry.LONGEST_WAIT])


async def test_a_find_wakes_the_loop_and_nothing_found_does_not() -> None:
    chore, store, wake = rescue()
    await chore.run_once()
    assert not wake.is_set()
    store.found = 1
    await chore.run_once()
    assert wake.is_set()


async def test_an_outage_postpones_the_next_look_the_longest() -> None:
    chore, store, wake = rescue()
    store.fails = errors.DatabaseUnavailable("down")
    await chore.run_once()
    assert chore.next_delay == retry.LONGEST_WAIT
    assert not wake.is_set()


async def test_the_supervisor_waits_as_the_pace_says() -> None:
    chore, store, _ = rescue()
    store.took = 0.05
    supervised = chores.Chore(
        "rescue", chore.run_once, retry.LONGEST_WAIT, pace=lambda: chore.next_delay
    )
    assert await supervised.run_once() == pytest.approx(5.0)
