"""Ordering keys: commit-order sequences, gates, policies, release, rate limits, and the claim
index — against real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import time
from typing import Any

import psycopg
import pytest

import relay
from relay.postgres import admin
from tests.support.amqp import Broker
from tests.support.inprocess import query, running, settings_for, wait_for_count


def rows(url: str, sql_text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql_text, args).fetchall()


def enqueue_keyed(
    url: str,
    exchange: str,
    key: str,
    n: int,
    *,
    routing_key: str = "k",
    first_routing_key: str | None = None,
) -> list[str]:
    ids = []
    with psycopg.connect(url) as conn:
        for i in range(n):
            rk = first_routing_key if (i == 0 and first_routing_key) else routing_key
            ids.append(str(relay.enqueue(conn, exchange, rk, {"i": i}, ordering_key=key)))
        conn.commit()
    return ids


def test_sequence_is_gapless_rollbacks_give_their_number_back(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        relay.enqueue(conn, "x", "k", b"1", ordering_key="order-7")
        conn.commit()
        relay.enqueue(conn, "x", "k", b"rolled back", ordering_key="order-7")
        conn.rollback()
        relay.enqueue(conn, "x", "k", b"2", ordering_key="order-7")
        relay.enqueue(conn, "x", "k", b"3", ordering_key="order-7")
        conn.commit()
    assert rows(database_url, "SELECT seq, body, gated FROM outbox.messages ORDER BY seq") == [
        (1, b"1", False),
        (2, b"2", True),
        (3, b"3", True),
    ]


def test_racing_producers_are_numbered_in_commit_order(database_url: str) -> None:
    # Eight producers race on one key, holding their transactions open a random while, one in
    # five rolling back. Whenever one producer's commit finished before another began, the first
    # must have the lower number; and the committed numbers must be exactly 1..n.
    done: list[tuple[float, float, str]] = []  # (started, committed, message_id)
    lock = threading.Lock()

    def producer(n: int) -> None:
        rng = random.Random(n)
        with psycopg.connect(database_url) as conn:
            for _ in range(15):
                started = time.monotonic()
                message_id = relay.enqueue(conn, "x", "k", b"", ordering_key="contended")
                time.sleep(rng.uniform(0, 0.01))  # business work while the key is held
                if rng.random() < 0.2:
                    conn.rollback()
                    continue
                conn.commit()
                with lock:
                    done.append((started, time.monotonic(), str(message_id)))

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seq = dict(rows(database_url, "SELECT message_id::text, seq FROM outbox.messages"))
    assert sorted(seq.values()) == list(range(1, len(done) + 1))
    for _a_start, a_commit, a in done:
        for b_start, _, b in done:
            if a_commit < b_start:
                assert seq[a] < seq[b], "a later transaction got an earlier number"
    assert len(done) > 60


def test_only_the_head_of_a_key_may_go_and_policies_widen_it(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO outbox.key_policies (prefix, concurrency) VALUES ('wide.', 3)")
        for key in ("narrow", "wide.1"):
            for _ in range(5):
                relay.enqueue(conn, "x", "k", b"", ordering_key=key)
        relay.enqueue(conn, "x", "k", b"", ordering_key=None)
        conn.commit()
    gates = rows(
        database_url,
        "SELECT ordering_key, seq, gated FROM outbox.messages"
        " ORDER BY ordering_key NULLS FIRST, seq",
    )
    assert gates == [
        (None, None, False),
        ("narrow", 1, False),
        ("narrow", 2, True),
        ("narrow", 3, True),
        ("narrow", 4, True),
        ("narrow", 5, True),
        ("wide.1", 1, False),
        ("wide.1", 2, False),
        ("wide.1", 3, False),
        ("wide.1", 4, True),
        ("wide.1", 5, True),
    ]


CLAIM_ONE = (
    "SELECT (outbox.claim(ROW(gen_random_uuid(), 'r', 30, 1, 67108864, 10, NULL, NULL, NULL,"
    " NULL)::outbox.claim_request)).ids"
)
SETTLE_AND_CLAIM = (
    "SELECT ids FROM outbox.settle((SELECT claim_id FROM outbox.messages WHERE id = %(id)s),"
    " ARRAY[%(id)s]::bigint[], '{archive}', NULL, NULL, NULL, '{}', true,"
    " ROW(gen_random_uuid(), 'r', 30, %(room)s, 67108864, 10, NULL, NULL, NULL,"
    " NULL)::outbox.claim_request)"
)


def test_a_settle_claims_the_successor_it_frees_only_in_the_room_the_due_rows_leave(
    database_url: str,
) -> None:
    # Migration 0028: the successor goes into the claim's own UPDATE (one row version), but
    # after the due rows, as a release would have placed it; with no room it is released.
    for room, takes_successor in ((2, False), (5, True)):
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox.messages")
            for key in ("k", "k", None, None, None):
                conn.execute("SELECT outbox.enqueue('x', 'r', '', ordering_key => %s)", [key])
            ((head,),) = conn.execute(CLAIM_ONE).fetchall()
            ((ids,),) = conn.execute(SETTLE_AND_CLAIM, {"id": head[0], "room": room}).fetchall()
            ((successor, gated, claimed, attempts),) = conn.execute(
                "SELECT id, gated, claim_id IS NOT NULL, attempts FROM outbox.messages"
                " WHERE ordering_key = 'k'"
            ).fetchall()
            unkeyed = [
                r
                for (r,) in conn.execute(
                    "SELECT id FROM outbox.messages WHERE ordering_key IS NULL ORDER BY id"
                ).fetchall()
            ]
        assert not gated
        if takes_successor:
            assert ids == [*unkeyed, successor]
            assert (claimed, attempts) == (True, 1)
        else:
            assert ids == unkeyed[:2]
            assert (claimed, attempts) == (False, 0)


SETTLE_HEAD = """
WITH gone AS (DELETE FROM outbox.messages WHERE ordering_key = 'raced' AND seq = 1
              RETURNING message_id, ordering_key, seq)
SELECT outbox._keys_settled(array_agg(ordering_key), array_agg(seq), array[NULL::text],
                            array_agg(message_id)) FROM gone
"""


def test_a_producer_racing_the_settle_of_its_predecessor_is_never_stranded(
    database_url: str,
) -> None:
    # The one race the design must close: a producer sees the head still pending (so its row is
    # gated) while a relay is settling that head, and the relay cannot see the producer's row.
    # The producer must not wait for the relay: its commit queues a recheck, which a relay
    # decides once the settle is over.
    with psycopg.connect(database_url) as conn:
        relay.enqueue(conn, "x", "k", b"head", ordering_key="raced")
        conn.commit()
    settler = psycopg.connect(database_url)
    producer = psycopg.connect(database_url)
    try:
        settler.execute(SETTLE_HEAD)  # deleted, nothing released (the successor is not visible)
        relay.enqueue(producer, "x", "k", b"next", ordering_key="raced")  # sees the head: gated
        committing = threading.Thread(target=producer.commit)
        committing.start()
        committing.join(5)
        assert not committing.is_alive()  # it did not wait for the settler's transaction
        assert rows(database_url, "SELECT ordering_key, seq FROM outbox.key_checks") == [
            ("raced", 2)
        ]
        settler.commit()
    finally:
        settler.close()
        producer.close()
    assert rows(database_url, "SELECT seq, gated FROM outbox.messages") == [(2, True)]
    assert rows(database_url, "SELECT * FROM outbox.release_stranded(10)") == [(1, 1)]
    assert rows(database_url, "SELECT seq, gated FROM outbox.messages") == [(2, False)]


# Slow (out of the fast tier): it fills the table with enough rows that an index scan and a table
# scan differ.
@pytest.mark.slow
def test_claims_read_only_due_rows_from_the_index(database_url: str) -> None:
    # 100,000 scheduled rows and 100,000 gated keyed rows must cost a claim nothing: it reads the
    # 50 due rows and the hot key's head from the due index, and not one row more.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox.messages (message_id, exchange, routing_key, body, available_at)"
            " SELECT gen_random_uuid(), 'x', 'k', '', now() + interval '1 day' * i"
            " FROM generate_series(1, 100000) i"
        )
        conn.execute(
            "INSERT INTO outbox.messages (message_id, exchange, routing_key, body, ordering_key,"
            " seq, gated) SELECT gen_random_uuid(), 'x', 'k', '', 'hot', i, i > 1"
            " FROM generate_series(1, 100000) i"
        )
        conn.execute(
            "INSERT INTO outbox.messages (message_id, exchange, routing_key, body)"
            " SELECT gen_random_uuid(), 'x', 'k', '' FROM generate_series(1, 50)"
        )
        conn.execute("ANALYZE outbox.messages")
        with conn.transaction():
            before = _reads(conn)
            (ids,) = conn.execute(
                "SELECT ids FROM outbox.claim(ROW(gen_random_uuid(), 'reads', 30, 500, 67108864,"
                " 10, NULL, NULL, NULL, NULL)::outbox.claim_request)"
            ).fetchone() or ([],)
            read = _reads(conn) - before
    assert len(ids) == 51  # the 50 due rows and the hot key's head
    assert read <= 2 * 51, f"a claim of 51 rows read {read} rows"


def _reads(conn: psycopg.Connection[Any]) -> int:
    """Rows this session's transaction read from messages (scans and index fetches)."""
    row = conn.execute(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)"
        " FROM pg_stat_xact_user_tables WHERE relid = 'outbox.messages'::regclass"
    ).fetchone()
    return int(row[0]) if row else 0


async def test_keyed_messages_arrive_in_order_with_their_numbers(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    expected = {}
    for key in ("order-1", "order-2", "order-3"):
        expected[key] = await asyncio.to_thread(
            enqueue_keyed, database_url, broker.exchange, key, 20
        )
    async with running(settings_for(database_url, amqp_url)):
        got = await broker.collect(60, settle=0.3)
    arrivals = collections.defaultdict(list)
    for g in got:
        arrivals[g.headers["x-outbox-ordering-key"]].append(
            (g.headers["x-outbox-sequence"], g.message_id)
        )
    for key, ids in expected.items():
        assert arrivals[key] == list(zip(range(1, 21), ids, strict=True))


async def test_strict_key_blocks_until_released_and_other_keys_flow(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="ok")
    # The head of 'poisoned' is unroutable: dead-lettered, and the key ('block' by default) holds.
    held = await asyncio.to_thread(
        enqueue_keyed,
        database_url,
        broker.exchange,
        "poisoned",
        5,
        routing_key="ok",
        first_routing_key="nowhere",
    )
    free = await asyncio.to_thread(
        enqueue_keyed, database_url, broker.exchange, "healthy", 5, routing_key="ok"
    )
    async with running(settings_for(database_url, amqp_url)):
        got = await broker.collect(5, settle=0.5)
        assert [g.message_id for g in got] == free
        with admin.Admin.connect(database_url) as ops:
            (blocked,) = ops.blocked_keys()
            assert (blocked.ordering_key, blocked.seq, blocked.reason, blocked.waiting) == (
                "poisoned",
                1,
                "unroutable",
                4,
            )
            assert str(blocked.message_id) == held[0]
            assert ops.release_key("poisoned")
            assert ops.blocked_keys() == []
        got = await broker.collect(4)
    assert [g.message_id for g in got] == held[1:]  # a gap at 1, visible in the numbers
    assert [g.headers["x-outbox-sequence"] for g in got] == [2, 3, 4, 5]


async def test_replayed_dead_message_of_a_strict_key_goes_back_in_its_place(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="ok")
    ids = await asyncio.to_thread(
        enqueue_keyed,
        database_url,
        broker.exchange,
        "account-9",
        4,
        routing_key="ok",
        first_routing_key="late",
    )
    async with running(settings_for(database_url, amqp_url)):
        await wait_for_count(database_url, "dead", 1)
        async with broker.channel() as channel:  # the missing binding arrives
            queue = await channel.get_queue(broker.queue)
            await queue.bind(broker.exchange, "late")
        with admin.Admin.connect(database_url) as ops:
            assert ops.release_key("account-9", replay=True)
        got = await broker.collect(4, settle=0.3)
    assert [g.message_id for g in got] == ids
    assert [g.headers["x-outbox-sequence"] for g in got] == [1, 2, 3, 4]
    assert await query(database_url, "SELECT count(*) FROM outbox.dead") == [(0,)]


async def test_skip_policy_lets_the_key_go_on(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="ok")
    with admin.Admin.connect(database_url) as ops:
        ops.set_policy("lenient.", on_dead="skip")
    ids = await asyncio.to_thread(
        enqueue_keyed,
        database_url,
        broker.exchange,
        "lenient.1",
        4,
        routing_key="ok",
        first_routing_key="nowhere",
    )
    async with running(settings_for(database_url, amqp_url)):
        got = await broker.collect(3, settle=0.3)
    assert [g.message_id for g in got] == ids[1:]
    assert await query(database_url, "SELECT count(*) FROM outbox.blocked_keys") == [(0,)]


async def test_rate_limited_key_is_released_no_faster_than_its_interval(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    with admin.Admin.connect(database_url) as ops:
        ops.set_policy("slow.", min_interval=0.25)
    await asyncio.to_thread(enqueue_keyed, database_url, broker.exchange, "slow.1", 5)
    arrived: list[float] = []
    settings = settings_for(database_url, amqp_url, poll_interval=0.05)
    async with running(settings), broker.channel() as channel:
        queue = await channel.get_queue(broker.queue)
        async with queue.iterator() as messages:
            async for message in messages:
                await message.ack()
                arrived.append(time.monotonic())
                if len(arrived) == 5:
                    break
    gaps = [b - a for a, b in itertools.pairwise(arrived)]
    assert min(gaps) >= 0.2, f"released faster than 0.25s apart: {gaps}"


async def test_a_hot_key_does_not_delay_other_keys(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    with psycopg.connect(database_url) as conn:  # 2,000 messages of one key, enqueued first
        conn.execute(
            "SELECT outbox.enqueue(%s, 'hot', 'x'::bytea, ordering_key => 'hot')"
            " FROM generate_series(1, 2000)",
            [broker.exchange],
        )
        conn.execute(
            "SELECT outbox.enqueue(%s, 'cold', 'x'::bytea, ordering_key => 'cold.' || i)"
            " FROM generate_series(1, 100) i",
            [broker.exchange],
        )
        conn.commit()
    started = time.monotonic()
    async with running(settings_for(database_url, amqp_url)):
        got = await broker.collect(0, distinct=True)  # start consuming…
        seen: list[str] = []
        async with broker.channel() as channel:
            queue = await channel.get_queue(broker.queue)
            async with queue.iterator() as messages:
                async for message in messages:
                    await message.ack()
                    seen.append(message.routing_key or "")
                    if seen.count("cold") == 100:
                        break
    cold_done = time.monotonic() - started
    print(
        f"100 cold keys delivered in {cold_done:.2f}s behind a 2,000-message hot key; "
        f"hot messages delivered meanwhile: {seen.count('hot')}"
    )
    assert got == []
    assert seen.count("hot") < 100, "cold keys waited for the hot key's backlog"
