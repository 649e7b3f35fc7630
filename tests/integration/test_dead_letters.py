"""Dead letters and the archive through the Python API: filters, replay, purge and pruning,
against real PostgreSQL (and RabbitMQ where a relay sends the replayed messages)."""

from __future__ import annotations

import asyncio
import fnmatch
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relay
from relay.core import config, errors
from relay.core.filters import DeadFilter
from relay.ops import metrics
from relay.ops.retention import Pruner
from relay.postgres import admin, locks
from tests.support import tier
from tests.support.amqp import Broker
from tests.support.inprocess import enqueue, query, running, settings_for, wait_for_count
from tests.support.wait import until_async


def rows(url: str, sql_text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql_text, args).fetchall()


def bury(url: str, n: int, **fields: Any) -> list[uuid.UUID]:
    """Insert `n` dead rows (as a relay would have left them); their message ids."""
    return insert_dead(url, [fields] * n)


def insert_dead(url: str, dead: list[dict[str, Any]]) -> list[uuid.UUID]:
    """Insert one dead row per dict of column values (defaults for the rest); their ids."""
    ids = [uuid.uuid4() for _ in dead]
    defaults = {
        "exchange": "x",
        "routing_key": "k",
        "reason": "unroutable",
        "ordering_key": None,
        "seq": None,
        "failed_at": datetime.now(UTC),
    }
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers, properties,"
            " ordering_key, seq, attempts, reason, detail, created_at, failed_at)"
            " VALUES (%(id)s, %(exchange)s, %(routing_key)s, %(body)s, '{}', '{}',"
            " %(ordering_key)s, %(seq)s, 3, %(reason)s, 'test', now(), %(failed_at)s)",
            [
                defaults | fields | {"id": i, "body": str(i).encode()}
                for i, fields in zip(ids, dead, strict=True)
            ],
        )
    return ids


@pytest.fixture
def ops(database_url: str) -> Iterator[admin.Admin]:
    with admin.Admin.connect(database_url) as session:
        yield session


# Filters ----------------------------------------------------------------------------------------

# Characters that mean something to a glob, to LIKE, or to neither; few, so that rows collide.
ALPHABET = "a.%_\\*?"
TEXT = st.text(alphabet=ALPHABET, max_size=2)
REASONS = ("unroutable", "rejected", "max_attempts")
NOW = datetime(2026, 11, 21, 12, tzinfo=UTC)
HOURS = st.integers(0, 6)  # a narrow range, so that bounds often fall on a row's time
DEAD_ROW = st.tuples(
    st.sampled_from(REASONS), st.sampled_from(("x", "y")), TEXT, st.none() | TEXT, HOURS
)


@st.composite
def glob_near(draw: st.DrawFn, texts: list[str]) -> str:
    """A glob made from one of `texts` (so that it often matches), each character kept, made a
    wildcard, or changed; or any glob at all."""
    if not texts or draw(st.booleans()):
        return draw(TEXT)
    out = []
    for c in draw(st.sampled_from(texts)):
        out.append(draw(st.sampled_from([c, c, c, "?", "*", draw(st.sampled_from(ALPHABET))])))
    if draw(st.booleans()):
        out.insert(draw(st.integers(0, len(out))), "*")
    return "".join(out)


@st.composite
def dead_and_filter(draw: st.DrawFn) -> tuple[list[Any], dict[str, Any]]:
    dead = draw(st.lists(DEAD_ROW, max_size=10))
    routing_keys = [row[2] for row in dead]
    keys = [row[3] for row in dead if row[3] is not None]
    f = {
        "reasons": draw(st.lists(st.sampled_from(REASONS), max_size=2, unique=True)),
        "exchange": draw(st.none() | st.sampled_from(("x", "y"))),
        "routing_key": draw(st.none() | glob_near(routing_keys)),
        "key": draw(st.none() | glob_near(keys)),
        "since": draw(st.none() | HOURS),
        "until": draw(st.none() | HOURS),
    }
    return dead, f


def expected(row: tuple[str, str, str, str | None, int], f: dict[str, Any]) -> bool:
    """The reference meaning of a filter, in Python: fnmatch for the globs."""
    reason, exchange, routing_key, key, hours_ago = row
    failed_at = NOW - timedelta(hours=hours_ago)
    return (
        (not f["reasons"] or reason in f["reasons"])
        and (f["exchange"] is None or exchange == f["exchange"])
        and (f["routing_key"] is None or fnmatch.fnmatchcase(routing_key, f["routing_key"]))
        and (f["key"] is None or (key is not None and fnmatch.fnmatchcase(key, f["key"])))
        and (f["since"] is None or failed_at >= NOW - timedelta(hours=f["since"]))
        and (f["until"] is None or failed_at < NOW - timedelta(hours=f["until"]))
    )


# Slow (~13 s): 200 Hypothesis examples (20 in the fast tier), each a TRUNCATE, an insert of up to
# 10 dead rows, then list, count and purge on PostgreSQL; the examples are what finds a glob or a
# bound that SQL and fnmatch read differently.
# Slow (~13-16 s): 200 Hypothesis examples, each a table of dead rows and a filter checked
# against a Python model of the globs and bounds; the full tier keeps the full count (the fast
# one draws a tenth).
@settings(
    max_examples=tier.examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=dead_and_filter())
def test_filters_select_exactly_the_rows_their_globs_and_bounds_match(
    ops: admin.Admin, database_url: str, case: tuple[list[Any], dict[str, Any]]
) -> None:
    dead, f = case
    with psycopg.connect(database_url) as conn:
        conn.execute("TRUNCATE outbox.dead")
    ids = insert_dead(
        database_url,
        [
            {
                "reason": reason,
                "exchange": exchange,
                "routing_key": routing_key,
                "ordering_key": key,
                "failed_at": NOW - timedelta(hours=hours_ago),
            }
            for reason, exchange, routing_key, key, hours_ago in dead
        ],
    )
    by_id = dict(zip(ids, dead, strict=True))
    since = None if f["since"] is None else NOW - timedelta(hours=f["since"])
    until = None if f["until"] is None else NOW - timedelta(hours=f["until"])
    if since is not None and until is not None and since >= until:
        with pytest.raises(errors.InvalidArgument, match="--since must be before --until"):
            DeadFilter.build(since=since, until=until)
        return
    where = DeadFilter.build(
        reasons=f["reasons"],
        exchange=f["exchange"],
        routing_key=f["routing_key"],
        key=f["key"],
        since=since,
        until=until,
    )
    want = {m for m, row in by_id.items() if expected(row, f)}
    assert {r.message_id for r in ops.dead_list(where, limit=100)} == want
    assert ops.dead_count(where) == len(want)
    # Purge uses the same filter: exactly those go, the rest stay.
    assert ops.dead_purge(where) == len(want)
    left = {r[0] for r in rows(database_url, "SELECT message_id FROM outbox.dead")}
    assert left == set(by_id) - want


def test_a_filter_by_message_ids_and_a_limit(ops: admin.Admin, database_url: str) -> None:
    ids = bury(database_url, 5)
    where = DeadFilter.build(message_ids=[str(ids[1]), ids[3]])
    assert {r.message_id for r in ops.dead_list(where)} == {ids[1], ids[3]}
    assert len(ops.dead_list(DeadFilter(), limit=2)) == 2
    with pytest.raises(errors.InvalidArgument, match="not a message id"):
        DeadFilter.build(message_ids=["12345"])
    with pytest.raises(errors.InvalidArgument, match="limit"):
        ops.dead_list(DeadFilter(), limit=0)


def test_show_and_stats(ops: admin.Admin, database_url: str) -> None:
    (first,) = bury(database_url, 1, reason="rejected", exchange="a")
    bury(database_url, 3, reason="unroutable", exchange="b")
    shown = ops.dead_get(first)
    assert shown is not None
    assert (shown.reason, shown.exchange, shown.body, shown.headers) == (
        "rejected",
        "a",
        str(first).encode(),
        {},
    )
    assert ops.dead_get(uuid.uuid4()) is None
    groups = [(g.reason, g.exchange, g.count) for g in ops.dead_stats()]
    assert groups == [("unroutable", "b", 3), ("rejected", "a", 1)]


# Replay -----------------------------------------------------------------------------------------


async def test_replay_round_trip_keeps_the_id_and_carries_provenance(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="bound.*")
    settings_ = settings_for(database_url, amqp_url)
    message = dict(exchange=broker.exchange, routing_key="lost", body=b"keep me", headers={"h": 1})
    async with running(settings_):
        (message_id,) = await enqueue(database_url, message)
        await wait_for_count(database_url, "dead", 1)
        where = DeadFilter.build(message_ids=[message_id])

        def replay(**kwargs: Any) -> int:
            with admin.Admin.connect(database_url) as ops:
                return ops.dead_replay(where, **kwargs)

        # Replayed as it was: still nobody listens, so it dies again, remembering one replay.
        assert await asyncio.to_thread(replay) == 1
        await until_dead_again(database_url, replays=1)
        # Replayed to a routing key somebody listens on: delivered, with the count going on.
        before = datetime.now(UTC)
        assert await asyncio.to_thread(replay, to_routing_key="bound.now") == 1
        (got,) = await broker.collect(1, settle=0.3)
        await wait_for_count(database_url, "archive", 1)
    assert (got.message_id, got.routing_key, got.body) == (str(message_id), "bound.now", b"keep me")
    assert got.headers["h"] == 1
    assert got.headers["x-outbox-replays"] == 2
    assert got.headers["x-outbox-replayed-from"] == "unroutable"
    assert got.headers["x-outbox-attempt"] == 1  # attempts start again
    replayed_at = datetime.fromisoformat(got.headers["x-outbox-replayed-at"])
    assert before - timedelta(seconds=5) <= replayed_at <= datetime.now(UTC)
    assert await query(
        database_url, "SELECT message_id, routing_key, replays, replayed_from FROM outbox.archive"
    ) == [(message_id, "bound.now", 2, "unroutable")]
    assert await query(database_url, "SELECT count(*) FROM outbox.dead") == [(0,)]


async def until_dead_again(url: str, replays: int) -> None:
    async def dead() -> bool:
        found = await query(url, "SELECT replays FROM outbox.dead")
        return found == [(replays,)]

    await until_async(dead, message=f"a dead row replayed {replays} times")


def test_interrupted_replay_run_again_moves_each_row_once(
    ops: admin.Admin, database_url: str
) -> None:
    ids = set(bury(database_url, 55))
    where = DeadFilter.build(exchange="x")

    class Interrupted(Exception):
        pass

    def interrupt(_: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        ops.dead_replay(where, batch=10, progress=interrupt)
    assert rows(database_url, "SELECT count(*) FROM outbox.messages") == [(10,)]
    assert rows(database_url, "SELECT count(*) FROM outbox.dead") == [(45,)]
    assert ops.dead_replay(where, batch=10) == 45
    moved = [r[0] for r in rows(database_url, "SELECT message_id FROM outbox.messages")]
    assert sorted(moved) == sorted(ids)
    assert rows(database_url, "SELECT count(*) FROM outbox.dead") == [(0,)]
    assert ops.dead_replay(where) == 0


def test_concurrent_replays_share_the_rows(database_url: str) -> None:
    ids = set(bury(database_url, 400))
    moved: list[int] = []

    def replay() -> None:
        with admin.Admin.connect(database_url) as ops:
            moved.append(ops.dead_replay(DeadFilter.build(reasons=["unroutable"]), batch=7))

    threads = [threading.Thread(target=replay) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(moved) == 400
    got = [r[0] for r in rows(database_url, "SELECT message_id FROM outbox.messages")]
    assert sorted(got) == sorted(ids)


def test_replay_leaves_rows_that_die_meanwhile_and_ids_already_waiting(
    ops: admin.Admin, database_url: str
) -> None:
    ids = bury(database_url, 20)
    with psycopg.connect(database_url) as conn:  # the same message_id is waiting already
        relay.enqueue(conn, "x", "k", b"", message_id=ids[0])
        conn.commit()
    late: list[uuid.UUID] = []

    def meanwhile(_: int) -> None:
        if not late:
            late.extend(bury(database_url, 1))  # dies while the replay runs

    assert ops.dead_replay(DeadFilter.build(exchange="x"), batch=5, progress=meanwhile) == 19
    left = {r[0] for r in rows(database_url, "SELECT message_id FROM outbox.dead")}
    assert left == {ids[0], late[0]}


def test_replay_checks_its_target(ops: admin.Admin, database_url: str) -> None:
    bury(database_url, 1)
    with pytest.raises(errors.InvalidArgument, match="exchange"):
        ops.dead_replay(DeadFilter(), to_exchange="x" * 300)
    with (
        psycopg.connect(database_url) as conn,
        pytest.raises(psycopg.errors.InvalidParameterValue, match="routing_key is 256 bytes"),
    ):
        conn.execute(
            "SELECT outbox.replay_dead(ARRAY(SELECT id FROM outbox.dead), NULL, %s)", ("é" * 128,)
        )
    with pytest.raises(errors.InvalidArgument, match="batch"):
        ops.dead_replay(DeadFilter(), batch=0)
    assert rows(database_url, "SELECT count(*) FROM outbox.dead") == [(1,)]


async def test_a_keyed_message_replayed_goes_back_in_its_place(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="bound")
    settings_ = settings_for(database_url, amqp_url)
    async with running(settings_):
        await enqueue(
            database_url,
            *(
                dict(
                    exchange=broker.exchange,
                    routing_key="bound" if i else "lost",
                    body=str(i).encode(),
                    ordering_key="order-1",
                )
                for i in range(4)
            ),
        )
        await wait_for_count(database_url, "blocked_keys", 1)  # the first died: the key waits

        def replay() -> int:
            with admin.Admin.connect(database_url) as ops:
                return ops.dead_replay(DeadFilter.build(key="order-*"), to_routing_key="bound")

        assert await asyncio.to_thread(replay) == 1
        got = await broker.collect(4, settle=0.3)
    assert [g.body for g in got] == [b"0", b"1", b"2", b"3"]
    assert [g.headers["x-outbox-sequence"] for g in got] == [1, 2, 3, 4]
    assert await query(database_url, "SELECT count(*) FROM outbox.blocked_keys") == [(0,)]


def test_a_replayed_row_behind_a_blocker_goes_once_the_blocker_is_replayed(
    ops: admin.Admin, database_url: str
) -> None:
    # Concurrency 2: seq 1 and 2 both died, 1 blocks the key; 3 and 4 wait in messages.
    (one,) = bury(database_url, 1, ordering_key="k2", seq=1)
    (two,) = bury(database_url, 1, ordering_key="k2", seq=2)
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO outbox.keys VALUES ('k2', 4, 2, '0', NULL)")
        conn.execute(
            "INSERT INTO outbox.blocked_keys (ordering_key, message_id, seq, reason)"
            " VALUES ('k2', %s, 1, 'unroutable')",
            (one,),
        )
        conn.execute(
            "INSERT INTO outbox.messages (message_id, exchange, routing_key, body, ordering_key,"
            " seq, gated) SELECT gen_random_uuid(), 'x', 'k', '', 'k2', i, true"
            " FROM generate_series(3, 4) i"
        )

    def gates() -> list[tuple[Any, ...]]:
        return rows(database_url, "SELECT seq, gated FROM outbox.messages ORDER BY seq")

    assert ops.dead_replay(DeadFilter.build(message_ids=[two])) == 1
    assert gates() == [(2, True), (3, True), (4, True)]  # the key is still blocked
    assert ops.dead_replay(DeadFilter.build(message_ids=[one])) == 1
    assert gates() == [(1, False), (2, False), (3, True), (4, True)]
    assert rows(database_url, "SELECT count(*) FROM outbox.blocked_keys") == [(0,)]


# Purge ------------------------------------------------------------------------------------------


def test_purge_deletes_only_what_it_selects(ops: admin.Admin, database_url: str) -> None:
    bury(database_url, 30, reason="rejected")
    keep = set(bury(database_url, 10, reason="unroutable"))
    batches: list[int] = []
    assert ops.dead_purge(DeadFilter.build(reasons=["rejected"]), batch=8, progress=batches.append)
    assert batches == [8, 8, 8, 6]
    assert {r[0] for r in rows(database_url, "SELECT message_id FROM outbox.dead")} == keep


# The archive ------------------------------------------------------------------------------------


def archive(url: str, n: int, age: timedelta) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, created_at, published_at)"
            " SELECT gen_random_uuid(), 'x', 'k', '', '{}', '{}', 1, now() - %(age)s,"
            " now() - %(age)s FROM generate_series(1, %(n)s)",
            {"n": n, "age": age},
        )


def test_prune_deletes_old_rows_only_in_batches(ops: admin.Admin, database_url: str) -> None:
    archive(database_url, 10_500, timedelta(days=10))
    archive(database_url, 2_000, timedelta(hours=1))
    assert ops.archive_count_older(timedelta(days=7)) == 10_500
    batches: list[int] = []
    assert ops.archive_prune(timedelta(days=7), batch=1000, pause=0, progress=batches.append) == (
        10_500
    )
    assert batches == [1000] * 10 + [500]
    assert rows(
        database_url,
        "SELECT count(*), min(published_at) > now() - interval '1 day' FROM outbox.archive",
    ) == [(2_000, True)]
    stats = ops.archive_stats(exact=True)
    assert stats.exact_rows == 2_000
    assert stats.oldest is not None
    assert stats.newest is not None
    with pytest.raises(errors.InvalidArgument):
        ops.archive_prune(timedelta(0))


#: The session-level lock a pruner of a version before 0.2 took (a rolling upgrade has both).
OLD_PRUNE_LOCK = "SELECT pg_try_advisory_lock(hashtextextended('outbox-relay prune outbox', 0))"


def test_one_pruner_at_a_time(ops: admin.Admin, database_url: str) -> None:
    archive(database_url, 10, timedelta(days=10))
    with locks.exclusive(database_url, "outbox", "prune", wait=False) as held:
        assert held
        assert ops.archive_prune(timedelta(days=1)) is None
        with locks.exclusive(database_url, "outbox", "prune", wait=False) as again:
            assert not again
        assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(10,)]
    assert ops.archive_prune(timedelta(days=1)) == 10


def test_a_lock_outlives_the_servers_idle_in_transaction_timeout(database_url: str) -> None:
    # The lock's transaction sits idle while the work runs elsewhere: a server that ends idle
    # transactions must not end this one (and let a second pruner in).
    name = database_url.rsplit("/", 1)[1]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET idle_in_transaction_session_timeout = 100')
    with locks.exclusive(database_url, "outbox", "prune", wait=False) as held:
        assert held
        time.sleep(0.5)  # five times the server's limit for a transaction left idle
        with locks.exclusive(database_url, "outbox", "prune", wait=False) as again:
            assert not again


def test_a_pruner_whose_lock_is_lost_stops_before_its_next_batch(
    ops: admin.Admin, database_url: str
) -> None:
    # A DBA's script ends sessions idle in a transaction: the lock goes with the holder, and the
    # pruner must not go on beside whichever pruner takes it next.
    archive(database_url, 30, timedelta(days=10))

    def end_the_holder(_: int) -> None:
        with psycopg.connect(database_url, autocommit=True) as dba:
            dba.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'outbox-relay prune lock'"
            )

    with pytest.raises(errors.RelayError, match="lost the prune lock"):
        ops.archive_prune(timedelta(days=1), batch=10, pause=0, progress=end_the_holder)
    assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(20,)]  # one batch
    assert ops.archive_prune(timedelta(days=1)) == 20  # and a new run finishes the job


def test_a_pruner_of_the_previous_version_excludes_this_one_and_back(
    ops: admin.Admin, database_url: str
) -> None:
    archive(database_url, 10, timedelta(days=10))
    with psycopg.connect(database_url, autocommit=True) as old:
        assert old.execute(OLD_PRUNE_LOCK).fetchone() == (True,)
        assert ops.archive_prune(timedelta(days=1)) is None
        old.execute("SELECT pg_advisory_unlock_all()")
        with locks.exclusive(database_url, "outbox", "prune", wait=False) as held:
            assert held
            assert old.execute(OLD_PRUNE_LOCK).fetchone() == (False,)
    assert ops.archive_prune(timedelta(days=1)) == 10


def test_a_stopped_prune_ends_after_its_batch(ops: admin.Admin, database_url: str) -> None:
    archive(database_url, 100, timedelta(days=10))
    stop = threading.Event()
    assert ops.archive_prune(timedelta(days=1), batch=10, progress=lambda _: stop.set(), stop=stop)
    assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(90,)]


# Slow (out of the fast tier): a pruner and producers run side by side for long enough to overlap
# many times.
@pytest.mark.slow
async def test_prune_under_load_keeps_every_new_message(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    archive(database_url, 30_000, timedelta(days=30))
    settings_ = settings_for(database_url, amqp_url, archive_retention=0)
    batches: list[int] = []

    def prune() -> int | None:
        with admin.Admin.connect(database_url) as ops:
            return ops.archive_prune(
                timedelta(days=7), batch=500, pause=0.005, progress=batches.append
            )

    async with running(settings_):
        pruning = asyncio.create_task(asyncio.to_thread(prune))
        sent: list[uuid.UUID] = []
        for _ in range(40):
            sent += await enqueue(
                database_url,
                *(dict(exchange=broker.exchange, routing_key="k", body=b"") for _ in range(25)),
            )
        got = await broker.collect(1000, distinct=True)
        assert await pruning == 30_000
        await wait_for_count(database_url, "archive", 1000)
    assert len(batches) == 60  # it ran while messages flowed, in small transactions
    assert {g.message_id for g in got} == {str(m) for m in sent}
    archived = {r[0] for r in rows(database_url, "SELECT message_id FROM outbox.archive")}
    assert archived == set(sent)


async def test_the_relays_pruner_counts_what_it_did(database_url: str) -> None:
    archive(database_url, 1200, timedelta(days=3))
    archive(database_url, 5, timedelta(minutes=1))
    counters = metrics.Metrics()

    def prune(stop: threading.Event) -> int | None:
        with admin.Admin.connect(database_url) as ops:
            return ops.archive_prune(timedelta(days=1), stop=stop)

    pruner = Pruner(prune, 3600, counters)
    assert await pruner.run_once() == 1200
    with locks.exclusive(database_url, "outbox", "prune", wait=False):
        assert await pruner.run_once() is None

    def broken(stop: threading.Event) -> int | None:
        raise errors.DatabaseUnavailable("PostgreSQL unavailable")

    assert await Pruner(broken, 3600, counters).run_once() is None
    registry = counters.registry
    assert registry.get_sample_value("outbox_archive_pruned_total") == 1200
    for result in ("done", "skipped", "failed"):
        assert registry.get_sample_value("outbox_archive_prune_runs_total", {"result": result}) == 1
    assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(5,)]


def test_retention_settings() -> None:
    assert config.load().archive_retention == 7 * 86400
    assert config.load(archive_retention="0").archive_retention == 0
    with pytest.raises(errors.ConfigError, match="--archive-prune-interval"):
        config.load(archive_prune_interval="0")
