"""The rescue beside the loop: rows every claim went past."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from relay.core import errors, retry
from relay.ops import metrics

log = logging.getLogger("relay.app")  # the name these lines carried before they moved here

#: How often a relay looks behind its claims' cursors (docs/decisions/0004), which bounds how long
#: a row that got there waits: one whose producer committed more than a second after inserting it
#: (a long transaction, a bulk load), or whose claim rolled back after another relay's claim went
#: past it. Each look reads the rows behind the cursors from the start: a few index pages
#: normally, every dead row while the vacuum horizon is pinned. So the next look comes after
#: 1 / RESCUE_SHARE times as long as the last one took (a pinned horizon makes it rarer, never a
#: bigger share of a server process): no sooner than the loop's own poll (a find only wakes the
#: loop), no later than the relay's longest back-off (`retry.LONGEST_WAIT`, also the wait after
#: an outage).
RESCUE_SHARE = 0.01


class Rescued(Protocol):
    """What the rescue asks of the store."""

    async def rescue(self) -> int: ...


class Rescue:
    """The rescue chore: `run_once()` looks once; `next_delay` is when to look again. A find
    wakes the loop (`wake`), whose next claim starts from it."""

    def __init__(
        self,
        store: Rescued,
        counters: metrics.Metrics,
        wake: asyncio.Event,
        soonest: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._soonest = soonest
        self._counters = counters
        self._wake = wake
        self._clock = clock
        self.next_delay = soonest

    async def run_once(self) -> None:
        """One look; an outage only postpones it to the next."""
        began = self._clock()
        try:
            moved = await self._store.rescue()
        except errors.TransientError as exc:
            log.debug("could not look for rows left behind: %s", exc)
            self.next_delay = retry.LONGEST_WAIT
            return
        took = self._clock() - began
        self.next_delay = min(retry.LONGEST_WAIT, max(self._soonest, took / RESCUE_SHARE))
        self._counters.rescued.inc(moved)
        if moved:
            log.info("found rows behind the claims' cursors: the next claim starts from them")
            self._wake.set()
