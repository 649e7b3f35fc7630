"""Ordering keys under racing transactions, against real PostgreSQL: producers at any isolation
level, operators releasing and replaying, and relays settling — each order of events that once
stranded a message or made a producer wait, replayed step by step with explicit transactions."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest

import relay
from relay.core import loop, model
from relay.postgres import admin
from relay.postgres.store import PgStore
from tests.support.fakes import ScriptedPublisher
from tests.support.wait import until_async

Script = Callable[[model.OutboxMessage], model.PublishResult]


def acked(_: model.OutboxMessage) -> model.PublishResult:
    return model.PublishResult(model.Outcome.ACKED)


def returned_if(seq: int) -> Script:
    def script(m: model.OutboxMessage) -> model.PublishResult:
        if m.seq == seq:
            return model.PublishResult(model.Outcome.RETURNED, "unroutable")
        return model.PublishResult(model.Outcome.ACKED)

    return script


@contextlib.asynccontextmanager
async def pg_store(url: str) -> AsyncIterator[PgStore]:
    store = await PgStore.open(url, "outbox", "race-relay")
    try:
        yield store
    finally:
        await store.close()


async def drain(url: str, script: Script = acked) -> list[tuple[str | None, int | None]]:
    """Run a relay until nothing is due; the (key, seq) of what it published, in order."""
    async with pg_store(url) as store:
        publisher = ScriptedPublisher(script)
        await loop.Relay(store, publisher, loop.Options(retry_delay=0.01)).run_until_empty()
    return [(m.ordering_key, m.seq) for m in publisher.published]


def sql(url: str, text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(text, args)
        return cur.fetchall() if cur.description else []


def enqueue(url: str, *keys: str) -> None:
    with psycopg.connect(url) as conn:
        for key in keys:
            relay.enqueue(conn, "x", "k", b"", ordering_key=key)
        conn.commit()


def gated(url: str, key: str) -> dict[int, bool]:
    return dict(sql(url, "SELECT seq, gated FROM outbox.messages WHERE ordering_key = %s", key))


def waiting(url: str) -> int:
    return int(sql(url, "SELECT count(*) FROM outbox.messages")[0][0])


async def block_key(url: str, key: str) -> None:
    """key#1 is dead-lettered under the default `block` policy; the key is blocked behind it."""
    enqueue(url, key)
    assert await drain(url, returned_if(1)) == [(key, 1)]
    assert sql(url, "SELECT ordering_key FROM outbox.blocked_keys") == [(key,)]


def produce_repeatable_read(url: str, key: str, between: Callable[[], object]) -> list[str]:
    """A REPEATABLE READ producer whose snapshot is taken before `between` runs and who enqueues
    to `key` after it, retrying its transaction on a serialization failure as such applications
    must. Returns what happened to each try."""
    tries: list[str] = []
    with psycopg.connect(url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        while len(tries) < 3:
            try:
                conn.execute("SELECT 1")  # the business reads: the snapshot starts here
                if not tries:
                    between()
                relay.enqueue(conn, "x", "k", b"after", ordering_key=key)
                conn.commit()
                tries.append("committed")
                return tries
            except psycopg.errors.SerializationFailure:
                conn.rollback()
                tries.append("40001")
    return tries


async def test_a_repeatable_read_producer_older_than_a_key_release_is_not_stranded(
    database_url: str,
) -> None:
    await block_key(database_url, "k")
    with admin.Admin.connect(database_url) as ops:
        tries = produce_repeatable_read(database_url, "k", lambda: ops.release_key("k"))
    assert tries[-1] == "committed"
    assert await drain(database_url) == [("k", 2)]
    assert waiting(database_url) == 0


async def test_a_repeatable_read_producer_older_than_a_replay_is_not_stranded(
    database_url: str,
) -> None:
    # The operator puts the dead k#1 back, and a relay archives it, all inside the producer's
    # snapshot: the producer must not commit k#2 gated behind a block it cannot see lifted.
    await block_key(database_url, "k")

    def replay_and_publish() -> None:
        with admin.Admin.connect(database_url) as ops:
            ops.release_key("k", replay=True)
        assert asyncio.run(drain(database_url)) == [("k", 1)]

    tries = await asyncio.to_thread(produce_repeatable_read, database_url, "k", replay_and_publish)
    assert tries[-1] == "committed"
    assert await drain(database_url) == [("k", 2)]
    assert waiting(database_url) == 0


async def test_a_repeatable_read_producer_older_than_a_forgotten_key_retries(
    database_url: str,
) -> None:
    # The key is released and then forgotten (idle long enough) inside the producer's snapshot,
    # which still sees it blocked: making the key's row anew must not let it commit k#1 gated.
    await block_key(database_url, "k")

    def release_and_forget() -> None:
        with admin.Admin.connect(database_url) as ops:
            ops.release_key("k")
        sql(database_url, "UPDATE outbox.keys SET touched_at = now() - interval '2 days'")
        sql(database_url, "DELETE FROM outbox.dead")  # purged: nothing left to replay
        assert sql(database_url, "SELECT * FROM outbox.forget_idle_keys('1 day', '', 10)") == [
            (1, "k")
        ]

    tries = produce_repeatable_read(database_url, "k", release_and_forget)
    assert tries == ["40001", "committed"]
    assert await drain(database_url) == [("k", 1)]  # numbered anew
    assert waiting(database_url) == 0


async def test_a_repeatable_read_producer_commits_though_its_predecessor_was_archived_meanwhile(
    database_url: str,
) -> None:
    enqueue(database_url, "k")
    with psycopg.connect(database_url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        relay.enqueue(conn, "x", "k", b"2", ordering_key="k")
        assert await drain(database_url) == [("k", 1)]
        conn.commit()  # k#1 is gone, k#2 was written gated: no serialization failure for that
    assert await drain(database_url) == [("k", 2)]


def wide_key(url: str) -> dict[int, int]:
    """k#1…k#6 under concurrency 3 and the block policy; a relay holds #1, #2 and #3, and #1 has
    just been dead-lettered (the key is blocked). Returns the row ids by seq."""
    sql(url, "UPDATE outbox.key_policies SET concurrency = 3 WHERE prefix = ''")
    enqueue(url, *["k"] * 6)
    return dict(sql(url, "SELECT seq, id FROM outbox.messages ORDER BY seq"))


async def claim_head(url: str, ids: dict[int, int]) -> model.Claim:
    async with pg_store(url) as store:
        claim = await store.claim(model.Ask(10, 60, 10))
        assert sorted(m.seq or 0 for m in claim.messages) == [1, 2, 3]
        dead = model.DeadLetter(ids[1], model.DeadReason.UNROUTABLE, "returned")
        await store.settle(claim.claim_id, model.Settlement(dead=(dead,)))
    assert sql(url, "SELECT ordering_key FROM outbox.blocked_keys") == [("k",)]
    return claim


async def test_a_key_release_waits_for_a_settle_that_saw_the_key_blocked(database_url: str) -> None:
    # The relay archives k#2 (and finds the key blocked, so k#5 stays gated); before it commits, an
    # operator releases the key (and finds k#2 still there, so k#5 stays gated too). Neither may
    # decide on what the other has not committed yet: k#5 must be free once both are done.
    ids = wide_key(database_url)
    await claim_head(database_url, ids)
    with psycopg.connect(database_url) as settle:
        settle.execute(
            "WITH gone AS (DELETE FROM outbox.messages WHERE id = %s"
            "              RETURNING message_id, ordering_key, seq)"
            " SELECT outbox._keys_settled(array_agg(ordering_key), array_agg(seq),"
            "                             array[NULL::text], array_agg(message_id)) FROM gone",
            [ids[2]],
        )
        released = threading.Thread(
            target=lambda: sql(database_url, "SELECT outbox.release_key('k')"), daemon=True
        )
        released.start()
        released.join(0.5)  # it may wait for this transaction; it must not need to
        settle.commit()
        released.join(10)
    assert not released.is_alive()
    assert gated(database_url, "k") == {3: False, 4: False, 5: False, 6: True}


async def test_a_settle_waits_for_a_key_release_in_progress(database_url: str) -> None:
    # The other order: the operator's release is in progress (k#2 still there, so k#5 stays
    # gated) when the relay settles k#2.
    ids = wide_key(database_url)
    claim = await claim_head(database_url, ids)
    async with pg_store(database_url) as store:
        with psycopg.connect(database_url) as operator:
            operator.execute("SELECT outbox.release_key('k')")
            settling = asyncio.ensure_future(
                store.settle(claim.claim_id, model.Settlement(archive=(ids[2],)))
            )
            await asyncio.wait([settling], timeout=0.5)  # it may wait for the operator
            operator.commit()
            counts, _ = await asyncio.wait_for(settling, 10)
    assert counts.archived == 1
    assert gated(database_url, "k") == {3: False, 4: False, 5: False, 6: True}


async def test_a_producer_commit_never_waits_for_a_relay_settling_its_predecessors(
    database_url: str,
) -> None:
    # A producer commits messages of two keys whose predecessors a relay is archiving. The relay's
    # statement has deleted b#1 and not committed (it will delete a#1 next). The producer's commit
    # must not wait for it (that wait, in the other lock order, was a deadlock that aborted the
    # producer's business transaction).
    enqueue(database_url, "a", "b")
    ids = dict(sql(database_url, "SELECT ordering_key, id FROM outbox.messages"))
    mids = dict(sql(database_url, "SELECT ordering_key, message_id FROM outbox.messages"))
    async with pg_store(database_url) as store:
        claim = await store.claim(model.Ask(10, 60, 10))
    assert len(claim.messages) == 2
    with psycopg.connect(database_url) as settle, psycopg.connect(database_url) as producer:
        relay.enqueue(producer, "x", "k", b"a2", ordering_key="a")
        relay.enqueue(producer, "x", "k", b"b2", ordering_key="b")
        settle.execute("DELETE FROM outbox.messages WHERE id = %s", [ids["b"]])
        started = time.monotonic()
        committing = threading.Thread(target=producer.commit, daemon=True)
        committing.start()
        committing.join(2.0)
        waited = time.monotonic() - started
        if committing.is_alive():
            settle.rollback()  # let it go, so the test can end
            committing.join(10)
            pytest.fail(f"the producer's COMMIT waited {waited:.1f}s for the relay's settle")
        settle.execute(
            "WITH gone AS (DELETE FROM outbox.messages WHERE id = %s RETURNING message_id)"
            " SELECT outbox._keys_settled(array['a', 'b'], array[1, 1]::bigint[],"
            "                             array[NULL, NULL]::text[],"
            "                             array[(SELECT message_id FROM gone), %s])",
            [ids["a"], mids["b"]],
        )
        settle.commit()
    sent = await drain(database_url)
    assert sorted(sent) == [("a", 2), ("b", 2)]
    assert waiting(database_url) == 0


class SharedLog(ScriptedPublisher):
    """Every relay's sends, in the one order they happened (the relays share an event loop)."""

    def __init__(self, log: list[model.OutboxMessage]) -> None:
        super().__init__()
        self.published = log


# Slow (out of the fast tier): producers and relays race for long enough to meet on every key.
@pytest.mark.slow
async def test_multi_key_producers_and_settling_relays_never_fail_a_producer(
    database_url: str,
) -> None:
    # Many producer transactions, each writing to three keys (in sorted order, as the README
    # asks), while two relays settle the batches that hold their predecessors.
    keys = [f"key-{n}" for n in range(6)]
    failures: list[BaseException] = []
    committed: list[int] = []

    def produce(n: int) -> None:
        import random

        rng = random.Random(n)
        try:
            with psycopg.connect(database_url) as conn:
                for _ in range(40):
                    for key in sorted(rng.sample(keys, 3)):
                        for _ in range(rng.randint(1, 2)):
                            relay.enqueue(conn, "x", "k", b"", ordering_key=key)
                    conn.commit()
                    committed.append(1)
        except BaseException as exc:  # any failure of a producer fails the test
            failures.append(exc)

    log: list[model.OutboxMessage] = []
    options = loop.Options(batch_size=20, prefetch=True, poll_interval=0.01)
    async with pg_store(database_url) as one, pg_store(database_url) as two:
        stop = asyncio.Event()
        relays = [
            asyncio.ensure_future(loop.Relay(store, SharedLog(log), options).run(stop))
            for store in (one, two)
        ]
        producers = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
        for thread in producers:
            thread.start()
        for thread in producers:
            await asyncio.to_thread(thread.join)

        async def drained() -> bool:
            return waiting(database_url) == 0

        try:
            await until_async(drained, interval=0.05, message="the relays to drain what is left")
        finally:
            stop.set()
            await asyncio.gather(*relays)
    assert failures == [], failures[0]
    assert len(committed) == 160
    assert waiting(database_url) == 0
    highest: dict[str, int] = {}
    for m in log:
        assert m.ordering_key is not None
        assert m.seq is not None
        assert m.seq >= highest.get(m.ordering_key, 0), (
            f"{m.ordering_key}#{m.seq} after a successor"
        )
        highest[m.ordering_key] = m.seq
