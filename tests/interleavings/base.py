"""The interleaving world's state and plumbing (tests/interleavings/world.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from tests.interleavings.actors import (
    Held,
    HeldClaim,
    Producer,
    RelayActor,
    T,
    connect,
)
from tests.interleavings.ledger import Ledger


class WorldBase:
    """The world's state and plumbing: its event loop, virtual time, and how a step runs until
    every actor waits at a gate or on a lock (tests/interleavings/world.py)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.offset = 0.0
        self.ledger = Ledger()
        self.relays: list[RelayActor] = []
        self.held: list[Held] = []
        self.held_claims: list[HeldClaim] = []
        self.in_flight: list[tuple[str, asyncio.Task[Any]]] = []  # ops waiting on a lock
        self._names = itertools.count()
        self.monitor = self.run(connect(url, "monitor"))
        self.operator = self.run(connect(url, "operator"))
        self.producers = [Producer(f"producer-{n}", self.run(connect(url, f"producer-{n}")))
                          for n in range(2)]  # fmt: skip

    # -- time and plumbing -----------------------------------------------------------------

    def clock(self) -> float:
        return time.monotonic() + self.offset

    def virtual_time(self) -> float:
        """Only the time the test lets pass."""
        return self.offset

    def run(self, step: Awaitable[T]) -> T:
        return self.loop.run_until_complete(step)

    async def _quiet(self) -> None:
        """Let every actor run on until it waits at a gate (or on a lock): nothing they do
        between gates needs I/O, so a few hundred turns of the loop are plenty."""
        for _ in range(300):
            await asyncio.sleep(0)

    async def _until_done_or_waiting(
        self, who: str, task: asyncio.Task[Any], ran: asyncio.Event | None = None
    ) -> bool:
        """True once `task` is done (or `ran` is set); False if `who`'s session waits on a lock
        meanwhile."""
        deadline = time.monotonic() + 20
        while not task.done() and not (ran is not None and ran.is_set()):
            # Blocked by one of the world's sessions now: a session just woken by a commit may
            # still show its lock wait for a moment, but no longer has anyone blocking it. A
            # wait on a server process (autovacuum, where it is on, truncating a table's empty
            # tail holds ACCESS EXCLUSIVE for a moment) is only slowness: it passes.
            cur = await self.monitor.execute(
                "SELECT count(*) FROM pg_stat_activity w"
                " WHERE w.application_name = %s AND w.wait_event_type = 'Lock'"
                " AND EXISTS (SELECT 1 FROM pg_stat_activity b"
                "  WHERE b.pid = ANY(pg_blocking_pids(w.pid))"
                "  AND b.backend_type = 'client backend' AND b.application_name <> '')",
                [who],
            )
            row = await cur.fetchone()
            if row is not None and row[0] > 0:
                return False
            if time.monotonic() > deadline:
                raise AssertionError(f"{who}'s operation neither finished nor waited on a lock")
            await asyncio.sleep(0.001)
        return True

    async def _operate(self, who: str, work: Coroutine[Any, Any, Any]) -> bool:
        """Run `work`; leave it in flight if it waits on a lock. Whether it finished."""
        task = self.loop.create_task(work)
        done = await self._until_done_or_waiting(who, task)
        if done:
            task.result()
        else:
            self.in_flight.append((who, task))
        return done

    async def _catch_up(self) -> None:
        """Let operations in flight, and held settles' statements, finish where nothing blocks
        them any more. So what is finishable after a step is decided by the locks alone, never
        by how fast the server ran meanwhile: Hypothesis replays each case the same way."""
        for who, task in list(self.in_flight):
            if await self._until_done_or_waiting(who, task):
                self.in_flight.remove((who, task))
                task.result()
        await self._settle_held()
        await self._quiet()

    async def _settle_held(self) -> None:
        for held in self.held:
            if not held.done:
                await self._until_done_or_waiting(held.call.actor.name, held.task, held.ran)
