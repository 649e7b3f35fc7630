"""relay.core.retry.reconnecting: back-off after quick losses, and a cancel always stops it."""

from __future__ import annotations

import asyncio

from relay.core import errors, retry


async def test_connections_lost_as_soon_as_made_are_not_remade_in_a_tight_loop() -> None:
    calls = 0
    losses: list[retry.Lost] = []

    async def serve() -> None:
        nonlocal calls
        calls += 1
        raise retry.Lost("ended at once")

    task = asyncio.create_task(retry.reconnecting(serve, lambda exc: None, losses.append))
    await asyncio.wait({task}, timeout=0.5)
    task.cancel()
    await asyncio.wait({task})
    # Without a back-off this is thousands; with it, the waits double from the third loss.
    assert 2 <= calls <= 8
    assert len(losses) == calls


async def test_a_cancel_that_surfaces_as_a_lost_connection_still_stops_it() -> None:
    serving = asyncio.Event()

    async def serve() -> None:
        serving.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # As a driver may: the connection closed under the cancelled call.
            raise errors.DatabaseUnavailable("connection closed") from None

    task = asyncio.create_task(retry.reconnecting(serve, lambda exc: None, lambda exc: None))
    await asyncio.wait_for(serving.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done
    assert task.cancelled()
