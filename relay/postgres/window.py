"""Where a relay is in the ready lane (docs/decisions/0004): the window of committed transactions
its next claim reads, the cursor in it, when it verifies again, and what it has passed."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

#: A relay closes most windows without looking whether a row in them is still unclaimed (one it
#: skipped while another relay's claim held it, should that claim roll back); this often
#: (seconds) it walks again, and verifies, all it closed so since.
VERIFY_EVERY = 1.0
#: How long a window may stay open because a row in it is held by someone else's claim that has
#: not committed (seconds) before the relay moves on; the straggler sweep finds the row.
STRAGGLER_WAIT = 2.0
#: The sweep (PgStore.sweep_stragglers) looks only at rows this relay's windows passed at least
#: this long ago (seconds): far longer than a verify and a straggler's wait, so that what it
#: finds is what the windows gave up on, never a row one of them is about to claim.
SWEEP_AFTER = 30.0
#: How often (seconds) the window notes where it is for the sweep.
MARK_EVERY = 5.0
WHOLE_LANE = "1:1:"


@dataclasses.dataclass(slots=True)
class Window:
    """Where this relay is in the ready lane (docs/decisions/0004): the window of transactions
    that committed after snapshot `prev` and before `hi` (None: the next claim opens one), and
    the cursor in it. A relay's first window, and its first after an outage, starts where
    `lane_start` says (`needs_start`, then `start()`): at the first row with no claim, not at
    the lane's start. Every VERIFY_EVERY seconds a window covers again, and verifies, the windows
    closed unverified since; what a window gives up on is left to the straggler sweep, which
    `passed()` tells where the windows have been."""

    clock: Callable[[], float] = time.monotonic
    prev: str = WHOLE_LANE
    hi: str | None = None
    xid: str = "0"
    id: int = 0
    ready_first: bool = False
    needs_start: bool = True  # the next claim first asks lane_start where the window starts
    verifying: bool = False  # the open window is closed only once nothing in it is unclaimed
    unverified: str | None = None  # where the windows closed unverified since begin
    verify_at: float = 0.0
    stuck_since: float | None = None  # since when a row in the window is held by someone else
    #: (when, prev) every MARK_EVERY seconds, for passed(): snapshots every window ended after.
    marks: collections.deque[tuple[float, str]] = dataclasses.field(
        default_factory=collections.deque
    )

    def start(self, snapshot: str, xid: Any, id: int | None) -> None:
        """Take lane_start's answer: the window up to `snapshot`, from its first row with no
        claim (None: there is none, so the next window starts after `snapshot`). Every row
        visible in `snapshot` before that one was claimed, so the window's lower snapshot says
        every transaction before the row's committed (those that had not at `snapshot` are in
        its running list, and so in the next window), and it is walked and verified from there,
        like any window, not from the lane's start."""
        self.needs_start, self.stuck_since, self.unverified = False, None, None
        if id is None:
            self.prev, self.hi, self.xid, self.id, self.verifying = snapshot, None, "0", 0, False
        else:
            self.prev, self.hi, self.xid, self.id = f"{xid}:{xid}:", snapshot, str(xid), id - 1
            self.verifying = True

    def params(self) -> dict[str, Any]:
        if self.hi is None and self.unverified is not None and self.clock() >= self.verify_at:
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
        if _xmax(trailer.window_hi) < _xmax(self.prev):
            # The server's transaction ids went backwards (a crash that lost WAL, a failover to
            # an asynchronous standby): claim_batch walked the whole lane, and what this window
            # remembers belongs to the other timeline. Start again, as after an outage.
            self.forget()
            return
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
            self._close(trailer.window_hi)  # the sweep will find what is held

    def passed(self, age: float | None = None) -> str | None:
        """A snapshot every window of this relay ended after at least `age` seconds ago (by
        default SWEEP_AFTER; None: none yet): the rows visible in it that still have no claim
        were given up on."""
        age = SWEEP_AFTER if age is None else age
        now = self.clock()
        while len(self.marks) > 1 and now - self.marks[1][0] >= age:
            self.marks.popleft()
        if self.marks and now - self.marks[0][0] >= age:
            return self.marks[0][1]
        return None

    def forget_passed(self) -> None:
        """What the windows passed belongs to another timeline (the server's transaction ids
        went backwards): the sweep waits for new marks."""
        self.marks.clear()

    def forget(self) -> None:
        """After an outage (the server may have restarted, or failed over to a standby whose
        transaction ids are behind): ask lane_start again, and forget what was passed."""
        self.hi, self.xid, self.id, self.prev = None, "0", 0, WHOLE_LANE
        self.stuck_since, self.verifying, self.unverified = None, False, None
        self.needs_start = True
        self.forget_passed()

    def _close(self, hi: str) -> None:
        if not self.verifying and self.unverified is None:
            self.unverified, self.verify_at = self.prev, self.clock() + VERIFY_EVERY
        self.prev, self.hi, self.xid, self.id = hi, None, "0", 0
        self.stuck_since, self.verifying = None, False
        now = self.clock()
        if not self.marks or now - self.marks[-1][0] >= MARK_EVERY:
            self.marks.append((now, hi))


def _xmax(snapshot: str) -> int:
    """The xmax of a pg_snapshot's text form (xmin:xmax:xip,…)."""
    return int(snapshot.split(":", 2)[1])
