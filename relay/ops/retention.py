"""The relay's scheduled archive pruning: one replica at a time, in small paced batches."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from relay.core import retry
from relay.ops import metrics

log = logging.getLogger("relay.retention")  # the name log lines carry: as before the folders

#: Prunes the archive once, stopping between batches once the event is set; returns rows
#: deleted, or None if another pruner holds the lock.
Prune = Callable[[threading.Event], "int | None"]


class Pruner:
    """Runs `prune` every `interval` seconds in a worker thread (it is blocking and paced), so the
    relay loop never waits on it. A failed run is logged and counted, and tried again next time.
    Cancelling stops a run in progress after its current batch."""

    def __init__(self, prune: Prune, interval: float, counters: metrics.Metrics) -> None:
        self._prune = prune
        self._interval = interval
        self._metrics = counters

    async def run_once(self) -> int | None:
        """Prune now; rows deleted, None if skipped (another replica is pruning) or failed."""
        started = time.monotonic()
        stop = threading.Event()
        try:
            deleted = await asyncio.shield(asyncio.to_thread(self._prune, stop))
        except asyncio.CancelledError:
            stop.set()  # the thread ends after its batch; the process need not wait for the rest
            raise
        except Exception as exc:
            if not retry.is_transient(exc):
                log.exception("archive prune failed")
            else:
                log.warning("archive prune failed: %s", exc)
            self._metrics.prune_runs.labels("failed").inc()
            return None
        if deleted is None:
            log.info("archive prune skipped: another replica is pruning")
            self._metrics.prune_runs.labels("skipped").inc()
            return None
        self._metrics.prune_runs.labels("done").inc()
        self._metrics.pruned.inc(deleted)
        log.info("archive pruned: %d rows deleted in %.1fs", deleted, time.monotonic() - started)
        return deleted
