"""Where a relay is in the ready lane (docs/decisions/0004): the window of committed transactions
its next claim reads, the cursor in it, and when it walks the whole lane or verifies again."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

#: A relay walks the whole ready lane at least this often (seconds): rows a window had to leave
#: behind are found then — only those held past STRAGGLER_WAIT by a claim that then rolled back
#: (a relay stalled mid-claim, then cut off), which is rare; the walk reads every row of the
#: lane (up to 4 segments of 131,072), which is not free, so not often.
FULL_PASS_EVERY = 300.0
#: A relay closes most windows without looking whether a row in them is still unclaimed (one it
#: skipped while another relay's claim held it, should that claim roll back); this often
#: (seconds) it walks again, and verifies, all it closed so since.
VERIFY_EVERY = 1.0
#: How long a window may stay open because a row in it is held by someone else's claim that has
#: not committed (seconds) before the relay moves on; the next full pass finds the row.
STRAGGLER_WAIT = 2.0
WHOLE_LANE = "1:1:"


@dataclasses.dataclass(slots=True)
class Window:
    """Where this relay is in the ready lane (docs/decisions/0004): the window of transactions
    that committed after snapshot `prev` and before `hi` (None: the next claim opens one), and
    the cursor in it. A new relay's first window covers the whole lane, and so does one at least
    every FULL_PASS_EVERY seconds; every VERIFY_EVERY seconds one covers again, and verifies, the
    windows closed unverified since."""

    clock: Callable[[], float] = time.monotonic
    prev: str = WHOLE_LANE
    hi: str | None = None
    xid: str = "0"
    id: int = 0
    ready_first: bool = False
    verifying: bool = False  # the open window is closed only once nothing in it is unclaimed
    unverified: str | None = None  # where the windows closed unverified since begin
    verify_at: float = 0.0
    full_pass_at: float | None = None  # when the last window over the whole lane opened
    stuck_since: float | None = None  # since when a row in the window is held by someone else

    def params(self) -> dict[str, Any]:
        now = self.clock()
        if self.hi is None:
            if self.full_pass_at is None or now - self.full_pass_at >= FULL_PASS_EVERY:
                self.prev, self.full_pass_at, self.unverified = WHOLE_LANE, now, None
                self.verifying = True
            elif self.unverified is not None and now >= self.verify_at:
                self.prev, self.unverified, self.verifying = self.unverified, None, True
        self.ready_first = not self.ready_first  # the lanes take turns to go first
        return {
            "prev": self.prev,
            "hi": self.hi,
            "xid": self.xid,
            "cursor": self.id,
            "ready_first": self.ready_first,
            "verify": self.verifying,
        }

    def moved(self, trailer: Any) -> None:
        """Take the window's state from a claim's trailer row."""
        if trailer.window_closed:
            self._close(trailer.window_hi)
            return
        # A window left open moved its cursor forward, or found a row in it still unclaimed (held
        # by another relay's claim that has not committed): the cursor went back to it, or stayed
        # there. Only moving forward is progress: a claim held open for minutes (a relay stalled
        # mid-claim) must not keep every relay's window open for as long.
        moved_on = (int(trailer.window_xid), trailer.window_id) > (int(self.xid), self.id)
        self.hi, self.xid, self.id = trailer.window_hi, str(trailer.window_xid), trailer.window_id
        if moved_on:
            self.stuck_since = None
        elif self.stuck_since is None:
            self.stuck_since = self.clock()
        elif self.clock() - self.stuck_since >= STRAGGLER_WAIT:
            self._close(trailer.window_hi)  # the full pass will find what is held

    def forget(self) -> None:
        """After an outage (the server may have restarted): walk the whole lane next, from its
        start."""
        self.hi, self.full_pass_at, self.xid, self.id = None, None, "0", 0
        self.stuck_since, self.verifying = None, False

    def _close(self, hi: str) -> None:
        if not self.verifying and self.unverified is None:
            self.unverified, self.verify_at = self.prev, self.clock() + VERIFY_EVERY
        self.prev, self.hi, self.xid, self.id = hi, None, "0", 0
        self.stuck_since, self.verifying = None, False
