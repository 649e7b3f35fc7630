"""relay.enqueue inside SQLAlchemy: a business row and its message commit together or not at all,
on the session's own connection (sync and asyncio, Session and Connection)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import relay
from relay import app
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str]


def sqlalchemy_url(database_url: str) -> str:
    return urlsplit(database_url)._replace(scheme="postgresql+psycopg").geturl()


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sqlalchemy_url(database_url))
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(sqlalchemy_url(database_url))
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield engine
    await engine.dispose()


def stored(database_url: str) -> tuple[list[int], list[str]]:
    with psycopg.connect(database_url) as conn:
        orders = [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]
        keys = [r[0] for r in conn.execute("SELECT routing_key FROM outbox.messages ORDER BY id")]
    return orders, keys


def test_session_commit_writes_both_and_rollback_neither(
    engine: sa.Engine, database_url: str
) -> None:
    with Session(engine) as session:
        session.add(Order(id=1, status="paid"))
        relay.enqueue(session, "orders", "order.paid", {"id": 1}, ordering_key="order-1")
        relay.enqueue_many(session, [relay.Message("orders", "order.audit", b"1")])
        assert stored(database_url) == ([], [])  # nothing visible before the commit
        session.commit()
    with Session(engine) as session:
        session.add(Order(id=2, status="paid"))
        relay.enqueue(session, "orders", "order.paid", {"id": 2})
        session.rollback()
    assert stored(database_url) == ([1], ["order.paid", "order.audit"])


def test_core_connection_joins_its_transaction(engine: sa.Engine, database_url: str) -> None:
    with engine.connect() as conn:
        conn.execute(sa.insert(Order).values(id=3, status="new"))
        relay.enqueue(conn, "orders", "order.created", b"3")
        conn.rollback()
        relay.enqueue(conn, "orders", "order.created", b"4")  # begins, as an execute would
        conn.execute(sa.insert(Order).values(id=4, status="new"))
        conn.commit()
    assert stored(database_url) == ([4], ["order.created"])


def test_one_connection_only(engine: sa.Engine, database_url: str) -> None:
    with Session(engine) as session:
        relay.enqueue(session, "orders", "order.paid", b"")
        pid = session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        with psycopg.connect(database_url) as other:
            row = other.execute(
                "SELECT backend_xid IS NOT NULL FROM pg_stat_activity WHERE pid = %s", [pid]
            ).fetchone()
        assert row == (True,)  # the enqueue's write is in the session's own transaction
        session.rollback()


async def test_async_session_commits_and_the_relay_delivers(
    async_engine: AsyncEngine, database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="order.#")
    async with AsyncSession(async_engine) as session:
        session.add(Order(id=5, status="paid"))
        await relay.enqueue_async(session, broker.exchange, "order.paid", {"id": 5})
        await relay.enqueue_many_async(session, [relay.Message(broker.exchange, "order.x", b"")])
        await session.commit()
    async with AsyncSession(async_engine) as session:
        session.add(Order(id=6, status="paid"))
        await relay.enqueue_async(session, broker.exchange, "order.paid", {"id": 6})
        await session.rollback()
    async with async_engine.connect() as conn:
        await relay.enqueue_async(conn, broker.exchange, "order.core", b"core")
        await conn.commit()
    assert await asyncio.to_thread(stored, database_url) == (
        [5],
        ["order.paid", "order.x", "order.core"],
    )
    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()
    got = await broker.collect(3)
    assert sorted(m.routing_key for m in got) == ["order.core", "order.paid", "order.x"]


def test_other_drivers_and_objects_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="psycopg Connection or a SQLAlchemy"):
        relay.enqueue(object(), "x", "k", b"")
    engine = sa.create_engine("sqlite://")  # not PostgreSQL, not psycopg
    with engine.connect() as conn, pytest.raises(TypeError, match=r"postgresql\+psycopg"):
        relay.enqueue(conn, "x", "k", b"")
