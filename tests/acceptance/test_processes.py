"""Relays as real processes: replicas sharing work, SIGTERM, kill -9, and a broker restart."""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import psycopg
import pytest

import relay
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env
from tests.support.proxy import TcpProxy
from tests.support.services import Services
from tests.support.wait import until

pytestmark = pytest.mark.slow


def scalar(url: str, sql: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


def enqueue_many(
    url: str, exchange: str, n: int, per_transaction: int = 100, *, together: bool = False
) -> list[str]:
    """`n` messages, `per_transaction` a transaction. `together`: all of them due at one instant,
    a second from now, so that a relay's claim finds all or none. (Each row is otherwise due at
    its own insert's clock, and a claim sees as due only rows due by its transaction's start: one
    that began while the rows went in took 11 of 20 under load, and left the rest to its next
    claim, which a test that stalls the broker never lets come.)"""
    due = datetime.now(UTC) + timedelta(seconds=1) if together else None
    ids = []
    with psycopg.connect(url) as conn:
        for start in range(0, n, per_transaction):
            batch = range(start, min(n, start + per_transaction))
            messages = [relay.Message(exchange, f"k.{i}", str(i), available_at=due) for i in batch]
            ids += [str(i) for i in relay.enqueue_many(conn, messages)]
            conn.commit()
    return ids


def until_claimed(url: str, n: int, who: str) -> None:
    """Until `n` rows are under a claim; on timeout, the AssertionError shows each row's state."""
    claimed = "SELECT count(*) FROM outbox.messages WHERE claim_id IS NOT NULL"
    try:
        until(lambda: scalar(url, claimed) == n, message=f"{who} to claim all {n} rows")
    except AssertionError as exc:
        with psycopg.connect(url) as conn:
            state = conn.execute(
                "SELECT id, claimed_by, claim_id IS NOT NULL, attempts, available_at - created_at"
                " FROM outbox.messages ORDER BY id"
            ).fetchall()
        seen = f"(id, claimed_by, claimed, attempts, due after) {state}"
        raise AssertionError(f"{exc}; {seen}") from None


def relay_env(database_url: str, amqp_url: str, **extra: str) -> dict[str, str]:
    return clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_POLL_INTERVAL="0.5",
        **extra,
    )


def wait_archived(url: str, n: int, timeout: float = 90) -> None:
    until(
        lambda: scalar(url, "SELECT count(*) FROM outbox.archive") >= n,
        timeout=timeout,
        interval=0.1,
        message=f"{n} archived rows",
    )


# Slow (~9 s): two relay processes start, then 5,000 messages, committed in 50 transactions, are
# relayed in batches of 100 as they arrive: enough batches for both relays to claim many times
# over.
async def test_two_relays_share_5000_messages_without_duplicates(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    env = relay_env(database_url, amqp_url, OUTBOX_BATCH_SIZE="100")
    with RelayProcess(env) as first, RelayProcess(env) as second:
        first.wait_ready()
        second.wait_ready()
        ids = await asyncio.to_thread(enqueue_many, database_url, broker.exchange, 5000)
        await asyncio.to_thread(wait_archived, database_url, 5000)
        assert first.stop() == 0, first.output
        assert second.stop() == 0, second.output
    got = await broker.collect(5000, timeout=60, settle=0.5)
    counts = collections.Counter(g.message_id for g in got)
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    assert scalar(database_url, "SELECT count(*) FROM outbox.messages") == 0
    assert scalar(database_url, "SELECT count(*) FROM outbox.archive") == 5000
    assert "stopped cleanly" in first.output
    assert "stopped cleanly" in second.output


def enqueue_backlog(url: str, exchange: str, n: int) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(%s, 'k', 'body'::bytea) FROM generate_series(1, %s)",
            [exchange, n],
        )
        conn.commit()


async def stop_midway(proc: RelayProcess, database_url: str, broker: Broker, backlog: int) -> str:
    """SIGTERM once the first batch is archived; then check that it stopped with most of the
    backlog left, settled what it had claimed (nothing stays leased to a relay that is gone) and
    that the broker has every archived message. Returns the relay's output."""
    with proc:
        proc.wait_ready()
        until(
            lambda: scalar(database_url, "SELECT count(*) FROM outbox.archive") > 0,
            message="the first batch",
        )
        assert proc.stop() == 0, proc.output
    archived = scalar(database_url, "SELECT count(*) FROM outbox.archive")
    assert 0 < archived < backlog, "it stopped claiming with most of the backlog left"
    assert (
        scalar(
            database_url,
            "SELECT count(*) FROM outbox.messages WHERE claim_id IS NOT NULL"
            " AND available_at > now()",
        )
        == 0
    )
    got = await broker.collect(archived, settle=0.3)
    assert len(got) == archived
    return proc.output


async def test_sigterm_stops_claiming_settles_the_batch_in_flight_and_exits_zero(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    enqueue_backlog(database_url, broker.exchange, 10_000)
    env = relay_env(database_url, amqp_url, OUTBOX_BATCH_SIZE="500")
    await stop_midway(RelayProcess(env), database_url, broker, 10_000)


# Slow (~6 s): a relay process and a 30,000-message backlog, enough that SIGTERM lands mid-drain
# with most of it left; the promise is about a real process and a real signal.
async def test_sigterm_stops_a_drain_until_empty_as_it_stops_a_relay_that_waits(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    """`run --until-empty` on a backlog that takes a while: SIGTERM ends it after the batch in
    flight, not after the backlog (it used to ignore the signal and drain on)."""
    await broker.declare()
    enqueue_backlog(database_url, broker.exchange, 30_000)
    env = relay_env(database_url, amqp_url, OUTBOX_BATCH_SIZE="200")
    output = await stop_midway(RelayProcess(env, "--until-empty"), database_url, broker, 30_000)
    assert "stopped before the backlog was empty" in output


# Slow (~5 s; 31 s once, when one of its 30 s waits ran out): two relay processes, and the killed
# relay's rows wait out its lease before the other takes them; the lease is cut to 3 s, enough
# that they are still leased when the test looks after the kill.
async def test_killed_relay_rows_are_delivered_by_another_after_the_lease(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    target = urlsplit(amqp_url)
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        via_proxy = target._replace(
            netloc=f"{target.username}:{target.password}@127.0.0.1:{proxy.port}"
        ).geturl()
        doomed_env = relay_env(
            database_url, via_proxy, OUTBOX_LEASE="3", OUTBOX_CONFIRM_TIMEOUT="60"
        )
        with RelayProcess(doomed_env) as doomed:
            doomed.wait_ready()
            proxy.pause()  # its publishes now stall on the way to the broker
            ids = await asyncio.to_thread(
                enqueue_many, database_url, broker.exchange, 50, together=True
            )
            until_claimed(database_url, 50, "the doomed relay")
            doomed.kill()
            proxy.cut()  # what it wrote never reaches the broker
    in_flight = scalar(
        database_url, "SELECT count(*) FROM outbox.messages WHERE available_at > now()"
    )
    assert in_flight == 50  # still leased to the dead relay
    with RelayProcess(relay_env(database_url, amqp_url)) as rescuer:
        rescuer.wait_ready()
        wait_archived(database_url, 50, timeout=30)
        assert rescuer.stop() == 0
    got = await broker.collect(50, settle=0.5)
    assert sorted(g.message_id for g in got) == sorted(ids)
    assert scalar(database_url, "SELECT min(attempts) FROM outbox.archive") == 2
    assert scalar(database_url, "SELECT count(*) FROM outbox.messages") == 0


# Slow (~4 s): RabbitMQ itself is restarted under a relay process and a producer; the restart
# takes its seconds, and nothing shorter is a broker restart.
@pytest.mark.serial  # it restarts the broker every other test uses
async def test_broker_restart_mid_run_loses_nothing(
    database_url: str, amqp_url: str, broker: Broker, svc: Services
) -> None:
    await broker.declare(durable=True)  # messages must outlive the broker restart too
    committed: list[str] = []
    producing = threading.Event()

    def produce() -> None:
        producing.set()
        for _ in range(40):
            committed.extend(enqueue_many(database_url, broker.exchange, 25, per_transaction=25))
            time.sleep(0.05)  # a steady trickle of producers over a few seconds

    env = relay_env(database_url, amqp_url, OUTBOX_BATCH_SIZE="50")
    with RelayProcess(env) as proc:
        proc.wait_ready()
        producer = threading.Thread(target=produce)
        producer.start()
        producing.wait(10)
        until(
            lambda: scalar(database_url, "SELECT count(*) FROM outbox.archive") >= 100,
            message="traffic before the restart",
        )
        try:
            await asyncio.to_thread(svc.broker_ctl, "stop_app")
            proc.wait_for("RabbitMQ unavailable", timeout=30)
        finally:
            await asyncio.to_thread(svc.broker_ctl, "start_app")
        producer.join(60)
        await asyncio.to_thread(wait_archived, database_url, len(committed), 120)
        assert proc.stop() == 0, proc.output
    assert len(committed) == 1000
    got = await broker.collect(len(committed), timeout=60, settle=0.5)
    counts = collections.Counter(g.message_id for g in got)
    assert set(counts) == set(committed), "every committed message reached the queue"
    assert scalar(database_url, "SELECT count(*) FROM outbox.messages") == 0


def proxied(url: str, proxy: TcpProxy) -> str:
    parts = urlsplit(url)
    return parts._replace(
        netloc=f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"
    ).geturl()


# Slow (~6-8 s): two relay processes, the first stalled behind a proxy with a ten-minute lease,
# then SIGTERMed; the second must deliver its rows at once (each process starts in ~1 s).
async def test_sigterm_on_a_stalled_broker_gives_rows_back_for_another_relay_at_once(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    target = urlsplit(amqp_url)
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        # A lease of ten minutes: only an explicit give-back can free these rows in time.
        env = relay_env(
            database_url,
            proxied(amqp_url, proxy),
            OUTBOX_LEASE="600",
            OUTBOX_CONFIRM_TIMEOUT="600",
            OUTBOX_SHUTDOWN_TIMEOUT="1",
        )
        with RelayProcess(env) as stalled:
            stalled.wait_ready()
            proxy.pause()
            ids = await asyncio.to_thread(
                enqueue_many, database_url, broker.exchange, 20, together=True
            )
            until_claimed(database_url, 20, "the stalled relay")
            started = time.monotonic()
            assert stalled.stop(timeout=30) == 0, stalled.output
            assert time.monotonic() - started < 15
            proxy.cut()  # what it wrote never reaches the broker
    assert (
        scalar(
            database_url,
            "SELECT count(*) FROM outbox.messages WHERE claim_id IS NULL"
            " AND available_at <= now() AND attempts = 0",
        )
        == 20
    )
    with RelayProcess(relay_env(database_url, amqp_url)) as rescuer:
        rescuer.wait_ready()
        wait_archived(database_url, 20, timeout=15)
        assert rescuer.stop() == 0
    got = await broker.collect(20, settle=0.3)
    assert sorted(g.message_id for g in got) == sorted(ids)


# Slow (~5-9 s): a relay process started anew after each of its four deaths (SIGKILLed when it
# sends the poison row), each time waiting out the dead one's 1 s lease; four attempts allowed
# mean four deaths before the row is buried.
async def test_row_that_kills_its_relay_is_buried_and_spares_the_others(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    # The proxy plays a fatal bug: whenever a relay sends the poison row, it is SIGKILLed on the
    # spot (and the broker never sees that row). The test plays the supervisor that restarts it.
    await broker.declare()
    with psycopg.connect(database_url) as conn:
        innocents = [
            str(relay.enqueue(conn, broker.exchange, f"k.{i}", b"fine")) for i in range(10)
        ]
        poison = str(relay.enqueue(conn, broker.exchange, "poison", b"POISON-PILL"))
        innocents += [
            str(relay.enqueue(conn, broker.exchange, f"k.{i}", b"fine")) for i in range(10, 20)
        ]
        conn.commit()
    target = urlsplit(amqp_url)
    deaths = 0
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 5672) as proxy:
        current: list[RelayProcess] = []
        proxy.trip_on(b"POISON-PILL", lambda: current[-1].proc.kill())
        env = relay_env(
            database_url, proxied(amqp_url, proxy), OUTBOX_LEASE="1", OUTBOX_MAX_ATTEMPTS="4"
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with RelayProcess(env) as proc:
                current.append(proc)

                def died_or_done(proc: RelayProcess = proc) -> bool:
                    return proc.proc.poll() is not None or (
                        scalar(database_url, "SELECT count(*) FROM outbox.messages") == 0
                    )

                until(died_or_done, timeout=60, interval=0.05, message="a death or the end")
                if proc.proc.poll() is None:
                    assert proc.stop() == 0, proc.output
                    break
                deaths += 1
    # One death per attempt: twice in a batch (a relay's rows lost once come back as a batch,
    # which is how a dead relay's rows come back fast), then alone each time.
    assert deaths == 4
    with psycopg.connect(database_url) as conn:
        dead = conn.execute(
            "SELECT message_id::text, reason, attempts, detail FROM outbox.dead"
        ).fetchall()
        archived: dict[str, int] = dict(
            conn.execute("SELECT message_id::text, attempts FROM outbox.archive").fetchall()
        )
    assert [(m, reason, attempts) for m, reason, attempts, _ in dead] == [
        (poison, "max_attempts", 4)
    ]
    assert "moved here unread" in dead[0][3]
    assert sorted(archived) == sorted(innocents)
    # Its batch-mates lost two attempts with it, and went alone (and out) at the third.
    assert max(archived.values()) <= 3, "an innocent paid for the poison row"
    got = await broker.collect(20, settle=0.3, distinct=True)
    assert {g.message_id for g in got} == set(innocents)


def free_port_pair() -> int:
    """A port that is free, with the next one free too (for the second replica to fall back to)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise AssertionError("no two adjacent free ports")


async def test_two_replicas_on_one_host_with_the_same_settings_both_relay(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    # Two relays under systemd with one environment file: the second finds the metrics port
    # taken. It must relay all the same, and say in one line where its metrics went.
    await broker.declare()
    port = free_port_pair()
    env = relay_env(database_url, amqp_url, OUTBOX_METRICS_PORT=str(port))
    with RelayProcess(env) as first:
        first.wait_ready()
        with RelayProcess(env) as second:
            second.wait_ready()
            moved = second.wait_for(f"port {port} is in use")
            assert f"127.0.0.1:{port + 1}" in moved or f":{port + 1}/metrics" in moved, moved
            ids = enqueue_many(database_url, broker.exchange, 400)
            wait_archived(database_url, 400)
            assert second.stop() == 0, second.output
        assert first.stop() == 0, first.output
    got = await broker.collect(400, distinct=True)
    assert {g.message_id for g in got} == set(ids)
    for relay_ in (first, second):
        assert "ERROR" not in relay_.output
