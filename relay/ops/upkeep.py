"""The database's upkeep beside the loop: the ready lane's stragglers and segments, idle keys."""

from __future__ import annotations

import logging
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
    try:
        reclaimed = await store.reclaim()
    except errors.TransientError as exc:
        log.debug("could not reclaim ready-lane segments: %s", exc)
        return
    if reclaimed:
        log.debug("reclaimed %d ready-lane segments", reclaimed)


async def sweep(store: Upkept) -> None:
    """Move the ready lane's stragglers to messages; an outage only postpones it to the next."""
    try:
        moved = await store.sweep_stragglers()
    except errors.TransientError as exc:
        log.debug("could not sweep the ready lane's stragglers: %s", exc)
        return
    if moved:
        # Rare: each is a row whose claim rolled back after another relay's window passed it.
        log.info("moved %d ready-lane rows no claim took to messages", moved)


async def orphans(store: Upkept) -> None:
    """Look for the ready lane's orphans among every lease that ran out; an outage only
    postpones it to the next."""
    try:
        moved = await store.release_all_orphans()
    except errors.TransientError as exc:
        log.debug("could not look for the ready lane's orphans: %s", exc)
        return
    if moved:
        log.info("moved %d ready-lane rows whose lease ran out to messages", moved)


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
