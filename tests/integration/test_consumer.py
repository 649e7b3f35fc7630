"""relay.consumer: the inbox skips a duplicate exactly when the first copy's effects committed,
also when both copies arrive at once; the sequence checker flags gaps and reorders."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest

import relay
from relay import app
from relay.core import errors
from relay.postgres.consumer import Inbox, Problem, SequenceChecker
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for
from tests.support.wait import until_async


async def balance(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute("SELECT amount FROM balance")
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
async def delivered(database_url: str, amqp_url: str, broker: Broker) -> Any:
    """A real message as aio-pika hands it to a consumer, sent by the relay."""
    await broker.declare(binding="pay.#")
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await relay.enqueue_async(conn, broker.exchange, "pay.in", b"+10")
        await conn.commit()
        await conn.execute("CREATE TABLE balance (amount int NOT NULL)")
        await conn.execute("INSERT INTO balance VALUES (0)")
        await Inbox().create(conn)
        await conn.commit()
    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()
    (received,) = await broker.collect(1)
    return received.properties  # the aio-pika IncomingMessage


@pytest.mark.parametrize("first_commits", [True, False])
async def test_concurrent_duplicates_apply_the_effect_once(
    database_url: str, delivered: Any, first_commits: bool
) -> None:
    inbox, first_inside, results, pids = Inbox(), asyncio.Event(), {}, {}

    async def consume(name: str, hold: asyncio.Event | None, commit: bool) -> None:
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            pids[name] = conn.info.backend_pid
            async with inbox.handle(conn, delivered) as fresh:
                results[name] = fresh
                if fresh:
                    await conn.execute("UPDATE balance SET amount = amount + 10")
                if hold is not None:
                    first_inside.set()
                    await hold.wait()
            await (conn.commit() if commit else conn.rollback())

    release = asyncio.Event()
    first = asyncio.create_task(consume("first", release, first_commits))
    await asyncio.wait_for(first_inside.wait(), 10)
    second = asyncio.create_task(consume("second", None, True))

    async def second_waits_on_a_lock() -> bool:  # the first's uncommitted insert of the same id
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            cur = await conn.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                [pids.get("second")],
            )
            return (await cur.fetchone()) == (True,)

    await until_async(second_waits_on_a_lock, timeout=10, interval=0.02)
    assert not second.done()
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert results == {"first": True, "second": not first_commits}
    assert await balance(database_url) == 10  # once, whichever copy committed


async def test_a_redelivery_after_commit_is_skipped(database_url: str, delivered: Any) -> None:
    inbox = Inbox()
    for _ in range(3):
        async with (
            await psycopg.AsyncConnection.connect(database_url) as conn,
            conn.transaction(),
            inbox.handle(conn, delivered) as fresh,
        ):
            if fresh:
                await conn.execute("UPDATE balance SET amount = amount + 10")
    assert await balance(database_url) == 10


async def test_inbox_refuses_bad_names_and_ids(database_url: str) -> None:
    with pytest.raises(errors.ConfigError):
        Inbox(table='x"; DROP TABLE balance; --')
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        with pytest.raises(errors.InvalidMessage, match="not a UUID"):
            async with Inbox().handle(conn, "not-a-uuid"):
                pass


@dataclasses.dataclass
class Fake:
    headers: Mapping[str, Any]
    message_id: str | None = None


def keyed(key: str, seq: int) -> Fake:
    return Fake({"x-outbox-ordering-key": key, "x-outbox-sequence": seq}, str(uuid.uuid4()))


def test_sequence_checker_flags_gaps_and_reorders_not_redeliveries() -> None:
    check = SequenceChecker()
    seen = [check.observe(keyed(k, n)) for k, n in [("a", 1), ("a", 2), ("b", 7), ("a", 2)]]
    assert seen == [None, None, None, None]  # in order; a key joined mid-way; a redelivery
    assert check.observe(keyed("a", 4)) == Problem("a", "gap", 3, 4)
    assert check.observe(keyed("a", 3)) == Problem("a", "reorder", 5, 3)
    assert check.observe(keyed("b", 8)) is None
    assert check.observe(Fake({})) is None  # not keyed
    # The outbox forgot "b" after its retention: numbering starts again, and is followed on.
    assert check.observe(keyed("b", 1)) == Problem("b", "restart", 9, 1)
    assert check.observe(keyed("b", 2)) is None
    assert str(Problem("a", "gap", 3, 4)) == "key 'a': gap, expected sequence 3, got 4"


async def test_sequence_checker_reads_what_the_relay_sends(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="seq.#")
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        batch = [
            relay.Message(broker.exchange, "seq.k", b"%d" % n, ordering_key="k") for n in range(5)
        ]
        await relay.enqueue_many_async(conn, batch)
        await conn.commit()
    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()
    got = await broker.collect(5)
    check = SequenceChecker()
    assert [check.observe(m.properties) for m in got] == [None] * 5
    assert check.observe(got[1].properties) == Problem("k", "reorder", 6, 2)
