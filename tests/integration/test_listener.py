"""The LISTEN connection: wakes the relay on commit, and comes back after being killed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest

import relay
from relay.postgres.listener import Listener
from tests.support.wait import until_async


@pytest.fixture
async def listener(database_url: str) -> AsyncIterator[Listener]:
    listening = Listener(database_url, "outbox", asyncio.Event())
    task = asyncio.create_task(listening.run())
    await asyncio.wait_for(listening.connected.wait(), 10)
    yield listening
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def enqueue_one(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        await relay.enqueue_async(conn, "x", "k", b"")
        await conn.commit()


async def test_commit_wakes_the_relay(listener: Listener, database_url: str) -> None:
    listener.wake.clear()
    await enqueue_one(database_url)
    await asyncio.wait_for(listener.wake.wait(), 10)
    assert listener.notifications == 1


async def terminate_listener(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE query LIKE 'LISTEN%%' AND datname = current_database()"
        )
        assert [row[0] for row in await cur.fetchall()] == [True]


async def test_listener_reconnects_after_its_backend_is_terminated(
    listener: Listener, database_url: str
) -> None:
    await terminate_listener(database_url)

    async def reconnected() -> bool:
        return listener.connects == 2 and listener.connected.is_set()

    await until_async(reconnected, timeout=10, message="the listener to reconnect")
    listener.wake.clear()
    await enqueue_one(database_url)
    await asyncio.wait_for(listener.wake.wait(), 10)


async def test_a_listener_that_outlived_many_outages_still_comes_back_at_once(
    database_url: str,
) -> None:
    # Its back-off once counted every loss of the process's life: after ten, each reconnect
    # waited 25-30 s (during which only polling woke the relay). Every loss here counts as one
    # after a connection that lived (quick_loss=0), as outages days apart do.
    listener = Listener(database_url, "outbox", asyncio.Event(), quick_loss=0.0)
    listening = asyncio.create_task(listener.run())
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        for lost in range(1, 13):
            await terminate_listener(database_url)

            async def reconnected(expected: int = lost + 1) -> bool:
                return listener.connects == expected and listener.connected.is_set()

            await until_async(reconnected, timeout=5, message=f"reconnect {lost} to come at once")
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)


async def test_a_commit_that_queued_a_key_recheck_wakes_the_relays(
    listener: Listener, database_url: str
) -> None:
    # A keyed commit whose predecessor is locked (as by a relay's settle) queues a recheck, which
    # the next claim of any relay runs: it wakes a relay that sleeps, so that one comes.
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await relay.enqueue_async(conn, "x", "k", b"1", ordering_key="k")
        await conn.commit()
        await asyncio.wait_for(listener.wake.wait(), 10)
        listener.wake.clear()
        settling = await psycopg.AsyncConnection.connect(database_url)
        await settling.execute("SELECT 1 FROM outbox.messages WHERE seq = 1 FOR UPDATE")
        await relay.enqueue_async(conn, "x", "k", b"2", ordering_key="k")
        await conn.commit()
        await settling.close()
        checks = await conn.execute("SELECT count(*) FROM outbox.key_checks")
        assert await checks.fetchone() == (1,)
    await asyncio.wait_for(listener.wake.wait(), 10)
