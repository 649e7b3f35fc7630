"""When an idle relay looks again: a producer's NOTIFY, the doorbell's promise, or the poll.

NOTIFY is a hint and polling the guarantee. With a doorbell (docs/decisions/0008), producers
notify only while some relay holds it, so a relay sleeps only once a look that began after it took
the doorbell found nothing: every producer that committed without notifying did so before it was
taken, and that look saw their rows."""

from __future__ import annotations

import asyncio

from relay.core import ports, waiting


class Waker:
    """The loop calls `looking()` as each cycle begins, `busy()` while it works back to back, and
    `sleep()` when a cycle found nothing to do."""

    def __init__(
        self, wake: asyncio.Event, doorbell: ports.Doorbell | None, poll_interval: float
    ) -> None:
        self.wake = wake
        self._doorbell = doorbell
        self._poll = poll_interval
        self._looking_after: int | None = None  # the arm the current cycle's look began after

    def looking(self, claimed_ahead: bool) -> None:
        """A cycle begins. A wake-up that came after the next batch was claimed (with the last
        settle) is for rows that claim did not see: it is kept for after that batch."""
        if not claimed_ahead:
            self.wake.clear()
        bell = self._doorbell
        self._looking_after = bell.arms if bell is not None and bell.armed.is_set() else None

    def busy(self) -> None:
        """Working back to back: producers need not wake this relay."""
        if self._doorbell is not None:
            self._doorbell.disarm()

    async def sleep(self, stop: asyncio.Event) -> None:
        """Wait for a NOTIFY, `stop` or the poll interval. A relay that does not hold the
        doorbell yet arms it and ends this wait once it is held (the next cycle looks once more);
        one whose doorbell went with its session looks again too."""
        bell = self._doorbell
        if bell is None:
            await waiting.any_event((self.wake, stop), self._poll)
        elif not bell.armed.is_set():
            bell.arm()
            await waiting.any_event((self.wake, stop, bell.armed), self._poll)
        elif self._looking_after == bell.arms:
            await waiting.any_event((self.wake, stop, bell.lost), self._poll)
