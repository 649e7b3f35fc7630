"""The replay's pace: batches timed so that no second holds more than `rate` messages and one
batch, and the run keeps to `rate` on average. Pure: the clock and the sleep are given."""

from __future__ import annotations

import time
from collections.abc import Callable

from relay.core import errors


class Pacer:
    """Times batches that each commit in one transaction.

    Each batch is timed to commit its share of time (its rows / `rate`) after the one before it
    committed, however late its rows came (time spent reading counts towards the share). A
    batch starts that much earlier as the last one took to send, at most half a share, so that
    the run keeps to `rate` on average. A batch that waited (a lock, a slow disk) earns no
    credit: the one after it still starts a share after it committed, less at most half a share.

    Use: `wait()` before each batch, then `sent(moved, began, done)` with the rows it moved and
    the clock's readings before and after it."""

    def __init__(
        self,
        rate: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise errors.InvalidArgument("the rate must be positive")
        self.rate = rate
        self.clock = clock
        self._sleep = sleep
        self._next_at: float | None = None  # when the next batch should commit
        self._took = 0.0  # how long the last batch took to send: the next one starts earlier

    def wait(self) -> float:
        """Sleep until the next batch may start; the clock then (its `began`)."""
        if self._next_at is not None:
            ahead = self._next_at - self._took - self.clock()
            if ahead > 0:
                self._sleep(ahead)
        return self.clock()

    def sent(self, moved: int, began: float, done: float) -> None:
        """A batch that moved `moved` rows committed at `done`, having started at `began`."""
        share = moved / self.rate
        self._next_at = done + share
        self._took = min(done - began, share / 2)
