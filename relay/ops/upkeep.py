"""The rescue beside the loop: rows every claim went past, and keyed rows a race left gated."""

from __future__ import annotations

import logging
from typing import Protocol

from relay.core import errors
from relay.ops import metrics

log = logging.getLogger("relay.app")  # the name these lines carried before they moved here

#: How often a relay looks behind its claims' cursors (docs/decisions/0004), and the longest a
#: row that got there waits: one whose producer committed more than a second after inserting it,
#: or whose claim rolled back after another relay's claim went past it. Rechecks of keyed rows
#: come sooner, at each producer's NOTIFY; this is their guarantee. Each look reads the rows
#: behind the cursors from the start: while the vacuum horizon is pinned, every dead one.
RESCUE_INTERVAL = 30.0


class Rescued(Protocol):
    """What the rescue asks of the store."""

    async def release_stranded(self) -> int: ...

    async def rescue(self) -> int: ...


async def rescue(store: Rescued, counters: metrics.Metrics) -> None:
    """One look; an outage only postpones it to the next."""
    try:
        released = await store.release_stranded()
        moved = await store.rescue()
    except errors.TransientError as exc:
        log.debug("could not look for rows left behind: %s", exc)
        return
    counters.rescued.inc(moved)
    if moved:
        log.info("found rows behind the claims' cursors: the next claim starts from them")
    if released:
        log.debug("released %d keyed rows on a recheck", released)
