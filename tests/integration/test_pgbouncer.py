"""Behind a real PgBouncer in transaction pooling mode (Debian's, started on a free port): producers
enqueue through it (psycopg, SQLAlchemy, SQL); the relay runs through it, woken by NOTIFY over a
direct LISTEN URL or polling without one; the settings it can no longer set per session must be
the role's; and the locks that keep one migrate, one pruner and one pipeline run at a time still
exclude through it, where session-level advisory locks would not."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import relay
from relay.core import errors
from relay.core.filters import DeadFilter
from relay.pipeline.database import PipelineDatabase
from relay.postgres import admin, locks, migrate
from relay.postgres.store import PgStore
from tests.integration.test_dead_letters import archive, insert_dead
from tests.support.amqp import Broker
from tests.support.inprocess import running, settings_for
from tests.support.pgbouncer import pgbouncer
from tests.support.wait import until

pytestmark = pytest.mark.slow


@pytest.fixture
def bouncer(database_url: str) -> Iterator[str]:
    with pgbouncer(database_url) as url:
        yield url


def count(url: str, sql: str) -> int:
    with psycopg.connect(url, prepare_threshold=None) as conn:
        row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def test_producers_enqueue_through_it(bouncer: str, database_url: str) -> None:
    # More transactions than psycopg's prepare threshold (5): told there is a pooler, it never
    # prepares, so no statement is looked for on a server connection that never saw it.
    with psycopg.connect(bouncer, prepare_threshold=None) as conn:
        for n in range(12):
            relay.enqueue(conn, "x", "psycopg", str(n).encode())
            conn.commit()
    engine = sa.create_engine(
        bouncer.replace("postgresql://", "postgresql+psycopg://"),
        connect_args={"prepare_threshold": None},
        poolclass=sa.pool.NullPool,
    )
    for n in range(12):
        with engine.begin() as conn:
            relay.enqueue(conn, "x", "sqlalchemy", str(n).encode())
    with psycopg.connect(bouncer, prepare_threshold=None) as conn:
        for n in range(12):
            conn.execute("SELECT outbox.enqueue('x', 'sql', %s::bytea)", [str(n).encode()])
            conn.commit()
        relay.enqueue(conn, "x", "rolled-back", b"")
        conn.rollback()  # not a message: its transaction did not commit
    assert count(database_url, "SELECT count(*) FROM outbox.messages") == 36


async def test_the_relay_through_it_wakes_on_notify_over_a_direct_listen_url(
    bouncer: str, database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    # A poll of a minute: each message arriving within seconds was woken for by its NOTIFY.
    settings = settings_for(
        bouncer,
        amqp_url,
        transaction_pooler=True,
        listen_url=database_url,
        poll_interval=60.0,
    )
    async with running(settings) as parts:
        assert parts.listener is not None
        await asyncio.wait_for(parts.listener.connected.wait(), 10)
        latencies = await _one_at_a_time(bouncer, broker, 40)
    print(f"\nthrough PgBouncer, LISTEN direct: p50 {_p50(latencies) * 1000:.1f} ms")
    assert max(latencies) < 20  # far below the minute a poll would take: every one was woken


async def test_the_relay_through_it_polls_without_a_listen_url(
    bouncer: str, amqp_url: str, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.declare()
    settings = settings_for(bouncer, amqp_url, transaction_pooler=True, poll_interval=0.5)
    async with running(settings) as parts:
        assert parts.listener is None
        latencies = await _one_at_a_time(bouncer, broker, 10)
    print(f"\nthrough PgBouncer, polling every 0.5 s: p50 {_p50(latencies) * 1000:.0f} ms")
    assert "polls every 0.5s" in caplog.text


async def _one_at_a_time(url: str, broker: Broker, n: int) -> list[float]:
    """Commit n messages through `url`, each after the one before arrived; commit → delivery."""
    latencies = []
    async with await psycopg.AsyncConnection.connect(url, prepare_threshold=None) as conn:
        for i in range(n):
            collecting = asyncio.create_task(broker.collect(1, timeout=30))
            await asyncio.sleep(0.01)  # the consumer is up
            await relay.enqueue_async(conn, broker.exchange, "k", str(i).encode())
            await conn.commit()
            committed = time.perf_counter()
            (got,) = await collecting
            latencies.append(time.perf_counter() - committed)
            assert got.body == str(i).encode()
    return latencies


def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


async def test_the_relay_refuses_role_settings_it_cannot_override(
    bouncer: str, database_url: str
) -> None:
    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    with pytest.raises(errors.ConfigError, match=r"ALTER ROLE .* SET synchronous_commit = on"):
        await PgStore.open(bouncer, "outbox", "test", pooled=True)
    store = await PgStore.open(database_url, "outbox", "test")  # directly, it sets its own
    await store.close()


def test_one_pruner_at_a_time_through_it(bouncer: str, database_url: str) -> None:
    archive(database_url, 10, timedelta(days=10))
    with (
        locks.exclusive(bouncer, "outbox", "prune", wait=False, pooled=True) as held,
        admin.Admin.connect(bouncer, pooled=True) as ops,
    ):
        assert held
        for _ in range(8):  # whichever server connection each statement lands on
            assert ops.archive_prune(timedelta(days=1)) is None
    with admin.Admin.connect(bouncer, pooled=True) as ops:
        assert ops.archive_prune(timedelta(days=1)) == 10


def test_one_pipeline_run_at_a_time_through_it(bouncer: str) -> None:
    with (
        PipelineDatabase.connect(bouncer, "outbox", pooled=True),
        pytest.raises(errors.RelayError, match="another pipeline run"),
        PipelineDatabase.connect(bouncer, "outbox", pooled=True),
    ):
        pass
    with PipelineDatabase.connect(bouncer, "outbox", pooled=True):
        pass  # free again


def test_migrate_through_it_one_at_a_time(
    empty_database_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Waiters try again in short transactions (so they pin no pooled connection) and soon say
    # who holds the lock they wait for.
    monkeypatch.setattr(locks, "SAY_WHO_AFTER", 0.2)
    caplog.set_level(logging.WARNING, logger="relay.locks")
    with pgbouncer(empty_database_url, pool_size=3) as url:
        results: list[Any] = []
        with locks.exclusive(url, "outbox", "migrate", wait=True, pooled=True):
            racing = [
                threading.Thread(
                    target=lambda: results.append(migrate.migrate(url, "outbox", pooled=True))
                )
                for _ in range(2)
            ]
            for thread in racing:
                thread.start()
            until(
                lambda: caplog.text.count("waiting for the migrate lock, held by pid") == 2,
                message="both migrates waiting for the lock, naming its holder",
            )
            assert "outbox-relay migrate lock" in caplog.text
            assert results == []
        for thread in racing:
            thread.join(60)
        applied = sorted(len(r.applied) for r in results)
        assert applied == [0, len(migrate.discover())]  # one did it all, the other found it done


def test_dead_replay_through_it(bouncer: str, database_url: str) -> None:
    ids = insert_dead(database_url, [{} for _ in range(30)])
    with admin.Admin.connect(bouncer, pooled=True) as ops:
        moved = ops.dead_replay(DeadFilter.build(message_ids=[str(i) for i in ids]), batch=7)
    assert moved == 30
    until(
        lambda: count(database_url, "SELECT count(*) FROM outbox.messages") == 30,
        message="the replayed rows in the outbox",
    )
