"""Running a relay inside the test's event loop, and small database helpers around it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import psycopg

import relay
from relay import app
from relay.core import config
from tests.support.wait import until_async


def settings_for(database_url: str, amqp_url: str, **overrides: Any) -> config.Settings:
    """Settings for an in-process relay: quick polling, a recognisable name; `overrides` win."""
    defaults: dict[str, Any] = {"poll_interval": 0.2, "relay_name": "test-relay"}
    return config.load(database_url=database_url, amqp_url=amqp_url, **(defaults | overrides))


@contextlib.asynccontextmanager
async def running(settings: config.Settings) -> AsyncIterator[app.Components]:
    stop = asyncio.Event()
    async with app.components(settings) as parts:
        task = asyncio.create_task(parts.relay.run(stop))
        try:
            yield parts
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def enqueue(url: str, *calls: dict[str, Any], commit: bool = True) -> list[UUID]:
    """Run enqueue calls in one transaction; commit or roll back."""
    async with await psycopg.AsyncConnection.connect(url) as conn:
        ids = [await relay.enqueue_async(conn, **call) for call in calls]
        await (conn.commit() if commit else conn.rollback())
    return ids


async def query(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute(sql, args)
        return await cur.fetchall()


async def wait_for_count(url: str, table: str, n: int, timeout: float = 30) -> None:
    async def reached() -> bool:
        return bool((await query(url, f"SELECT count(*) FROM outbox.{table}"))[0][0] >= n)

    await until_async(reached, timeout=timeout, message=f"{n} rows in {table}")
