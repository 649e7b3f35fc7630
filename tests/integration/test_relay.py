"""The whole relay in-process (app.components): real PostgreSQL, real RabbitMQ, real outcomes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from relay import app
from relay.core import config
from tests.support.amqp import Broker
from tests.support.inprocess import enqueue, query, running, settings_for, wait_for_count


@pytest.fixture
def settings(database_url: str, amqp_url: str) -> config.Settings:
    return settings_for(database_url, amqp_url)


async def test_committed_message_is_delivered_once_and_archived(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare()
    async with running(settings):
        (message_id,) = await enqueue(
            database_url,
            dict(
                exchange=broker.exchange,
                routing_key="order.created",
                body={"order": 1},
                headers={"tenant": "acme"},
            ),
        )
        (got,) = await broker.collect(1, settle=0.3)
    assert got.message_id == str(message_id)
    assert got.headers == {"tenant": "acme", "x-outbox-attempt": 1}
    assert got.body == b'{"order":1}'
    assert got.properties.content_type == "application/json"
    archived = await query(
        database_url, "SELECT message_id, attempts, published_at >= created_at FROM outbox.archive"
    )
    assert archived == [(message_id, 1, True)]
    assert await query(database_url, "SELECT count(*) FROM outbox.messages") == [(0,)]


async def test_rolled_back_message_is_never_published(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare()
    async with running(settings):
        await enqueue(
            database_url,
            dict(exchange=broker.exchange, routing_key="ghost", body=b""),
            commit=False,
        )
        (sentinel,) = await enqueue(
            database_url, dict(exchange=broker.exchange, routing_key="real", body=b"")
        )
        got = await broker.collect(1, settle=0.5)
    assert [(g.routing_key, g.message_id) for g in got] == [("real", str(sentinel))]


async def test_twenty_rows_in_one_transaction_all_arrive(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare()
    async with running(settings):
        ids = await enqueue(
            database_url,
            *(dict(exchange=broker.exchange, routing_key=f"k.{i}", body=str(i)) for i in range(20)),
        )
        got = await broker.collect(20, settle=0.3)
    assert sorted(g.message_id for g in got) == sorted(str(i) for i in ids)


async def test_unroutable_message_is_dead_lettered_not_lost(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare(binding="bound.*")
    async with running(settings):
        (message_id,) = await enqueue(
            database_url,
            dict(
                exchange=broker.exchange,
                routing_key="nobody.listens",
                body=b"keep me",
                headers={"h": 1},
                properties={"correlation_id": "c"},
            ),
        )
        await wait_for_count(database_url, "dead", 1)
    dead = await query(
        database_url,
        "SELECT message_id, reason, detail, body, headers, properties, attempts FROM outbox.dead",
    )
    assert dead == [
        (
            message_id,
            "unroutable",
            "returned by the broker: 312 NO_ROUTE",
            b"keep me",
            {"h": 1},
            {"correlation_id": "c", "content_type": "application/octet-stream"},
            1,
        )
    ]


async def test_missing_exchange_is_dead_lettered_and_later_rows_flow(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare()
    async with running(settings):
        (lost,) = await enqueue(
            database_url, dict(exchange=f"{broker.exchange}.nope", routing_key="k", body=b"")
        )
        await wait_for_count(database_url, "dead", 1)
        later = await enqueue(
            database_url,
            *(dict(exchange=broker.exchange, routing_key="k", body=b"") for _ in range(3)),
        )
        got = await broker.collect(3, settle=0.3)
    assert sorted(g.message_id for g in got) == sorted(str(i) for i in later)
    assert await query(database_url, "SELECT message_id, reason FROM outbox.dead") == [
        (lost, "no_exchange")
    ]


async def test_nacked_message_is_retried_then_dead_lettered(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    settings = settings_for(database_url, amqp_url, max_attempts=3, retry_delay=0.05)
    async with running(settings):
        await enqueue(database_url, dict(exchange=broker.exchange, routing_key="k", body=b""))
        await wait_for_count(database_url, "dead", 1)
    assert await query(database_url, "SELECT reason, attempts FROM outbox.dead") == [
        ("max_attempts", 3)
    ]


async def test_future_available_at_is_respected(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare()
    async with running(settings):
        (message_id,) = await enqueue(
            database_url,
            dict(
                exchange=broker.exchange,
                routing_key="later",
                body=b"",
                available_at=timedelta(seconds=1.5),
            ),
        )
        (got,) = await broker.collect(1)
    assert got.message_id == str(message_id)
    (waited,) = await query(database_url, "SELECT published_at - created_at FROM outbox.archive")
    assert waited[0] >= timedelta(seconds=1.5)


async def test_database_time_zone_changes_nothing(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "DO $$ BEGIN EXECUTE format("
            "'ALTER DATABASE %I SET timezone = ''Pacific/Kiritimati''',"
            " current_database()); END $$"
        )
    await broker.declare()
    due = datetime.now(UTC) + timedelta(seconds=1)
    async with running(settings_for(database_url, amqp_url)):
        (message_id,) = await enqueue(
            database_url,
            dict(exchange=broker.exchange, routing_key="tz", body=b"", available_at=due),
        )
        (got,) = await broker.collect(1)
    (row,) = await query(
        database_url,
        "SELECT current_setting('TimeZone'), created_at, published_at FROM outbox.archive",
    )
    zone, created_at, published_at = row
    assert zone == "Pacific/Kiritimati"  # UTC+14: a naive conversion anywhere would be 14 hours off
    assert published_at >= due
    assert got.properties.timestamp is not None
    assert abs((got.properties.timestamp - created_at).total_seconds()) < 1
    assert got.message_id == str(message_id)


async def test_stats_reflect_the_outbox(
    settings: config.Settings, database_url: str, broker: Broker
) -> None:
    await broker.declare(binding="ok")
    await enqueue(
        database_url,
        dict(exchange=broker.exchange, routing_key="ok", body=b""),
        dict(exchange=broker.exchange, routing_key="unbound", body=b""),
        dict(exchange=broker.exchange, routing_key="ok", body=b"", available_at=timedelta(hours=1)),
    )
    before = await app.stats(settings)
    assert (before.pending, before.due, before.scheduled, before.archived) == (3, 2, 1, 0)
    async with running(settings):
        await wait_for_count(database_url, "dead", 1)
        await wait_for_count(database_url, "archive", 1)
    after = await app.stats(settings)
    assert (after.pending, after.due, after.scheduled, after.in_flight) == (1, 0, 1, 0)
    assert (after.archived, after.dead, after.dead_by_reason) == (1, 1, {"unroutable": 1})


async def test_stats_and_the_gauges_count_due_the_same_way(
    settings: config.Settings, database_url: str
) -> None:
    """Due means claimable now, in `stats` as in the gauges: a message behind an earlier one of
    its key is gated, not due (stats once said `due 3 … gated 3` while the gauge said 0)."""
    await enqueue(
        database_url,
        *[dict(exchange="x", routing_key="k", body=b"", ordering_key="order-1")] * 3,
        dict(exchange="x", routing_key="k", body=b"", available_at=timedelta(hours=1)),
    )
    stats = await app.stats(settings)
    seen = stats.observation
    assert seen is not None
    assert (stats.pending, stats.due, stats.scheduled, stats.gated) == (4, 1, 1, 2)
    assert (seen.due, seen.scheduled, seen.gated) == (stats.due, stats.scheduled, stats.gated)
    with psycopg.connect(database_url) as conn:  # its relay died: the lease ran out
        conn.execute(
            "UPDATE outbox.messages SET claim_id = gen_random_uuid(), available_at = now()"
            " WHERE ordering_key = 'order-1' AND NOT gated"
        )
    stats = await app.stats(settings)
    seen = stats.observation
    assert seen is not None
    assert (stats.due, stats.in_flight, seen.due, seen.in_flight) == (1, 0, 1, 0)
