"""The relay under failures caused for real: broker alarms, slow brokers, killed sessions,
restarts and network cuts. Each test names the mechanism it holds in place."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from relay import app
from relay.core import model
from relay.postgres.listener import Listener
from relay.postgres.store import PgStore
from tests.support.amqp import Broker
from tests.support.inprocess import enqueue, query, running, settings_for, wait_for_count
from tests.support.proxy import TcpProxy
from tests.support.services import Services
from tests.support.wait import until_async

pytestmark = pytest.mark.slow

#: For a test that raises a broker alarm, restarts PostgreSQL, changes a server-wide setting or
#: judges a one-second lease against a relay's heartbeats: it runs alone (the others run on the
#: workers: each cuts or stalls only its own proxy, kills only its own database's sessions).
alone = pytest.mark.serial


def messages(exchange: str, n: int, prefix: str = "k") -> list[dict[str, Any]]:
    return [dict(exchange=exchange, routing_key=f"{prefix}.{i}", body=b"x") for i in range(n)]


def via(url: str, proxy: TcpProxy) -> str:
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@127.0.0.1:{proxy.port}" if credentials else f"127.0.0.1:{proxy.port}"
    return parts._replace(netloc=netloc).geturl()


def proxy_to(url: str, default_port: int) -> TcpProxy:
    parts = urlsplit(url)
    return TcpProxy(parts.hostname or "127.0.0.1", parts.port or default_port)


async def scalar(url: str, sql: str) -> Any:
    return (await query(url, sql))[0][0]


async def assert_all_delivered(broker: Broker, database_url: str, ids: list[Any]) -> None:
    """Every committed message is archived once and reached the queue (copies are explained by
    the message's ambiguous sends), and nothing is left behind."""
    await wait_for_count(database_url, "archive", len(ids), timeout=60)
    got = await broker.collect(len(ids), timeout=60, settle=0.3, distinct=True)
    copies = collections.Counter(g.message_id for g in got)
    assert set(copies) == {str(i) for i in ids}
    sends = dict(
        await query(
            database_url, "SELECT message_id::text, attempts + ambiguous FROM outbox.archive"
        )
    )
    assert all(n <= sends[m] for m, n in copies.items()), "a copy no send explains"
    assert await scalar(database_url, "SELECT count(*) FROM outbox.archive") == len(ids)
    assert await scalar(database_url, "SELECT count(*) FROM outbox.messages") == 0


@contextlib.contextmanager
def memory_alarm(svc: Services) -> Iterator[None]:
    """Make RabbitMQ raise its memory alarm (blocking every publishing connection)."""
    before = svc.broker_ctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().").strip()
    svc.broker_ctl("set_vm_memory_high_watermark", "0.000001")
    try:
        yield
    finally:
        svc.broker_ctl("set_vm_memory_high_watermark", before if before[:1].isdigit() else "0.4")


@alone
async def test_blocked_broker_is_not_fed_claims_until_it_unblocks(
    database_url: str, amqp_url: str, broker: Broker, svc: Services
) -> None:
    await broker.declare()
    # A short retry delay: without the blocked check, the relay would re-claim at once.
    settings = settings_for(
        database_url, amqp_url, confirm_timeout=1, poll_interval=0.05, retry_delay=0.05
    )
    async with running(settings) as parts:

        def claimed() -> float | None:
            return parts.metrics.registry.get_sample_value("outbox_claimed_total")

        with memory_alarm(svc):
            ids = await enqueue(database_url, *messages(broker.exchange, 20))
            # The broker blocks the connection on its first publish; that batch times out.
            await until_async(
                lambda: asyncio.sleep(0, parts.publisher.blocked),
                timeout=20,
                message="the broker to block the relay",
            )
            await until_async(
                lambda: scalar(
                    database_url,
                    "SELECT bool_and(claim_id IS NULL AND ambiguous = 1) FROM outbox.messages",
                ),
                timeout=20,
                message="the blocked batch to be given back",
            )
            before = claimed()
            # Deliberately wait with no event: this checks that nothing is claimed meanwhile.
            await asyncio.sleep(1.5)
            assert claimed() == before, "claimed rows it could not publish"
            attempts = await query(database_url, "SELECT attempts FROM outbox.messages")
            assert {a for (a,) in attempts} == {0}, "the alarm spent attempts"
        await assert_all_delivered(broker, database_url, ids)
    assert await scalar(database_url, "SELECT max(attempts) FROM outbox.archive") == 1


@alone
async def test_heartbeats_keep_a_slow_batch_from_being_claimed_twice(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    with proxy_to(amqp_url, 5672) as proxy:
        slow = settings_for(
            database_url, via(amqp_url, proxy), lease=1, confirm_timeout=30, relay_name="slow"
        )
        rescuer = settings_for(
            database_url, amqp_url, lease=1, relay_name="rescuer", poll_interval=0.1
        )
        async with running(slow):
            await until_async(lambda: asyncio.sleep(0, proxy.accepted), message="a connection")
            proxy.pause()
            ids = await enqueue(database_url, *messages(broker.exchange, 10))
            await until_async(
                lambda: scalar(
                    database_url, "SELECT count(*) FROM outbox.messages WHERE claimed_by = 'slow'"
                ),
                message="the slow relay's claim",
            )
            async with running(rescuer):
                # Three leases pass by the database's clock; the rescuer must not see orphans.
                three_leases = (
                    "SELECT bool_and(now() > claimed_at + interval '3 s') FROM outbox.messages"
                )
                await until_async(
                    lambda: scalar(database_url, three_leases), timeout=15, message="three leases"
                )
                holders = await query(
                    database_url, "SELECT DISTINCT claimed_by, claim_id FROM outbox.messages"
                )
                assert len(holders) == 1
                assert holders[0][0] == "slow"
                proxy.resume()
                await wait_for_count(database_url, "archive", 10)
    got = await broker.collect(10, settle=0.3)
    assert sorted(g.message_id for g in got) == sorted(str(i) for i in ids)  # each exactly once
    assert await scalar(database_url, "SELECT max(attempts) FROM outbox.archive") == 1


async def test_undecodable_row_is_dead_lettered_and_the_others_flow(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    ids = await enqueue(database_url, *messages(broker.exchange, 5))
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        # Edited behind enqueue's back: valid jsonb, but deeper than Python's parser can go.
        await conn.execute(
            "UPDATE outbox.messages SET headers = (repeat('{\"a\":', 3000) || '1'"
            " || repeat('}', 3000))::jsonb WHERE message_id = %s",
            [ids[2]],
        )
        await conn.commit()
    async with running(settings_for(database_url, amqp_url)):
        await wait_for_count(database_url, "dead", 1)
        got = await broker.collect(4, settle=0.3)
    assert sorted(g.message_id for g in got) == sorted(str(i) for i in ids if i != ids[2])
    (dead,) = await query(database_url, "SELECT message_id, reason, detail FROM outbox.dead")
    assert dead[:2] == (ids[2], "invalid")
    assert "RecursionError" in dead[2]


KILL_RELAY_SESSIONS = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE application_name LIKE 'outbox-relay%%' AND datname = current_database()"
)


def listening(parts: app.Components) -> Listener:
    assert parts.listener is not None  # these relays LISTEN on their database URL
    return parts.listener


async def reconnected(listener: Listener, before: int) -> None:
    """Wait until the LISTEN connection has come back since it had connected `before` times."""
    await until_async(
        lambda: asyncio.sleep(0, listener.connects > before),
        timeout=30,
        message="the LISTEN connection to come back",
    )


class Traffic:
    """A producer committing batches of 20 in the background, as real producers do."""

    def __init__(self, database_url: str, exchange: str, batches: int) -> None:
        self.committed: list[Any] = []
        self._task = asyncio.create_task(self._produce(database_url, exchange, batches))

    async def _produce(self, database_url: str, exchange: str, batches: int) -> None:
        for b in range(batches):
            self.committed.extend(await enqueue(database_url, *messages(exchange, 20, f"b{b}")))
            await asyncio.sleep(0.02)  # spread the load over time

    async def reaches(self, n: int) -> None:
        await until_async(lambda: asyncio.sleep(0, len(self.committed) >= n), message="traffic")

    async def finish(self) -> list[Any]:
        """Wait for the producer to finish; every id it committed."""
        await self._task
        return self.committed


@contextlib.asynccontextmanager
async def traffic(database_url: str, exchange: str, batches: int) -> AsyncIterator[Traffic]:
    flow = Traffic(database_url, exchange, batches)
    try:
        yield flow
    finally:
        await flow.finish()


async def test_killed_database_sessions_are_survived(
    database_url: str, amqp_url: str, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.declare()
    async with (
        running(settings_for(database_url, amqp_url)) as parts,
        traffic(database_url, broker.exchange, 30) as flow,
    ):
        for n in (100, 250, 400):
            await flow.reaches(n)
            before = listening(parts).connects
            assert await scalar(database_url, KILL_RELAY_SESSIONS) >= 2  # pool and LISTEN
            await reconnected(listening(parts), before)
        await assert_all_delivered(broker, database_url, await flow.finish())


@alone
async def test_postgres_restart_is_survived(
    database_url: str, amqp_url: str, broker: Broker, svc: Services
) -> None:
    if svc.database_ctl is None:
        pytest.skip("needs a local PostgreSQL cluster to restart (pg_ctlcluster)")
    await broker.declare()
    async with running(settings_for(database_url, amqp_url)) as parts:
        first = await enqueue(database_url, *messages(broker.exchange, 300, "before"))
        await until_async(
            lambda: scalar(database_url, "SELECT count(*) > 0 FROM outbox.archive"),
            message="traffic before the restart",
        )
        before = listening(parts).connects
        await asyncio.to_thread(svc.database_ctl, "restart")
        await reconnected(listening(parts), before)
        second = await enqueue(database_url, *messages(broker.exchange, 100, "after"))
        await assert_all_delivered(broker, database_url, first + second)


@alone
@pytest.mark.parametrize("doorbell", ["held", "awaited"])
async def test_postgres_restart_with_the_doorbell_held_or_awaited_is_survived(
    database_url: str, amqp_url: str, broker: Broker, svc: Services, doorbell: str
) -> None:
    # With the arm waiting for a producer when the server went down, the relay once did not stop:
    # the doorbell's chore swallowed its cancel (relay.core.waiting.finish).
    if svc.database_ctl is None:
        pytest.skip("needs a local PostgreSQL cluster to restart (pg_ctlcluster)")
    await broker.declare()
    settings = settings_for(database_url, amqp_url, doorbell=True)
    async with running(settings) as parts, contextlib.AsyncExitStack() as stack:
        bell = parts.doorbell
        assert bell is not None
        first = await enqueue(database_url, *messages(broker.exchange, 50, "before"))
        await until_async(lambda: asyncio.sleep(0, bell.armed.is_set()), message="an idle relay")
        if doorbell == "awaited":
            # A producer takes its side of the doorbell while the relay drains a backlog and
            # holds it to the end: the relay's next arm waits for it. (5,000 keep a relay busy
            # for a second or more, fifty tries of the producer's; 20,000 took 12 s more.)
            first += await enqueue(database_url, *messages(broker.exchange, 5_000, "busy"))
            producer = await psycopg.AsyncConnection.connect(database_url)
            stack.push_async_callback(producer.close)  # the restart ends its transaction

            async def rung() -> bool:
                try:
                    await producer.execute("LOCK outbox.doorbell IN ROW EXCLUSIVE MODE NOWAIT")
                except psycopg.errors.LockNotAvailable:
                    await producer.rollback()
                    return False
                return True

            await until_async(rung, timeout=30, message="the producer's side of the doorbell")
            waiting_arm = (
                "SELECT count(*) = 1 FROM pg_locks"
                " WHERE NOT granted AND relation = 'outbox.doorbell'::regclass"
            )
            await until_async(lambda: scalar(database_url, waiting_arm), message="a waiting arm")
        before = listening(parts).connects
        await asyncio.to_thread(svc.database_ctl, "restart")
        await reconnected(listening(parts), before)
        await until_async(lambda: asyncio.sleep(0, bell.armed.is_set()), message="armed again")
        # Held again, it is no longer lost: a relay that still saw it lost slept not at all and
        # claimed back to back, thousands of times a second.
        assert not bell.lost.is_set()
        second = await enqueue(database_url, *messages(broker.exchange, 100, "after"))
        await assert_all_delivered(broker, database_url, first + second)


async def test_transactions_are_never_left_idle_across_a_slow_publish(
    database_url: str, amqp_url: str, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # A relay that held a database transaction open while waiting for the broker (as the seeds'
    # Node relay does) would be killed by this setting during the stall below.
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET"
            " idle_in_transaction_session_timeout = ''100ms''',"
            " current_database()); END $$"
        )
    await broker.declare()
    caplog.set_level(logging.WARNING)
    with proxy_to(amqp_url, 5672) as proxy:
        async with running(settings_for(database_url, via(amqp_url, proxy))):
            await until_async(lambda: asyncio.sleep(0, proxy.accepted), message="a connection")
            proxy.pause()
            ids = await enqueue(database_url, *messages(broker.exchange, 50))
            claimed = "SELECT count(*) = 50 FROM outbox.messages WHERE claim_id IS NOT NULL"
            await until_async(lambda: scalar(database_url, claimed), message="a claim")
            stalled = "SELECT bool_and(now() > claimed_at + interval '500 ms') FROM outbox.messages"
            await until_async(lambda: scalar(database_url, stalled), message="a long stall")
            proxy.resume()
            await assert_all_delivered(broker, database_url, ids)
    assert not [r for r in caplog.records if "PostgreSQL unavailable" in r.getMessage()]


# Slow at times (usually ~2 s, at times ~11 s): when the cut came while the pool was reconnecting,
# its next try is up to its back-off away, and the relay's wait for a connection is bounded by
# OUTBOX_LOCK_TIMEOUT (5 s) before it tries again; that is the relay's recovery after a network
# cut, as users get it.
async def test_network_cut_to_postgres_is_survived(
    database_url: str, amqp_url: str, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.declare()
    caplog.set_level(logging.WARNING)
    with proxy_to(database_url, 5432) as proxy:
        settings = settings_for(via(database_url, proxy), amqp_url)
        async with running(settings), traffic(database_url, broker.exchange, 30) as flow:
            await flow.reaches(100)
            proxy.cut()
            await until_async(
                lambda: asyncio.sleep(0, _logged(caplog, "PostgreSQL unavailable")),
                timeout=30,
                message="the relay to notice",
            )
            proxy.restore()
            await assert_all_delivered(broker, database_url, await flow.finish())


async def test_network_cut_to_rabbitmq_is_survived(
    database_url: str, amqp_url: str, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await broker.declare()
    caplog.set_level(logging.WARNING)
    with proxy_to(amqp_url, 5672) as proxy:
        settings = settings_for(database_url, via(amqp_url, proxy))
        async with running(settings), traffic(database_url, broker.exchange, 30) as flow:
            await flow.reaches(100)
            proxy.cut()
            await until_async(
                lambda: asyncio.sleep(0, _logged(caplog, "RabbitMQ unavailable")),
                timeout=30,
                message="the relay to notice",
            )
            proxy.restore()
            await assert_all_delivered(broker, database_url, await flow.finish())


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in record.getMessage() for record in caplog.records)


@alone
async def test_a_claims_attempt_survives_a_postgres_crash_with_asynchronous_commits(
    database_url: str, svc: Services
) -> None:
    # With OUTBOX_SYNCHRONOUS_COMMIT=false, a claim that PostgreSQL acknowledged before flushing
    # it could vanish in a crash after its message was published: the next claim would then send
    # it again under the same attempt number, and `attempts + ambiguous` would no longer bound
    # the sends. The claim must be durable before anything is published.
    if svc.database_ctl is None:
        pytest.skip("needs a local PostgreSQL cluster to crash (pg_ctlcluster)")
    ctl = svc.database_ctl
    await enqueue(database_url, dict(exchange="x", routing_key="k", body=b"x"))
    async with await psycopg.AsyncConnection.connect(svc.database_url, autocommit=True) as conn:
        # Only commits that wait for the flush reach the disk within the next ten seconds.
        await conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        await conn.execute("SELECT pg_reload_conf()")
    try:
        store = await PgStore.open(database_url, "outbox", "crash", synchronous_commit=False)
        try:
            claim = await store.claim(model.Ask(10, 60, 10))
            assert [m.attempts for m in claim.messages] == [1]  # …and it is being published
            await asyncio.to_thread(ctl, "stop", "-m", "immediate")  # PostgreSQL crashes
            await asyncio.to_thread(ctl, "start")
        finally:
            await store.close()
        assert await scalar(database_url, "SELECT attempts FROM outbox.messages") == 1
    finally:
        async with await psycopg.AsyncConnection.connect(svc.database_url, autocommit=True) as c:
            await c.execute("ALTER SYSTEM RESET wal_writer_delay")
            await c.execute("SELECT pg_reload_conf()")
