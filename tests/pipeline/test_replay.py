"""Replays from the lake against real PostgreSQL, RabbitMQ and a local Spark: a selection comes
back through the broker exactly, with its provenance and in per-key order; a replay killed mid-way
and run again adds each message once; and the orders of events around a replay's position."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika.abc
import psycopg
import pytest
from psycopg.types.json import Jsonb
from pyspark.sql import Row, SparkSession
from pyspark.sql import types as T

from relay.core import config, errors
from relay.core.filters import when
from relay.pipeline import jobs, replay, sending
from relay.pipeline.database import Batch, PipelineDatabase, ReplayDatabase
from relay.pipeline.export import Source, export
from tests.support import amqp, databases, inprocess, services
from tests.support.processes import clean_env
from tests.support.wait import until, until_async

#: The archive the tests replay: 6 days of messages, ending two days ago.
DAYS = 6
PER_DAY = 120
END = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=2)
START = END - timedelta(days=DAYS)


def rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()


def quiet(_: str) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Exported:
    lake: Path  # the module's lake: each test replays from a copy of its own
    rows: list[dict[str, Any]]


@pytest.fixture(scope="module")
def exported(
    spark: SparkSession,
    svc: services.Services,
    template_db: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Exported]:
    """Archive DAYS days of messages (four ordering keys among them, some with headers) in a
    database of the module's own, and export them to a lake: once, as an export takes seconds
    of Spark and the tests only read the lake (replay reads nothing else of an export)."""
    name = databases.create(svc.database_url, template_db)
    url = svc.with_database(name)
    try:
        with psycopg.connect(url) as conn:
            conn.execute(
                "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
                " properties, ordering_key, attempts, created_at, published_at)"
                " SELECT gen_random_uuid(), (ARRAY['orders', 'orders', 'billing'])[1 + i %% 3],"
                "        (ARRAY['order.created', 'order.paid', 'invoice.sent', 'order.paid.late'])"
                "          [1 + i %% 4],"
                "        convert_to('{\"i\": ' || i || '}'"
                "                   || repeat(' ', (i %% 13 = 0)::int * 600), 'UTF8'),"
                '        CASE WHEN i %% 97 = 5 THEN \'{"x-replay": "earlier"}\''
                "             WHEN i %% 2 = 0 THEN jsonb_build_object('tenant', 't' || i %% 7)"
                "             ELSE '{}' END,"
                '        \'{"content_type": "application/json"}\','
                "        CASE WHEN i %% 5 < 4 THEN 'customer-' || i %% 11 %% 4 END,"
                "        1, p - interval '2 ms', p"
                " FROM (SELECT i, %(start)s + i * %(step)s AS p"
                "       FROM generate_series(0, %(n)s - 1) AS i) AS g"
                " ORDER BY p",
                {
                    "start": START,
                    "step": timedelta(days=DAYS) / (DAYS * PER_DAY),
                    "n": DAYS * PER_DAY,
                },
            )
        found = rows(
            url,
            "SELECT id, message_id::text, exchange, routing_key, body, headers, ordering_key,"
            " published_at FROM outbox.archive ORDER BY id",
        )
        names = (
            "id",
            "message_id",
            "exchange",
            "routing_key",
            "body",
            "headers",
            "key",
            "published",
        )
        lake = tmp_path_factory.mktemp("exported") / "lake"
        with PipelineDatabase.connect(url, "outbox") as db:
            source = Source(url, "outbox", partitions=2, fetch_size=500)
            export(spark, lake.as_uri(), source, db, END + timedelta(days=1), chunk=400, say=quiet)
        yield Exported(lake, [dict(zip(names, r, strict=True)) for r in found])
    finally:
        databases.drop(svc.database_url, name)


@pytest.fixture
def archived(exported: Exported, lake: str) -> list[dict[str, Any]]:
    """The lake holds DAYS days of archived messages, and PostgreSQL none of them: the lake is
    the only copy. Returns the rows as they were, in id order."""
    shutil.copytree(exported.lake, Path(urlsplit(lake).path))
    return exported.rows


def originals(archived: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The archived messages that were not themselves replays (a replay takes only those)."""
    return [r for r in archived if "x-replay" not in r["headers"]]


def settings(database_url: str, lake: str) -> config.PipelineSettings:
    return config.load_pipeline(database_url=database_url, lake=lake, spark_master="local[2]")


def waiting(url: str, name: str) -> list[dict[str, Any]]:
    """The headers of every message replay `name` put in the outbox, as they wait there."""
    found = rows(
        url,
        "SELECT headers FROM outbox.messages WHERE headers->>'x-replay' = %s",
        name,
    )
    return [r[0] for r in found]


def day(n: int) -> datetime:
    return START + timedelta(days=n)


# Slow (~6 s; ~30 s as the first Spark test of its worker, which pays the session's JVM start and
# the module's export): a replay through Spark in batches of 7, then a relay's deliveries collected
# until a second passes with none (nothing else may arrive).
async def test_a_replay_sends_exactly_its_selection_with_provenance_in_key_order(
    spark: SparkSession,
    database_url: str,
    amqp_url: str,
    broker: amqp.Broker,
    lake: str,
    archived: list[dict[str, Any]],
) -> None:
    await broker.declare()
    selection = replay.Selection(
        since=day(2) + timedelta(hours=5),
        until=day(4),
        exchange="orders",
        routing_key="order.paid*",
        to_exchange=broker.exchange,
    )
    chosen = [
        r
        for r in originals(archived)
        if selection.since <= r["published"] < selection.until
        and r["exchange"] == "orders"
        and r["routing_key"].startswith("order.paid")
    ]
    assert 50 < len(chosen) < len(archived) / 4
    assert {r["key"] for r in chosen} > {None}  # keyed and unkeyed
    outcome = jobs.replay_lake(
        settings(database_url, lake),
        selection,
        name="bootstrap",
        batch=7,
        rate=5000,
        say=quiet,
        spark=spark,
    )
    assert (outcome.selected, outcome.enqueued, outcome.skipped) == (len(chosen), len(chosen), 0)

    async with inprocess.running(inprocess.settings_for(database_url, amqp_url)):
        received = await broker.collect(len(chosen), settle=1.0)
    assert len(received) == len(chosen)  # nothing else arrived
    by_original = {r["message_id"]: r for r in chosen}
    assert {m.headers["x-replay-of"] for m in received} == set(by_original)
    keys: dict[str, list[datetime]] = defaultdict(list)
    for m in received:
        original = by_original[m.headers["x-replay-of"]]
        expected_id = sending.message_id("bootstrap", original["id"], original["message_id"])
        assert m.message_id == str(expected_id)
        assert m.message_id != original["message_id"]
        assert m.routing_key == original["routing_key"]
        assert m.body == bytes(original["body"])
        assert m.headers["x-replay"] == "bootstrap"
        assert m.headers["x-replay-exchange"] == "orders"
        assert m.headers["x-replay-routing-key"] == original["routing_key"]
        published = datetime.fromisoformat(m.headers["x-replay-published-at"])
        assert published == original["published"]
        for header, value in original["headers"].items():
            assert m.headers[header] == value
        assert m.properties.content_type == "application/json"
        if original["key"] is not None:
            keys[original["key"]].append(published)
    assert len(keys) == 4
    for key, times in keys.items():
        assert times == sorted(times), f"{key} arrived out of its original order"

    # The same replay again adds nothing.
    again = jobs.replay_lake(
        settings(database_url, lake), selection, name="bootstrap", say=quiet, spark=spark
    )
    assert (again.selected, again.enqueued) == (0, 0)
    assert rows(database_url, "SELECT count(*) FROM outbox.messages")[0][0] == 0
    assert waiting(database_url, "bootstrap") == []


RATE, BATCH = 200, 50


async def enqueued_while_relayed(
    database_url: str, amqp_url: str, broker: amqp.Broker, run: Callable[[], Awaitable[int]]
) -> list[float]:
    """When each message `run` replays was enqueued (its row's created_at, the clock inside the
    batch's transaction), sorted, once every one of them has reached a consumer through a relay
    running meanwhile; `run` returns how many it enqueued.

    The pace is judged where the replay sets it, in the outbox. A consumer's clock would judge the
    relay and the consumer too: one that falls 0.1 s behind, starved by the replay's JVM, catches
    up in a burst (270 in one second at R = 200 was seen so)."""
    await broker.declare()
    arrived: list[str] = []

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        arrived.append(str(message.message_id))
        await message.ack()

    relaying = inprocess.running(inprocess.settings_for(database_url, amqp_url))
    async with relaying, broker.channel() as channel:
        await channel.set_qos(prefetch_count=1000)
        queue = await channel.get_queue(broker.queue, ensure=False)
        await queue.consume(on_message)
        expected = await run()

        async def all_in() -> bool:
            return len(arrived) >= expected

        await until_async(all_in, timeout=30, message="every message")
    assert expected > 10 * BATCH
    # The originals were deleted when they went to the lake: every row left is the replay's.
    enqueued = rows(
        database_url,
        "SELECT message_id::text, extract(epoch FROM created_at)::float8 FROM outbox.messages"
        " UNION ALL"
        " SELECT message_id::text, extract(epoch FROM created_at)::float8 FROM outbox.archive",
    )
    assert sorted(arrived) == sorted(m for m, _ in enqueued), "each message, once"
    return sorted(t for _, t in enqueued)


def assert_ceiling(enqueued: list[float]) -> None:
    """No sliding second holds more than RATE + BATCH. (That the run keeps to the rate on
    average is the pacer's, judged on a clock the test moves, in tests/unit/test_pace.py: a
    machine loaded by other tests may not let it, 131/s of 200 was seen.)"""
    busiest = max(bisect.bisect_left(enqueued, t + 1.0) - i for i, t in enumerate(enqueued))
    print(f"--rate {RATE} --batch {BATCH}: busiest second {busiest}")
    assert busiest <= RATE + BATCH, f"{busiest} messages in one second at --rate {RATE}"


# Slow (~24 s): `pipeline replay` starts a cold JVM in a subprocess and sends 712 messages at --rate
# 200 (3.5 s by design); the ceiling must hold for the command as users run it, first rows late from
# a cold Spark included, over more than 10 batches.
async def test_the_rate_is_a_ceiling_on_what_reaches_the_outbox(
    database_url: str,
    amqp_url: str,
    broker: amqp.Broker,
    lake: str,
    archived: list[dict[str, Any]],
) -> None:
    """`outbox-relay pipeline replay --rate R --batch B`, as a user runs it (a cold Spark),
    counted in the outbox, with every message delivered."""
    command = ["-m", "relay", "pipeline", "replay", "--lake", lake, "--name", "paced"]
    command += ["--to-exchange", broker.exchange, "--rate", str(RATE), "--batch", str(BATCH)]
    env = clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_SPARK_MASTER="local[1]")

    async def run() -> int:
        replaying = await asyncio.create_subprocess_exec(
            sys.executable, *command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        output, _ = await asyncio.wait_for(replaying.communicate(), 180)
        assert replaying.returncode == 0, output.decode()
        return len(originals(archived))

    assert_ceiling(await enqueued_while_relayed(database_url, amqp_url, broker, run))


# Slow (~7 s): 600 messages replayed at --rate 200 (3 s by design) with a 1.5 s stall midway, and a
# relay delivering them; the ceiling is judged over more than 10 batches, after a stall long enough
# to have earned a burst of 300 under the old pacing.
async def test_a_stalled_batch_is_no_credit_for_a_burst(
    spark: SparkSession, database_url: str, amqp_url: str, broker: amqp.Broker
) -> None:
    """A batch that waits (here for a lock another session holds on the replay's row for 1.5 s,
    as a slow disk or a cold lake read makes it wait) earns no credit: the batches after it go
    out at the rate, not back to back (which put 300 messages into one second at R = 200,
    B = 50)."""
    data = lake_rows(spark, *(lake_row(i, str(uuid.uuid4())) for i in range(1, 601)))
    selection = replay.Selection(to_exchange=broker.exchange)
    holding = threading.Event()

    def hold_the_replay_midway() -> None:
        sent = "SELECT coalesce(max(enqueued), 0) FROM outbox.replays WHERE name = 'stalled'"
        until(
            lambda: rows(database_url, sent)[0][0] >= 4 * BATCH,
            timeout=60,
            message="the replay to be under way",
        )
        with psycopg.connect(database_url) as conn:
            conn.execute("SELECT 1 FROM outbox.replays WHERE name = 'stalled' FOR UPDATE")
            holding.set()
            # Deliberately a wait with no event: it is the stall the replay must not make up for.
            time.sleep(1.5)

    def replaying() -> int:
        holder = threading.Thread(target=hold_the_replay_midway)
        holder.start()
        with ReplayDatabase.connect(database_url, "outbox") as db:
            db.start("stalled", {"selection": selection.document(), "given": {}})
            done = replay.replay(data, db, "stalled", selection, after=0, rate=RATE, batch=BATCH)
        holder.join(60)
        assert holding.is_set()
        return done.enqueued

    async def run() -> int:
        return await asyncio.to_thread(replaying)

    assert_ceiling(await enqueued_while_relayed(database_url, amqp_url, broker, run))


# Slow (~17 s): `pipeline replay` in a subprocess (a cold JVM) is SIGKILLed after 30 messages, then
# the rest is replayed on the session's Spark; the kill must be of a real process between its
# batches.
def test_a_replay_killed_midway_and_run_again_enqueues_each_message_once(
    spark: SparkSession,
    database_url: str,
    lake: str,
    archived: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    options = ["--since", day(1).isoformat(), "--until", day(5).isoformat(), "--key", "customer-?"]
    chosen = [
        r for r in originals(archived) if day(1) <= r["published"] < day(5) and r["key"] is not None
    ]
    command = [sys.executable, "-m", "relay", "pipeline", "replay", "--lake", lake]
    command += ["--name", "again", "--rate", "40", "--batch", "10", *options]
    env = clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_SPARK_MASTER="local[1]")
    with (tmp_path / "replay.log").open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            until(
                lambda: len(waiting(database_url, "again")) >= 30,
                timeout=120,
                message="the replay to enqueue 30 messages",
            )
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
    partly = len(waiting(database_url, "again"))
    assert 30 <= partly < len(chosen)
    ((position, enqueued),) = rows(
        database_url, "SELECT position, enqueued FROM outbox.replays WHERE name = 'again'"
    )
    assert enqueued == partly
    assert position > 0

    given = {
        "since": day(1).isoformat(),
        "until": day(5).isoformat(),
        "exchange": None,
        "routing_key": None,
        "key": "customer-?",
        "to_exchange": None,
        "to_routing_key": None,
        "include_replays": False,
    }
    rest = jobs.replay_lake(
        settings(database_url, lake),
        # Not used, not even checked: the replay's own selection, from its first run, is (as
        # when `--since 90d` resolves past a fixed `--until` by the time the command is re-run).
        replay.Selection(since=day(5), until=day(1)),
        name="again",
        given=given,
        say=quiet,
        spark=spark,
    )
    assert (rest.selected, rest.enqueued) == (len(chosen) - partly, len(chosen) - partly)
    headers = waiting(database_url, "again")
    assert sorted(h["x-replay-of"] for h in headers) == sorted(r["message_id"] for r in chosen)
    # Per key, in the outbox in their original order (the key gate sends them that way).
    order = rows(
        database_url,
        "SELECT ordering_key, headers->>'x-replay-published-at' FROM outbox.messages"
        " WHERE headers->>'x-replay' = 'again' ORDER BY ordering_key, seq",
    )
    for key in {k for k, _ in order}:
        times = [t for k, t in order if k == key]
        assert times == sorted(times, key=datetime.fromisoformat)

    with pytest.raises(errors.InvalidArgument, match="other options"):
        jobs.replay_lake(
            settings(database_url, lake),
            replay.Selection(),
            name="again",
            given={**given, "key": "*"},
            say=quiet,
            spark=spark,
        )


# Slow (~3 s; ~25 s as the first Spark test of its worker, which pays the session's JVM start and
# the module's export): a dry run's counts per route, through Spark.
def test_a_dry_run_counts_per_route_and_sends_nothing(
    spark: SparkSession, database_url: str, lake: str, archived: list[dict[str, Any]]
) -> None:
    said: list[str] = []
    selection = replay.Selection(since=day(3), to_routing_key="replayed")
    found = jobs.replay_lake(
        settings(database_url, lake),
        selection,
        name="look",
        dry_run=True,
        say=said.append,
        spark=spark,
    )
    chosen = [r for r in originals(archived) if r["published"] >= day(3)]
    assert found.selected == len(chosen)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for r in chosen:
        counts[r["exchange"], r["routing_key"]] += 1
    lines = said[1:]
    assert len(lines) == len(counts)
    for (exchange, routing_key), n in counts.items():
        (line,) = [x for x in lines if f" {exchange} {routing_key} to " in x]
        assert line.split()[0] == f"{n:,}"
        assert "routing key 'replayed'" in line
    assert rows(database_url, "SELECT count(*) FROM outbox.replays")[0][0] == 0
    assert rows(database_url, "SELECT count(*) FROM outbox.messages")[0][0] == 0
    # Messages that were themselves replays count only when asked for.
    everything = dataclasses.replace(selection, include_replays=True)
    found = jobs.replay_lake(
        settings(database_url, lake), everything, dry_run=True, say=quiet, spark=spark
    )
    assert found.selected == len([r for r in archived if r["published"] >= day(3)]) > len(chosen)


# Slow (~2 s; ~20 s as the first Spark test of its worker, which pays the session's JVM start and
# the module's export): a replay through Spark of the days it selects.
def test_a_replay_reads_only_the_days_it_selects(
    spark: SparkSession, database_url: str, lake: str, archived: list[dict[str, Any]]
) -> None:
    # Every Parquet file of the other days is made unreadable: a replay that opened one (to read
    # it, or only its footer) would fail.
    root = Path(lake.removeprefix("file://"), "archive")
    wanted = f"day={day(4):%Y-%m-%d}"
    spoilt = [p for p in root.glob("day=*/*/*.parquet") if p.parts[-3] != wanted]
    assert spoilt
    for path in spoilt:
        path.write_bytes(b"not parquet")
    selection = replay.Selection(since=day(4), until=day(5))
    found = jobs.replay_lake(
        settings(database_url, lake), selection, dry_run=True, say=quiet, spark=spark
    )
    expected = [r for r in originals(archived) if day(4) <= r["published"] < day(5)]
    assert found.selected == len(expected) > 0


# Slow (~15 s): small Spark jobs on the session's local[2] JVM: a replay that counts, sorts and
# reads the lake, and a second that counts it; skips are a real replay's handling of refused
# batches, and the second run shows they are not tried again.
def test_messages_the_outbox_refuses_today_are_skipped_and_recorded(
    spark: SparkSession, database_url: str, lake: str, archived: list[dict[str, Any]]
) -> None:
    rows(database_url, "UPDATE outbox.settings SET max_body_bytes = 500 RETURNING 1")
    chosen = [r for r in originals(archived) if r["published"] >= day(5)]
    too_big = sorted(r["id"] for r in chosen if len(r["body"]) > 500)
    assert 0 < len(too_big) < len(chosen)
    said: list[str] = []
    outcome = jobs.replay_lake(
        settings(database_url, lake),
        replay.Selection(since=day(5)),
        name="limits",
        batch=25,
        rate=10_000,
        say=said.append,
        spark=spark,
    )
    assert outcome.skipped == len(too_big)
    assert [lake_id for lake_id, _, _ in outcome.first_skipped] == too_big
    assert outcome.enqueued == len(chosen) - len(too_big)
    assert all("limit is 500 bytes" in why for _, _, why in outcome.first_skipped), outcome
    assert any(f"{len(too_big)} messages skipped" in line for line in said)
    ((skipped, skips, position),) = rows(
        database_url, "SELECT skipped, skips, position FROM outbox.replays WHERE name = 'limits'"
    )
    assert skipped == len(too_big)
    assert [s["id"] for s in skips] == too_big
    assert position == max(r["id"] for r in chosen)
    assert len(waiting(database_url, "limits")) == outcome.enqueued
    again = jobs.replay_lake(
        settings(database_url, lake),
        replay.Selection(since=day(5)),
        name="limits",
        say=quiet,
        spark=spark,
    )
    assert (again.selected, again.enqueued, again.skipped) == (0, 0, 0)


def test_a_lake_row_becomes_its_message_with_provenance() -> None:
    row = Row(
        id=7,
        message_id="0b9e7f8a-3c1d-4e5f-8a9b-0c1d2e3f4a5b",
        exchange="orders",
        routing_key="order.paid",
        body=bytearray(b"{}"),
        headers='{"tenant": "t1", "x-replay": "older", "precise": 0.12345678901234567890123}',
        properties='{"content_type": "application/json"}',
        ordering_key="customer-1",
        published_at=datetime(2026, 11, 20, 23, 59, 59, 999999, tzinfo=UTC),
    )
    message = sending.message("r", row)
    assert message.headers == row.headers  # as the lake holds it: merged in PostgreSQL
    assert message.provenance["x-replay"] == "r"  # the newest replay names itself
    assert message.provenance["x-replay-of"] == row.message_id
    assert message.provenance["x-replay-published-at"] == "2026-11-20T23:59:59.999999+00:00"
    assert message.message_id == sending.message_id("r", 7, row.message_id)
    assert message.message_id not in (
        sending.message_id("s", 7, row.message_id),
        sending.message_id("r", 8, row.message_id),  # the same id reused by a later message
    )
    for bad in ("[1]", "null", "not json", '{"a": NaN}', '{"a": "\\u0000"}'):
        with pytest.raises(errors.InvalidMessage, match="headers in the lake"):
            sending.message("r", Row(**{**row.asDict(), "headers": bad}))
    with pytest.raises(errors.InvalidMessage, match="missing"):
        sending.message("r", Row(**{**row.asDict(), "body": None}))


def lake_rows(spark: SparkSession, *rows: dict[str, Any]) -> Any:
    columns = [f.name for f in replay.SCHEMA.fields if f.name not in ("day", "id_range")]
    schema = T.StructType([f for f in replay.SCHEMA.fields if f.name in columns])
    return spark.createDataFrame([tuple(r[c] for c in columns) for r in rows], schema)


def lake_row(lake_id: int, message_id: str, **overrides: Any) -> dict[str, Any]:
    row = {
        "id": lake_id,
        "message_id": message_id,
        "exchange": "orders",
        "routing_key": "order.paid",
        "body": bytearray(b"{}"),
        "headers": f'{{"n": {lake_id}, "precise": 0.12345678901234567890123}}',
        "properties": "{}",
        "ordering_key": None,
        "published_at": datetime(2026, 11, 1, tzinfo=UTC) + timedelta(seconds=lake_id),
    }
    return row | overrides


# Slow (~2 s; ~17 s as the first Spark test of its worker, which pays the session's JVM start):
# a lake made from three rows and a replay of it, small Spark jobs on the session's JVM.
def test_targets_archived_ids_reused_and_exact_headers_all_come_through(
    spark: SparkSession, database_url: str
) -> None:
    """'' is AMQP's default exchange: a target like any other, not "no target". Two archived
    messages that shared an id (reused after the first was sent) are two replayed messages.
    Header values go through as the lake holds them (no round trip through floats)."""
    shared = str(uuid.uuid4())
    data = lake_rows(
        spark, lake_row(3, shared), lake_row(4, shared), lake_row(9, str(uuid.uuid4()))
    )
    selection = replay.Selection(to_exchange="", to_routing_key="a-queue")
    with ReplayDatabase.connect(database_url, "outbox") as db:
        db.start("targets", {"selection": selection.document(), "given": {}})
        outcome = replay.replay(data, db, "targets", selection, after=0, rate=1e6, batch=10)
    assert (outcome.enqueued, outcome.skipped) == (3, 0)
    found = rows(
        database_url,
        "SELECT exchange, routing_key, headers->>'x-replay-of', (headers->'precise')::text,"
        " message_id FROM outbox.messages",
    )
    assert {(e, r) for e, r, *_ in found} == {("", "a-queue")}
    assert sorted(of for _, _, of, _, _ in found).count(shared) == 2
    assert len({m for *_, m in found}) == 3
    assert {p for _, _, _, p, _ in found} == {"0.12345678901234567890123"}


# Slow (~3 s; ~10 s as the first Spark test of its worker, which pays the session's JVM start and
# the module's export): a replay through Spark of two days of the lake.
def test_two_first_runs_of_one_replay_use_the_selection_recorded_first(
    spark: SparkSession,
    database_url: str,
    lake: str,
    archived: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs A and B of one command both find no replay; A records its selection (its `--since
    7d` resolved a moment before B's) and B's start returns A's row: B must replay A's selection,
    not the rows it selected with its own times (it would move the position past rows of A's
    that it never sent)."""
    given = {"since": "4d", "until": None}
    a_selection = replay.Selection(since=day(4))
    with ReplayDatabase.connect(database_url, "outbox") as db:
        db.start("racing", {"selection": a_selection.document(), "given": given})
    monkeypatch.setattr(ReplayDatabase, "find", lambda self, name: None)  # B looked before A
    b_selection = replay.Selection(since=day(1))
    outcome = jobs.replay_lake(
        settings(database_url, lake),
        b_selection,
        name="racing",
        given=given,
        say=quiet,
        spark=spark,
    )
    expected = [r for r in originals(archived) if r["published"] >= day(4)]
    assert outcome.enqueued == len(expected)
    replayed = sorted(h["x-replay-of"] for h in waiting(database_url, "racing"))
    assert replayed == sorted(r["message_id"] for r in expected)


# The orders of events around a replay's position (the fence of its batches).


def batch(after: int, first: int, n: int, key: str | None = None) -> Batch:
    """n messages from lake ids first, first + 1, …, sent by a run that saw the position at
    `after`."""
    return Batch(
        after=after,
        ids=list(range(first, first + n)),
        exchanges=["x"] * n,
        routing_keys=["r"] * n,
        bodies=[b"{}"] * n,
        headers=["{}"] * n,
        provenance=[Jsonb({"x-replay": "fence"})] * n,
        properties=["{}"] * n,
        ordering_keys=[key] * n,
        message_ids=[uuid.uuid4() for _ in range(n)],
    )


def waiting_count(url: str) -> int:
    return len(waiting(url, "fence"))


def started(url: str) -> None:
    with ReplayDatabase.connect(url, "outbox") as db:
        db.start("fence", {"selection": {}, "given": {}})


def raw_batch(conn: psycopg.Connection[Any], b: Batch) -> None:
    conn.execute(
        "SELECT outbox.replay_batch('fence', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            b.after,
            b.ids,
            b.exchanges,
            b.routing_keys,
            b.bodies,
            b.headers,
            b.provenance,
            b.properties,
            b.ordering_keys,
            b.message_ids,
        ),
    )


def test_two_runs_of_one_replay_at_once_enqueue_its_batch_once(database_url: str) -> None:
    """Run A's batch is in its transaction when run B sends the same batch: B waits for A's
    row lock, then finds the position moved and is refused."""
    started(database_url)
    with psycopg.connect(database_url) as a:
        raw_batch(a, batch(0, 1, 5))
        refused: list[BaseException] = []

        def run_b() -> None:
            try:
                with ReplayDatabase.connect(database_url, "outbox") as b:
                    b.enqueue("fence", batch(0, 1, 5))
            except errors.RelayError as exc:
                refused.append(exc)

        other = threading.Thread(target=run_b)
        other.start()
        until(
            lambda: (
                rows(
                    database_url,
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND application_name = 'outbox-relay replay'",
                )[0][0]
                == 1
            ),
            message="run B to wait for run A's batch",
        )
    # Leaving `with psycopg.connect(…)` committed A's batch.
    other.join(30)
    assert refused
    assert "moved on from position 0 to 5" in str(refused[0])
    assert waiting_count(database_url) == 5


def test_a_run_that_read_the_position_late_cannot_resend_what_it_already_passed(
    database_url: str,
) -> None:
    """Run B selected rows past position 0; run A then committed lake ids 1–5; B, reading the
    position only now (5), sends its first batch — ids 1–5 again — as "after 5". Refused: a
    batch must lie wholly past the position it names (A's messages may be published already, so
    their ids, unique only while waiting, would not stop a second copy)."""
    started(database_url)
    with ReplayDatabase.connect(database_url, "outbox") as db:
        assert db.enqueue("fence", batch(0, 1, 5)) == 5
        rows(database_url, "DELETE FROM outbox.messages RETURNING 1")  # A's were sent meanwhile
        with pytest.raises(errors.InvalidArgument, match="not past the position 5"):
            db.enqueue("fence", batch(5, 1, 5))
        with pytest.raises(errors.InvalidArgument, match="not past the position 5"):
            db.enqueue("fence", batch(5, 5, 3))
        with pytest.raises(errors.InvalidArgument, match="must lie past the position"):
            db.skip("fence", 5, 3, "m", "why")  # behind it: refused by the fence
        state = db.find("fence")
        assert state is not None
        assert (state.position, state.enqueued) == (5, 5)
    assert waiting_count(database_url) == 0


def test_a_batch_whose_answer_was_lost_is_refused_when_sent_again(database_url: str) -> None:
    """The batch committed but its run never learnt it (the connection broke on the way back):
    sending it again is refused, and the replay goes on from the committed position."""
    started(database_url)
    with ReplayDatabase.connect(database_url, "outbox") as db:
        first = batch(0, 1, 5, key="k")
        assert db.enqueue("fence", first) == 5
        with pytest.raises(errors.RelayError, match="moved on"):
            db.enqueue("fence", first)
        state = db.find("fence")
        assert state is not None
        assert (state.position, state.enqueued) == (5, 5)
        assert db.enqueue("fence", batch(5, 6, 3, key="k")) == 3
    assert waiting_count(database_url) == 8


def test_a_batch_rolled_back_moves_nothing(database_url: str) -> None:
    started(database_url)
    with psycopg.connect(database_url) as conn:
        raw_batch(conn, batch(0, 1, 5))
        conn.rollback()
    with ReplayDatabase.connect(database_url, "outbox") as db:
        state = db.find("fence")
        assert state is not None
        assert (state.position, state.enqueued) == (0, 0)
        assert db.enqueue("fence", batch(0, 1, 5)) == 5
    assert waiting_count(database_url) == 5


def test_bad_replay_input_is_refused_at_the_boundary(database_url: str) -> None:
    with ReplayDatabase.connect(database_url, "outbox") as db:
        with pytest.raises(errors.InvalidArgument, match="replay name"):
            db.start("no spaces; please", {"selection": {}})
        with pytest.raises(errors.InvalidArgument, match="no replay"):
            db.enqueue("never-started", batch(0, 1, 1))
        db.start("fence", {"selection": {}, "given": {}})
        with pytest.raises(errors.InvalidArgument, match="at least one lake id"):
            db.enqueue("fence", batch(0, 1, 0))
        nulls = dataclasses.replace(batch(0, 1, 2), message_ids=[uuid.uuid4(), None])  # type: ignore[list-item]
        with pytest.raises(errors.InvalidArgument, match="none of them null"):
            db.enqueue("fence", nulls)
        with pytest.raises(errors.InvalidMessage, match="exchange"):
            db.enqueue("fence", dataclasses.replace(batch(0, 1, 1), exchanges=["x" * 300]))
        state = db.find("fence")
        assert state is not None
        assert (state.position, state.enqueued) == (0, 0)
    assert waiting_count(database_url) == 0
    with pytest.raises(errors.InvalidArgument, match="replay name"):
        replay.check_name("-starts-with-a-dash")
    with pytest.raises(errors.InvalidArgument, match="before --until"):
        replay.Selection(since=day(2), until=day(1)).checked()
    with pytest.raises(errors.InvalidArgument, match="timezone"):
        replay.Selection(since=datetime(2026, 1, 1)).checked()
    with pytest.raises(errors.InvalidArgument, match="before the year 1"):
        when("100000000d")
    assert json.loads(json.dumps(replay.Selection(since=day(1)).document()))["since"]
