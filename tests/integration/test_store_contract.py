"""One contract for every ports.Store: the in-memory fake the unit tests use, and PgStore."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from uuid import UUID

import psycopg
import pytest

import relay
from relay.core import model, ports
from relay.postgres.store import PgStore
from tests.support.fakes import MemoryStore
from tests.support.wait import until_async


class Harness(Protocol):
    @property
    def store(self) -> ports.Store: ...

    async def add(
        self, routing_key: str = "k", *, delay: float = 0.0, body: bytes = b"body"
    ) -> UUID: ...

    async def advance(self, seconds: float) -> None: ...

    async def attempts(self, message_id: UUID) -> tuple[int, int] | None: ...


@dataclasses.dataclass
class MemoryHarness:
    store: MemoryStore

    async def add(
        self, routing_key: str = "k", *, delay: float = 0.0, body: bytes = b"body"
    ) -> UUID:
        at = self.store.now + timedelta(seconds=delay)
        return self.store.add(routing_key=routing_key, body=body, available_at=at).message_id

    async def advance(self, seconds: float) -> None:
        self.store.advance(seconds)

    async def attempts(self, message_id: UUID) -> tuple[int, int] | None:
        for row in self.store.rows.values():
            if row.message_id == message_id:
                return row.attempts, row.ambiguous
        return None


@dataclasses.dataclass
class PgHarness:
    store: PgStore
    url: str

    async def add(
        self, routing_key: str = "k", *, delay: float = 0.0, body: bytes = b"body"
    ) -> UUID:
        async with await psycopg.AsyncConnection.connect(self.url) as conn:
            message_id = await relay.enqueue_async(
                conn, "x", routing_key, body, available_at=timedelta(seconds=delay)
            )
            await conn.commit()
        return message_id

    async def advance(self, seconds: float) -> None:
        # Leases and delays are judged by the database's clock, so wait until it has moved on.
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            target = await _one(conn, "SELECT now() + make_interval(secs => %s)", seconds)

            async def passed() -> bool:
                return bool(await _one(conn, "SELECT clock_timestamp() > %s", target))

            await until_async(passed, timeout=seconds + 10, interval=0.01)

    async def attempts(self, message_id: UUID) -> tuple[int, int] | None:
        async with await psycopg.AsyncConnection.connect(self.url) as conn:
            cur = await conn.execute(
                "SELECT attempts, ambiguous FROM outbox.messages WHERE message_id = %s",
                [message_id],
            )
            row = await cur.fetchone()
        return None if row is None else (row[0], row[1])


async def _one(conn: psycopg.AsyncConnection[Any], query: str, *args: Any) -> Any:
    cur = await conn.execute(query, args)
    row = await cur.fetchone()
    assert row is not None
    return row[0]


@pytest.fixture(params=["memory", "postgres"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "memory":
        yield MemoryHarness(MemoryStore(now=datetime.now(UTC)))
        return
    url = request.getfixturevalue("database_url")
    store = await PgStore.open(url, "outbox", "contract-test")
    try:
        yield PgHarness(store, url)
    finally:
        await store.close()


def ask(limit: int = 10, lease: float = 30, max_attempts: int = 10) -> model.Ask:
    return model.Ask(limit, lease, max_attempts)


async def test_claim_leases_due_rows_in_order_and_counts_an_attempt(harness: Harness) -> None:
    ids = [await harness.add(f"k{i}") for i in range(5)]
    claim = await harness.store.claim(ask(3))
    assert [m.message_id for m in claim.messages] == ids[:3]
    assert {m.attempts for m in claim.messages} == {1}
    assert claim.cut_short  # more are due behind the batch
    rest = await harness.store.claim(ask())
    assert (len(rest.messages), rest.cut_short) == (2, False)
    assert (await harness.store.claim(ask())).messages == ()


async def test_claimed_rows_carry_the_message(harness: Harness) -> None:
    message_id = await harness.add("order.created")
    (message,) = (await harness.store.claim(ask())).messages
    assert message.message_id == message_id
    assert (message.exchange, message.routing_key, message.body) == ("x", "order.created", b"body")
    assert message.properties["content_type"] == "application/octet-stream"
    assert message.created_at.tzinfo is not None


async def test_scheduled_rows_wait_until_due(harness: Harness) -> None:
    await harness.add(delay=0.5)
    assert (await harness.store.claim(ask())).messages == ()
    await harness.advance(0.5)
    assert len((await harness.store.claim(ask())).messages) == 1


async def test_concurrent_claims_never_share_a_row(harness: Harness) -> None:
    for i in range(60):
        await harness.add(f"k{i}")
    claims = await asyncio.gather(*(harness.store.claim(ask(7)) for _ in range(12)))
    ids = [m.id for c in claims for m in c.messages]
    assert sorted(ids) == sorted(set(ids))
    assert len(ids) == 60


async def test_settle_archives_dead_letters_and_retries(harness: Harness) -> None:
    keep, drop, again = [await harness.add(k) for k in ("a", "b", "c")]
    claim = await harness.store.claim(ask())
    by_id = {m.message_id: m.id for m in claim.messages}
    counts, following = await harness.store.settle(
        claim.claim_id,
        model.Settlement(
            archive=(by_id[keep],),
            dead=(model.DeadLetter(by_id[drop], model.DeadReason.UNROUTABLE, "312 NO_ROUTE"),),
            retry=(model.Retry(by_id[again], 0.2, "nacked"),),
        ),
    )
    assert counts == model.SettleCounts(archived=1, dead=1, retried=1, fenced=0)
    assert following.messages == ()  # nothing was asked for
    stats = await harness.store.stats()
    assert (stats.archived, stats.dead, stats.dead_by_reason) == (1, 1, {"unroutable": 1})
    assert (stats.pending, stats.scheduled, stats.in_flight) == (1, 1, 0)
    assert await harness.attempts(again) == (1, 0)
    await harness.advance(0.2)
    (retried,) = (await harness.store.claim(ask())).messages
    assert (retried.message_id, retried.attempts, retried.last_error) == (again, 2, "nacked")


async def test_a_settle_that_claims_settles_a_batch_and_claims_the_next(harness: Harness) -> None:
    first_id = await harness.add("a")
    first = await harness.store.claim(ask())
    later = [await harness.add(k) for k in ("b", "c", "d")]
    counts, following = await harness.store.settle(
        first.claim_id, model.Settlement(archive=tuple(m.id for m in first.messages)), ask(2)
    )
    assert counts == model.SettleCounts(archived=1)
    assert following.claim_id != first.claim_id
    assert [(m.message_id, m.attempts) for m in following.messages] == [
        (later[0], 1),
        (later[1], 1),
    ]
    assert await harness.attempts(first_id) is None  # archived
    # The next claim is the fence of its rows' settle, as any claim is.
    counts, _ = await harness.store.settle(
        first.claim_id, model.Settlement(archive=tuple(m.id for m in following.messages)), ask(2)
    )
    assert counts == model.SettleCounts(fenced=2)


@pytest.mark.parametrize(("ambiguous", "expected"), [(False, (0, 0)), (True, (0, 1))])
async def test_refunded_retry_gives_the_attempt_back(
    harness: Harness, ambiguous: bool, expected: tuple[int, int]
) -> None:
    message_id = await harness.add()
    claim = await harness.store.claim(ask())
    (message,) = claim.messages
    await harness.store.settle(
        claim.claim_id,
        model.Settlement(
            retry=(model.Retry(message.id, 0.0, "given back", refund=True, ambiguous=ambiguous),)
        ),
    )
    assert await harness.attempts(message_id) == expected


async def test_resent_rows_count_one_more_ambiguous_send(harness: Harness) -> None:
    message_id = await harness.add()
    claim = await harness.store.claim(ask())
    (message,) = claim.messages
    await harness.store.settle(
        claim.claim_id,
        model.Settlement(resent=(message.id,), retry=(model.Retry(message.id, 0.0, "nacked"),)),
    )
    assert await harness.attempts(message_id) == (1, 1)


async def test_an_expired_lease_is_claimed_again_and_fences_the_old_claim(
    harness: Harness,
) -> None:
    message_id = await harness.add()
    first = await harness.store.claim(ask(lease=0.3))
    assert (await harness.store.claim(ask())).messages == ()  # still leased
    await harness.advance(0.3)
    second = await harness.store.claim(ask())
    assert [(m.message_id, m.attempts) for m in second.messages] == [(message_id, 2)]
    (row,) = second.messages
    late, _ = await harness.store.settle(first.claim_id, model.Settlement(archive=(row.id,)))
    assert late == model.SettleCounts(fenced=1)
    assert (await harness.store.stats()).archived == 0
    owner, _ = await harness.store.settle(second.claim_id, model.Settlement(archive=(row.id,)))
    assert owner == model.SettleCounts(archived=1)


async def test_expired_leases_come_before_due_rows(harness: Harness) -> None:
    orphan = await harness.add("orphan")
    await harness.store.claim(ask(lease=0.3))
    await harness.advance(0.3)
    fresh = await harness.add("fresh")
    claim = await harness.store.claim(ask())
    assert [m.message_id for m in claim.messages] == [orphan, fresh]


async def test_a_lease_lost_more_than_once_is_claimed_alone(harness: Harness) -> None:
    twice = await harness.add("twice")
    await harness.store.claim(ask(lease=0.2))
    await harness.advance(0.2)
    await harness.store.claim(ask(lease=0.2))  # its second claim, never settled either
    await harness.add("fresh")
    await harness.advance(0.2)
    claim = await harness.store.claim(ask())  # a row that kills its relay takes only itself
    assert [(m.message_id, m.attempts, claim.cut_short) for m in claim.messages] == [
        (twice, 3, True)
    ]
    assert [m.routing_key for m in (await harness.store.claim(ask())).messages] == ["fresh"]


async def test_heartbeat_keeps_a_lease_and_only_for_its_claim(harness: Harness) -> None:
    await harness.add()
    claim = await harness.store.claim(ask(lease=0.4))
    ids = [m.id for m in claim.messages]
    assert await harness.store.extend(claim.claim_id, ids, lease=30) == frozenset(ids)
    await harness.advance(0.4)
    assert (await harness.store.claim(ask())).messages == ()  # renewed: not expired
    assert await harness.store.extend(uuid.uuid4(), ids, lease=30) == frozenset()  # not its claim


async def test_extend_names_only_the_rows_the_claim_still_holds(harness: Harness) -> None:
    for _ in range(2):
        await harness.add()
    first = await harness.store.claim(ask(lease=0.3))
    ids = sorted(m.id for m in first.messages)
    await harness.advance(0.3)
    taken = await harness.store.claim(ask(1))  # one is taken over
    (lost,) = [m.id for m in taken.messages]
    assert await harness.store.extend(first.claim_id, ids, lease=30) == frozenset(ids) - {lost}


async def test_exhausted_leases_are_buried_unread(harness: Harness) -> None:
    doomed = await harness.add("doomed")
    spared = await harness.add("spared")
    await harness.store.claim(ask(lease=0.2))
    await harness.advance(0.2)
    await harness.store.claim(ask(lease=0.2))  # both claimed twice, never settled
    await harness.advance(0.2)
    claim = await harness.store.claim(ask(lease=0.3, max_attempts=3))  # alone: lost twice
    (row,) = claim.messages
    assert (claim.buried, row.attempts) == ((), 3)
    await harness.store.settle(claim.claim_id, model.Settlement(archive=(row.id,)))
    await harness.advance(0.3)
    buried = await harness.store.claim(ask(max_attempts=2))
    left = {doomed, spared} - {row.message_id}
    assert (buried.messages, buried.buried) == ((), tuple((m, 2) for m in left))
    stats = await harness.store.stats()
    assert (stats.pending, stats.archived, stats.dead_by_reason) == (0, 1, {"max_attempts": 1})


async def test_stats_count_each_state(harness: Harness) -> None:
    for _ in range(3):
        await harness.add()
    await harness.add(delay=3600)
    await harness.store.claim(ask(1))
    stats = await harness.store.stats()
    assert (stats.pending, stats.due, stats.scheduled, stats.in_flight) == (3, 2, 1, 1)
    assert stats.oldest_pending_age_seconds is not None
    assert 0 <= stats.oldest_pending_age_seconds < 60


async def test_relay_sessions_claim_durably_and_read_committed_data_whatever_the_defaults(
    database_url: str,
) -> None:
    # A server (here: a database) that does not wait for the WAL flush and hands out older
    # snapshots by default: the relay's claims must be durable before anything is published, and
    # the key gate's decisions rest on what is committed when each statement runs.
    with psycopg.connect(database_url, autocommit=True) as conn:
        name = conn.info.dbname
        conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
        conn.execute(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    store = await PgStore.open(database_url, "outbox", "t", synchronous_commit=False)
    try:
        async with store._connection() as first, store._connection() as second:
            for pooled in (first, second):  # every connection of the pool, old and new
                cur = await pooled.execute(
                    "SELECT current_setting('synchronous_commit'),"
                    " current_setting('default_transaction_isolation'),"
                    " current_setting('lock_timeout'),"
                    " current_setting('idle_in_transaction_session_timeout')"
                )
                assert await cur.fetchone() == ("on", "read committed", "5s", "5s")
    finally:
        await store.close()


@pytest.mark.parametrize(("durable", "commits"), [(False, "off"), (True, "on")])
def test_a_settle_waits_for_the_flush_only_when_asked(
    database_url: str, durable: bool, commits: str
) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "SELECT outbox.settle(gen_random_uuid(), '{}', '{}', '{}', '{}', '{}', '{}', %s, NULL)",
            [durable],
        )
        assert conn.execute("SHOW synchronous_commit").fetchone() == (commits,)


async def test_observation_tells_whether_autovacuum_runs_for_the_queue(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        server = conn.execute("SELECT current_setting('autovacuum')::boolean").fetchone()
    store = await PgStore.open(database_url, "outbox", "t")
    try:
        assert (await store.observe()).autovacuum_on == (server == (True,))
        with psycopg.connect(database_url, autocommit=True) as conn:  # this test's own database
            conn.execute("ALTER TABLE outbox.messages SET (autovacuum_enabled = false)")
        assert (await store.observe()).autovacuum_on is False
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["memory", "postgres"])
async def test_a_batch_stops_at_its_byte_budget(kind: str, request: pytest.FixtureRequest) -> None:
    kib = 1024
    harness: Harness
    if kind == "memory":
        harness = MemoryHarness(MemoryStore(now=datetime.now(UTC), batch_max_bytes=250 * kib))
    else:
        url = request.getfixturevalue("database_url")
        harness = PgHarness(await PgStore.open(url, "outbox", "t", batch_max_bytes=250 * kib), url)
    try:
        for _ in range(3):
            await harness.add(body=b"x" * 100 * kib)
        await harness.add(body=b"y" * 400 * kib)  # more than the whole budget on its own
        shapes = []
        for _ in range(4):
            claim = await harness.store.claim(ask())
            shapes.append(([len(m.body) // kib for m in claim.messages], claim.cut_short))
        assert shapes == [
            ([100, 100], True),  # a third would pass 250 KiB
            ([100], True),  # the 400 KiB one waits behind it
            ([400], False),  # alone, because a batch takes at least one message
            ([], False),
        ]
    finally:
        if isinstance(harness, PgHarness):
            await harness.store.close()
