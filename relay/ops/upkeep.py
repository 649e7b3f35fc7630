"""The rescue beside the loop: rows every claim went past."""

from __future__ import annotations

import logging
from typing import Protocol

from relay.core import errors
from relay.ops import metrics

log = logging.getLogger("relay.app")  # the name these lines carried before they moved here

#: How often a relay looks behind its claims' cursors (docs/decisions/0004), and the longest a
#: row that got there waits: one whose producer committed more than a second after inserting it,
#: or whose claim rolled back after another relay's claim went past it. Each look reads the rows
#: behind the cursors from the start: while the vacuum horizon is pinned, every dead one.
RESCUE_INTERVAL = 30.0


class Rescued(Protocol):
    """What the rescue asks of the store."""

    async def rescue(self) -> int: ...


async def rescue(store: Rescued, counters: metrics.Metrics) -> None:
    """One look; an outage only postpones it to the next."""
    try:
        moved = await store.rescue()
    except errors.TransientError as exc:
        log.debug("could not look for rows left behind: %s", exc)
        return
    counters.rescued.inc(moved)
    if moved:
        log.info("found rows behind the claims' cursors: the next claim starts from them")
