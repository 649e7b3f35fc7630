"""The database's upkeep beside the loop: the ready lane's stragglers and segments, idle keys."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Protocol

from relay.core import errors
from relay.ops import metrics

log = logging.getLogger("relay.app")  # the name these lines carried before they moved here

#: How often a relay looks for segments of the ready lane to TRUNCATE (docs/decisions/0004).
RECLAIM_INTERVAL = 5.0
#: How often a relay moves the ready rows its windows gave up on to messages (docs/decisions/0004).
SWEEP_INTERVAL = 30.0
#: How often a relay looks for ordering keys to forget (OUTBOX_KEY_RETENTION).
KEY_CHECK_INTERVAL = 3600.0


class Upkept(Protocol):
    """What the upkeep asks of the store."""

    async def reclaim(self) -> int: ...

    async def sweep_stragglers(self) -> int: ...

    async def release_all_orphans(self) -> int: ...

    async def forget_idle_keys(self, idle_for: float) -> int: ...


async def reclaim(store: Upkept) -> None:
    """TRUNCATE what the ready lane is done with; an outage only postpones it to the next."""
    await _counted(store.reclaim, "reclaim ready-lane segments", "reclaimed %d ready-lane segments")


async def sweep(store: Upkept) -> None:
    """Move the ready lane's stragglers to messages; an outage only postpones it to the next.
    Rare: each is a row whose claim rolled back after another relay's window passed it."""
    await _counted(
        store.sweep_stragglers,
        "sweep the ready lane's stragglers",
        "moved %d ready-lane rows no claim took to messages",
        logging.INFO,
    )


async def orphans(store: Upkept) -> None:
    """Look for the ready lane's orphans among every lease that ran out; an outage only
    postpones it to the next."""
    await _counted(
        store.release_all_orphans,
        "look for the ready lane's orphans",
        "moved %d ready-lane rows whose lease ran out to messages",
        logging.INFO,
    )


async def _counted(
    work: Callable[[], Awaitable[int]], what: str, done: str, level: int = logging.DEBUG
) -> None:
    """Run one pass of a chore of the lane; an outage is logged (DEBUG) and left to the next."""
    try:
        n = await work()
    except errors.TransientError as exc:
        log.debug("could not %s: %s", what, exc)
        return
    if n:
        log.log(level, done, n)


async def forget_keys(store: Upkept, retention: float, counters: metrics.Metrics) -> None:
    """One pass over the keys; an outage only postpones it to the next."""
    try:
        forgotten = await store.forget_idle_keys(retention)
    except errors.TransientError as exc:
        log.warning("could not look for idle ordering keys: %s", exc)
        return
    counters.keys_forgotten.inc(forgotten)
    if forgotten:
        log.info("forgot %d ordering keys unused for %s", forgotten, timedelta(seconds=retention))
