"""Leases against real PostgreSQL: a relay never publishes rows it no longer holds, whatever it was
doing while the lease ran (waiting out a broker outage, working through orphans)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import psycopg
import pytest

import relay
from relay.core import errors, loop, model
from relay.postgres.store import PgStore
from tests.support.fakes import ScriptedPublisher
from tests.support.inprocess import query
from tests.support.wait import until_async

LEASE = 0.6


class SlowPublisher(ScriptedPublisher):
    """A broker that takes `delay` seconds over each batch of one (an orphan) and records every
    send with the relay that made it."""

    def __init__(self, name: str, log: list[tuple[str, model.OutboxMessage]], delay: float = 0.0):
        super().__init__()
        self.name, self.log, self.delay = name, log, delay

    async def publish(
        self,
        messages: Sequence[model.OutboxMessage],
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        results = await super().publish(messages, abort, still_held)
        if all(r.outcome is not model.Outcome.UNSENT for r in results):
            self.log.extend((self.name, m) for m in messages)
        if self.delay and len(messages) == 1:
            await asyncio.sleep(self.delay)  # the slow broker this scenario is about
        return results


@contextlib.asynccontextmanager
async def store(url: str, name: str) -> AsyncIterator[PgStore]:
    opened = await PgStore.open(url, "outbox", name)
    try:
        yield opened
    finally:
        await opened.close()


def enqueue(url: str, *keys: str | None) -> None:
    with psycopg.connect(url) as conn:
        for i, key in enumerate(keys):
            relay.enqueue(conn, "x", "k", {"i": i}, ordering_key=key)
        conn.commit()


def check_sends(log: Sequence[tuple[str, model.OutboxMessage]]) -> None:
    """Every copy of a message carries an attempt number at least as high as the copies before it,
    and no keyed message is sent after its successor was."""
    attempts: dict[Any, int] = {}
    highest: dict[str, int] = {}
    for who, m in log:
        assert m.attempts >= attempts.get(m.message_id, 0), (
            f"{who} sent {m.ordering_key}#{m.seq} with attempt {m.attempts} after attempt "
            f"{attempts[m.message_id]}: a stale claim was published"
        )
        attempts[m.message_id] = m.attempts
        if m.ordering_key is not None and m.seq is not None:
            assert m.seq >= highest.get(m.ordering_key, 0), (
                f"{who} sent {m.ordering_key}#{m.seq} after #{highest[m.ordering_key]}"
            )
            highest[m.ordering_key] = max(m.seq, highest.get(m.ordering_key, 0))


async def expired(url: str, key: str, seq: int) -> None:
    async def lease_over() -> bool:
        rows = await query(
            url,
            "SELECT available_at <= now() FROM outbox.messages"
            " WHERE ordering_key = %s AND seq = %s",
            key,
            seq,
        )
        return bool(rows and rows[0][0])

    await until_async(lease_over, timeout=10, message=f"the lease of {key}#{seq} to run out")


async def test_a_batch_claimed_ahead_is_not_published_after_a_broker_outage_outlived_it(
    database_url: str,
) -> None:
    # A relay claims k#1 ahead while publishing a full batch, then loses its broker for longer
    # than the lease. Another replica sends k#1, k#2, k#3. When the broker comes back, the first
    # relay must not send its stale claim of k#1 after them.
    log: list[tuple[str, model.OutboxMessage]] = []
    options = loop.Options(batch_size=3, lease=LEASE, prefetch=True, retry_delay=0.05)
    enqueue(database_url, None, None, None, "k", "k", "k")
    async with store(database_url, "relay-a") as store_a, store(database_url, "relay-b") as store_b:
        broker_a = SlowPublisher("a", log)
        broker_a.gate = asyncio.Event()
        relay_a = loop.Relay(store_a, broker_a, options)
        cycle = asyncio.ensure_future(relay_a.run_once())

        async def claimed_ahead() -> bool:
            rows = await query(
                database_url,
                "SELECT claim_id IS NOT NULL FROM outbox.messages WHERE seq = 1",
            )
            return bool(rows[0][0])

        await until_async(claimed_ahead, timeout=10, message="k#1 to be claimed ahead")
        broker_a.gate.set()
        assert (await cycle).settled.archived == 3

        broker_a.down = 1_000_000  # the broker is gone for a while
        with pytest.raises(errors.BrokerUnavailable):
            await relay_a.run_once()
        await expired(database_url, "k", 1)

        relay_b = loop.Relay(store_b, SlowPublisher("b", log), options)
        await relay_b.run_until_empty()
        await relay_b.run_until_empty()  # k#1 may come back as an orphan first, then #2, #3

        broker_a.down = 0
        await relay_a.run_until_empty()
    keyed = [(who, m.seq, m.attempts) for who, m in log if m.ordering_key == "k"]
    check_sends(log)
    assert [seq for _, seq, _ in keyed] == [1, 2, 3], keyed
    assert await query(database_url, "SELECT count(*) FROM outbox.archive") == [(6,)]


async def test_orphans_outlasting_a_lease_do_not_make_a_relay_send_its_stale_claim(
    database_url: str,
) -> None:
    # A replica died holding fifteen rows. The next relay publishes a full batch, claiming k#1
    # ahead, then works through the orphans one at a time for about two leases. k#1 must go out
    # once, in order.
    log: list[tuple[str, model.OutboxMessage]] = []
    options = loop.Options(batch_size=20, lease=LEASE, prefetch=True, poll_interval=0.05)
    enqueue(database_url, *([None] * 15))
    async with store(database_url, "dead") as dead, store(database_url, "relay-a") as store_a:
        assert len((await dead.claim(model.Ask(20, LEASE, 10))).messages) == 15  # and then it died
        enqueue(database_url, *([None] * 20), "k", "k", "k")

        async def orphaned() -> bool:
            rows = await query(
                database_url,
                "SELECT count(*) FROM outbox.messages WHERE claim_id IS NOT NULL"
                " AND available_at <= now()",
            )
            return bool(rows[0][0] == 15)

        await until_async(orphaned, timeout=10, message="the dead relay's leases to run out")
        relay_a = loop.Relay(store_a, SlowPublisher("a", log, delay=0.08), options)
        stop = asyncio.Event()
        running = asyncio.ensure_future(relay_a.run(stop))

        async def drained() -> bool:
            return bool(
                (await query(database_url, "SELECT count(*) FROM outbox.archive"))[0][0] == 38
            )

        try:
            await until_async(drained, timeout=30, message="all 38 messages archived")
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
    check_sends(log)
    assert [m.seq for _, m in log if m.ordering_key == "k"] == [1, 2, 3]


class RecordingStore(PgStore):
    """PgStore that remembers every message a claim handed to the relay."""

    read: list[model.OutboxMessage]

    async def claim(self, ask: model.Ask) -> model.Claim:
        claim = await super().claim(ask)
        self.read = [*getattr(self, "read", []), *claim.messages]
        return claim

    async def settle(
        self, claim_id: Any, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        counts, claim = await super().settle(claim_id, settlement, then)
        self.read = [*getattr(self, "read", []), *claim.messages]
        return counts, claim


async def test_every_exhausted_orphan_is_buried_unread_in_one_pass(database_url: str) -> None:
    # 250 rows whose relays kept dying on them: all go to dead in SQL, none is read by a relay
    # (reading it may be what kills relays), however many there are.
    enqueue(database_url, *([None] * 250))
    with psycopg.connect(database_url, autocommit=True) as owner:
        owner.execute(
            "UPDATE outbox.messages SET attempts = 3, claim_id = gen_random_uuid(),"
            " claimed_by = 'died', available_at = now() - interval '1 second'"
        )
    store_ = await RecordingStore.open(database_url, "outbox", "relay-a")
    try:
        publisher = SlowPublisher("a", [])
        report = await loop.Relay(store_, publisher, loop.Options(max_attempts=3)).run_once()
    finally:
        await store_.close()
    assert report.buried == 250
    assert getattr(store_, "read", []) == []
    assert await query(database_url, "SELECT count(*), min(reason) FROM outbox.dead") == [
        (250, "max_attempts")
    ]
