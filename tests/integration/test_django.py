"""relay.enqueue inside Django's transaction.atomic(): a model change and its message commit or
roll back together, savepoints included, on Django's own connection (issue 20). Outside an atomic
block (Django's autocommit) enqueue refuses, rather than commit the message on its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import django
import psycopg
import pytest
from django.conf import settings
from django.db import connection, connections, transaction

import relay
from relay import app, errors
from tests.django_app import settings as project
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for


class Abort(Exception):
    """Raised to leave an atomic block, which rolls it back."""


@pytest.fixture
def orders(database_url: str) -> Iterator[Any]:
    """Django on this test's database with the Order model's table (dropped after); the model.

    Django's settings can be configured once per process: later tests point the same aliases at
    their own database, in the dicts that Django's connections read when they next connect."""
    if settings.configured:
        connections.close_all()
        for alias, database in project.databases(database_url).items():
            connections.settings[alias].update(database)
    else:
        settings.configure(**project.for_database(database_url))
        django.setup()
    from tests.django_app.models import Order  # only once the app registry is ready

    with connection.schema_editor() as editor:
        editor.create_model(Order)
    yield Order
    connections.close_all()  # whatever state the test left this thread's connections in
    with connection.schema_editor() as editor:
        editor.delete_model(Order)
    connections.close_all()


def stored(database_url: str) -> tuple[list[int], list[str]]:
    with psycopg.connect(database_url) as conn:
        orders = [r[0] for r in conn.execute("SELECT id FROM django_orders ORDER BY id")]
        keys = [r[0] for r in conn.execute("SELECT routing_key FROM outbox.messages ORDER BY id")]
    return orders, keys


def writing(database_url: str, alias: str) -> bool:
    """Whether the connection `alias` has a transaction that has written (from another one)."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    with psycopg.connect(database_url) as other:
        row = other.execute(
            "SELECT backend_xid IS NOT NULL FROM pg_stat_activity WHERE pid = %s", [pid]
        ).fetchone()
    return row == (True,)


def test_atomic_commit_writes_both_and_rollback_neither(orders: Any, database_url: str) -> None:
    with transaction.atomic():
        orders.objects.create(id=1, status="paid")
        relay.enqueue(connection, "orders", "order.paid", {"id": 1}, ordering_key="order-1")
        relay.enqueue_many(connection, [relay.Message("orders", "order.audit", b"1")])
        assert writing(database_url, "default")  # on Django's own connection, in its transaction
        assert stored(database_url) == ([], [])  # nothing visible before the commit
    with transaction.atomic():
        orders.objects.create(id=2, status="paid")
        relay.enqueue(connection, "orders", "order.paid", {"id": 2})
        transaction.set_rollback(True)  # as an exception leaving the block would
    assert stored(database_url) == ([1], ["order.paid", "order.audit"])


def test_a_nested_block_that_rolls_back_takes_only_its_messages(
    orders: Any, database_url: str
) -> None:
    first = uuid4()
    with transaction.atomic():
        orders.objects.create(id=1, status="paid")
        relay.enqueue(connection, "orders", "order.paid", b"1", message_id=first)
        with contextlib.suppress(Abort), transaction.atomic():
            orders.objects.create(id=2, status="refunded")
            relay.enqueue(connection, "orders", "order.refunded", b"2")
            relay.enqueue_many(connection, [relay.Message("orders", "order.audit", b"2")])
            raise Abort
        # A database error in a nested block (here a duplicate message_id) is rolled back with
        # it, to its savepoint: the outer block goes on.
        with pytest.raises(errors.DuplicateMessage), transaction.atomic():
            relay.enqueue(connection, "orders", "order.again", b"1", message_id=first)
        with transaction.atomic():  # a nested block that ends well keeps its message
            relay.enqueue(connection, "orders", "order.shipped", b"1")
    assert stored(database_url) == ([1], ["order.paid", "order.shipped"])


def test_a_named_connection_joins_its_own_atomic_block(orders: Any, database_url: str) -> None:
    with transaction.atomic(using="other"):
        orders.objects.using("other").create(id=3, status="new")
        relay.enqueue(connections["other"], "orders", "order.created", b"3")
        assert writing(database_url, "other")
        assert not connection.in_atomic_block  # the default connection took no part
    with contextlib.suppress(Abort), transaction.atomic(using="other"):
        relay.enqueue(connections["other"], "orders", "order.created", b"4")
        raise Abort
    # An atomic block on the default connection does not cover another alias.
    with (
        transaction.atomic(),
        pytest.raises(errors.InvalidArgument, match=r"transaction\.atomic\(\) \(using='other'\)"),
    ):
        relay.enqueue(connections["other"], "orders", "order.created", b"5")
    assert stored(database_url) == ([3], ["order.created"])


def test_outside_atomic_is_refused_unless_autocommit_is_off(orders: Any, database_url: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=r"must run inside transaction\.atomic\(\)"):
        relay.enqueue(connection, "orders", "order.paid", b"")
    with pytest.raises(errors.InvalidArgument, match="would commit on its own"):
        relay.enqueue_many(connections["other"], [relay.Message("orders", "order.paid", b"")])
    assert stored(database_url) == ([], [])
    # With autocommit off the caller holds the transaction, and commits or rolls it back.
    transaction.set_autocommit(False)
    try:
        relay.enqueue(connection, "orders", "order.dropped", b"")
        transaction.rollback()
        relay.enqueue(connection, "orders", "order.kept", b"")
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert stored(database_url) == ([], ["order.kept"])


def test_a_transaction_django_will_roll_back_is_refused(orders: Any) -> None:
    with transaction.atomic():
        with contextlib.suppress(Abort), transaction.atomic(savepoint=False):
            raise Abort  # no savepoint to return to: the whole block must roll back
        with pytest.raises(transaction.TransactionManagementError):
            relay.enqueue(connection, "orders", "order.paid", b"")


def test_other_backends_are_refused_clearly(orders: Any) -> None:
    with (
        transaction.atomic(using="lite"),
        pytest.raises(TypeError, match=r"psycopg 3.*'lite' uses sqlite3\.Connection"),
    ):
        relay.enqueue(connections["lite"], "orders", "order.paid", b"")


async def test_committed_messages_are_delivered_by_a_relay(
    orders: Any, database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="order.#")

    def produce() -> None:  # Django's connections are synchronous, and one per thread
        try:
            with transaction.atomic():
                orders.objects.create(id=5, status="paid")
                relay.enqueue(connection, broker.exchange, "order.paid", {"id": 5})
                with contextlib.suppress(Abort), transaction.atomic():
                    relay.enqueue(connection, broker.exchange, "order.cancelled", b"")
                    raise Abort
                relay.enqueue_many(connection, [relay.Message(broker.exchange, "order.x", b"x")])
        finally:
            connections.close_all()

    await asyncio.to_thread(produce)
    assert await asyncio.to_thread(stored, database_url) == ([5], ["order.paid", "order.x"])
    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()
    got = await broker.collect(2)
    assert sorted((m.routing_key, m.body) for m in got) == [
        ("order.paid", b'{"id":5}'),
        ("order.x", b"x"),
    ]


# Recognising a Django connection needs no database, nor Django itself: its classes' modules.


class _Driver:
    __module__ = "psycopg2.extensions"
    __qualname__ = "connection"


class BaseDatabaseWrapper:
    __module__ = "django.db.backends.base.base"
    alias = "default"
    in_atomic_block = True

    def __init__(self, driver: object) -> None:
        self.connection = driver
        self.connected = False

    def ensure_connection(self) -> None:
        self.connected = True


class ThirdPartyWrapper(BaseDatabaseWrapper):  # a backend outside Django, subclassing Django's
    __module__ = "some_backend.base"


def test_a_django_connection_is_recognised_by_its_classes_and_psycopg2_refused() -> None:
    wrapper = ThirdPartyWrapper(_Driver())
    with pytest.raises(
        TypeError, match=r"Django's PostgreSQL backend on psycopg 3.*psycopg2\.extensions"
    ):
        relay.enqueue(wrapper, "orders", "order.paid", b"")
    assert wrapper.connected  # connected first, as Django's next query would have
    with pytest.raises(TypeError, match="or a Django connection"):
        relay.enqueue(object(), "orders", "order.paid", b"")


async def test_enqueue_async_refuses_a_django_connection_saying_why() -> None:
    with pytest.raises(TypeError, match=r"synchronous: call relay\.enqueue"):
        await relay.enqueue_async(BaseDatabaseWrapper(_Driver()), "orders", "order.paid", b"")
