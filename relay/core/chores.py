"""Background chores under supervision: a chore that fails is logged with its error, counted and run
again after a back-off, and one stuck in a run shows in liveness. No chore dies silently."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from relay.core import logs, retry, waiting

log = logging.getLogger("relay.chores")  # the name log lines carry: as before the folders


class Chore:
    """Runs `run_once` every `interval` seconds (or, after a run that worked, as long as `pace()`
    says) until cancelled.

    Any exception but cancellation is logged at ERROR with its traceback and passed to `on_error`
    (the metrics count it); the chore then runs again after a back-off that doubles from
    `interval` (at least retry.FIRST_WAIT) up to `max_backoff` (retry.LONGEST_WAIT), and a success
    resets it. Outages are the
    chores' own business: they log and ride them out, so what reaches here is a bug, a schema or
    grant problem, or bad data — worth an ERROR each time, never worth stopping the relay for."""

    def __init__(
        self,
        name: str,
        run_once: Callable[[], Awaitable[object]],
        interval: float,
        *,
        stall_after: float | None = None,
        max_backoff: float = retry.LONGEST_WAIT,
        on_error: Callable[[str], None] | None = None,
        wake: asyncio.Event | None = None,
        pace: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._wake = wake  # set: run again now, without waiting out the interval
        self._pace = pace  # after a run that worked: how long until the next, else `interval`
        self._run_once = run_once
        self._interval = interval
        self._stall_after = stall_after
        self._max_backoff = max_backoff
        self._on_error = on_error
        self._clock = clock
        self._running_since: float | None = None
        #: Runs that failed in a row (0 once one succeeds).
        self.failures = 0

    async def run(self) -> None:
        """Run until cancelled; never raises anything else."""
        while True:
            if self._wake is not None:
                self._wake.clear()  # one set during the run calls for another
            delay = await self.run_once()
            if self._wake is None:
                await asyncio.sleep(delay)
            else:
                await waiting.any_event((self._wake,), delay)

    async def run_once(self) -> float:
        """One supervised run; how long to wait before the next."""
        self._running_since = self._clock()
        try:
            await self._run_once()
        except Exception as exc:  # the point of a supervisor: log, count, go on
            self.failures += 1
            first = max(self._interval, retry.FIRST_WAIT)
            delay = min(self._max_backoff, first * 2.0 ** (self.failures - 1))
            log.error(
                "chore %s failed (%s: %s); trying again in %.1fs",
                self.name,
                type(exc).__name__,
                exc,
                delay,
                exc_info=exc,
                extra=logs.event(event="chore_failed", chore=self.name, failures=self.failures),
            )
            if self._on_error is not None:
                self._on_error(self.name)
            return delay
        finally:
            self._running_since = None
        if self.failures:
            log.info("chore %s works again after %d failures", self.name, self.failures)
            self.failures = 0
        return self._interval if self._pace is None else self._pace()

    def stuck(self) -> float | None:
        """How long the run in progress has gone on, if longer than `stall_after` (a hung call);
        else None."""
        since = self._running_since
        if since is None or self._stall_after is None:
            return None
        running = self._clock() - since
        return running if running > self._stall_after else None
