"""Waiting on whichever of several things happens first, with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def ready(value: T) -> asyncio.Future[T]:
    """A future that already holds `value`."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def any_event(events: Sequence[asyncio.Event], seconds: float | None) -> None:
    """Return when any event is set or after `seconds`, whichever is first."""
    await any_of([e.wait() for e in events], seconds)


async def done_or_set(task: asyncio.Future[Any], event: asyncio.Event) -> None:
    """Return when `task` is done or `event` is set, whichever is first; `task` keeps running."""
    setting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, setting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        setting.cancel()


async def any_of(awaitables: Sequence[Awaitable[object]], seconds: float | None) -> None:
    """Return when any awaitable is done or after `seconds`; cancel the rest."""
    waiters = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await finish(*waiters)


async def finish(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and wait until they have ended, whatever they raise. A cancel of the caller
    while it waits propagates: one swallowed here once left the doorbell's chore running after
    it was stopped (`contextlib.suppress(CancelledError)` around the await would swallow it)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
