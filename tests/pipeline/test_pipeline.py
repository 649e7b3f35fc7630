"""The Spark pipeline against real PostgreSQL and a local Spark: export is idempotent and
resumable, the report agrees with SQL, and prune deletes exactly what the lake holds."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from relay.core import config, errors
from relay.pipeline import charts, jobs, report
from relay.pipeline.database import PipelineDatabase
from relay.pipeline.export import Source, export
from relay.pipeline.lake import Manifest, Range, Table, read, table_path
from relay.pipeline.prune import prune
from tests.pipeline.conftest import LAST_MICROSECOND, fill
from tests.support.processes import clean_env
from tests.support.wait import until


def rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()


def ids_in(url: str, table: str) -> list[int]:
    return [r[0] for r in rows(url, f"SELECT id FROM outbox.{table} ORDER BY id")]


def lake_ids(spark: SparkSession, lake: str, table: Table) -> list[int]:
    data = read(spark, table_path(lake, table))
    return [] if data is None else sorted(r.id for r in data.select("id").collect())


@pytest.fixture
def db(database_url: str) -> Iterator[PipelineDatabase]:
    with PipelineDatabase.connect(database_url, "outbox") as session:
        yield session


def source(url: str) -> Source:
    return Source(url, "outbox", partitions=3, fetch_size=500)


def quiet(_: str) -> None:
    pass


# Slow (~12 s): four exports and five reads of the lake, a dozen small Spark jobs on the session's
# local[2] JVM; the property is about re-runs, so it needs several runs over several ranges.
def test_export_twice_neither_duplicates_nor_loses_a_row(
    spark: SparkSession, database_url: str, db: PipelineDatabase, lake: str
) -> None:
    cutoff = fill(database_url)
    old = [
        r[0]
        for r in rows(
            database_url,
            "SELECT id FROM outbox.archive WHERE published_at < %s ORDER BY id",
            cutoff,
        )
    ]
    dead = ids_in(database_url, "dead")
    assert export(spark, lake, source(database_url), db, cutoff, chunk=1000, say=quiet) == len(
        old
    ) + len(dead)
    assert lake_ids(spark, lake, "archive") == old
    assert lake_ids(spark, lake, "dead") == dead
    # Again: nothing new is older than the cutoff, so nothing is written.
    assert export(spark, lake, source(database_url), db, cutoff, chunk=1000, say=quiet) == 0
    assert lake_ids(spark, lake, "archive") == old
    # A run killed after writing a range but before marking it done: the range is written
    # again, replacing its files, not adding to them.
    (marker,) = Path(lake.removeprefix("file://"), "_exports").glob("archive.1000-2000.done")
    marker.unlink()
    assert export(spark, lake, source(database_url), db, cutoff, chunk=1000, say=quiet) == 1000
    assert lake_ids(spark, lake, "archive") == old
    # Rows that age past a later cutoff go in new ranges.
    later = datetime.now().astimezone()
    everything = ids_in(database_url, "archive")
    export(spark, lake, source(database_url), db, later, chunk=1000, say=quiet)
    assert lake_ids(spark, lake, "archive") == everything


def test_timestamps_are_real_utc_timestamps_and_days_are_utc(
    spark: SparkSession, database_url: str, lake: str
) -> None:
    cutoff = fill(database_url, old=100, young=0, dead=0)
    # In a session of the caller's set to another zone (where the last row's day is the 11th):
    # the run is in UTC all the same, and the caller's setting is given back.
    zone = "spark.sql.session.timeZone"
    spark.conf.set(zone, "Asia/Tokyo")
    try:
        settings = config.load_pipeline(database_url=database_url, lake=lake)
        jobs.run(settings, ["export"], cutoff=cutoff, say=quiet, spark=spark)
        assert spark.conf.get(zone) == "Asia/Tokyo"
    finally:
        spark.conf.set(zone, "UTC")
    folder = Path(lake.removeprefix("file://"), "archive", "day=2026-11-10")
    (file,) = folder.glob("id_range=*/*.parquet")
    schema = pq.read_schema(file)
    for column in ("created_at", "published_at"):
        assert str(schema.field(column).type) == "timestamp[us, tz=UTC]"  # not INT96
    (row,) = pq.read_table(file, columns=["published_at"]).to_pylist()
    assert row["published_at"] == LAST_MICROSECOND


@pytest.fixture(params=["one task", "in parallel"])
def task_size(request: pytest.FixtureRequest, spark: SparkSession) -> Iterator[str]:
    """A lake small enough for one task (this one, at Spark's default), and the same lake read
    and aggregated in parallel, with shuffles (a task's worth of input made 16 kB: several tasks;
    1 kB made one of nearly every kilobyte, most of them empty, and took 8.6 s against 5 s)."""
    key = "spark.sql.files.maxPartitionBytes"
    before = spark.conf.get(key, None)
    if request.param == "in parallel":
        spark.conf.set(key, "16k")
    try:
        yield request.param
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)


# Slow (~10 s a case under load): 3,350 rows filled and exported by the session's Spark, then the
# report built by Spark and each of its figures computed again by SQL; in parallel, 16 kB splits
# give several tasks and shuffles, to show that partial aggregates merged across tasks are SQL's.
def test_report_figures_equal_sql(
    spark: SparkSession,
    database_url: str,
    db: PipelineDatabase,
    lake: str,
    tmp_path: Path,
    task_size: str,
) -> None:
    cutoff = fill(database_url)
    export(
        spark, lake, source(database_url), db, datetime.now().astimezone(), chunk=5000, say=quiet
    )
    archive = report._small(read(spark, table_path(lake, "archive")))
    assert archive is not None
    assert (archive.rdd.getNumPartitions() == 1) == (task_size == "one task")
    built = report.build(spark, lake)
    expected_routes = rows(
        database_url,
        "SELECT exchange, routing_key, count(*),"
        " percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP"
        "   (ORDER BY extract(epoch FROM published_at - created_at)),"
        " max(extract(epoch FROM published_at - created_at))"
        " FROM outbox.archive GROUP BY 1, 2",
    )
    routes = sorted(built.by_route, key=lambda r: (r["exchange"], r["routing_key"]))
    assert len(routes) == len(expected_routes) > 3
    for got, (exchange, routing_key, n, (p50, p95, p99), top) in zip(
        routes, sorted(expected_routes), strict=True
    ):
        assert (got["exchange"], got["routing_key"], got["messages"]) == (exchange, routing_key, n)
        for key, value in (("p50_seconds", p50), ("p95_seconds", p95), ("p99_seconds", p99)):
            assert math.isclose(got[key], float(value), abs_tol=1e-6), (key, got, value)
        assert math.isclose(got["max_seconds"], float(top), abs_tol=1e-6)
    attempts = rows(
        database_url,
        "SELECT exchange, routing_key, attempts, count(*) FROM outbox.archive"
        ' GROUP BY 1, 2, 3 ORDER BY exchange COLLATE "C", routing_key COLLATE "C", 3',
    )
    assert [tuple(r.values()) for r in built.attempts] == attempts
    dead = rows(
        database_url,
        "SELECT reason, count(*), count(DISTINCT exchange) FROM outbox.dead"
        ' GROUP BY 1 ORDER BY 2 DESC, reason COLLATE "C"',
    )
    assert [tuple(r.values()) for r in built.dead_by_reason] == dead
    daily = rows(
        database_url,
        "SELECT to_char(d, 'YYYY-MM-DD'), count(*) FILTER (WHERE t = 'a'),"
        " count(*) FILTER (WHERE t = 'd') FROM ("
        "   SELECT published_at AT TIME ZONE 'UTC' AS d, 'a' AS t FROM outbox.archive"
        "   UNION ALL SELECT failed_at AT TIME ZONE 'UTC', 'd' FROM outbox.dead) AS x"
        " GROUP BY 1 ORDER BY 1",
    )
    assert [(str(r["day"]), r["published"], r["dead"]) for r in built.daily] == daily
    # The same tables are in the lake, and the human report is written with its charts.
    in_lake = spark.read.parquet(f"{lake}/report/daily").agg(F.sum("published")).first()
    assert in_lake is not None
    assert in_lake[0] == sum(d[1] for d in daily)
    page = charts.write(built, tmp_path / "report", lake)
    text = page.read_text()
    assert f"**{sum(d[1] for d in daily):,} messages published, 150 dead-lettered.**" in text
    for png in ("latency.png", "daily.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cutoff  # the data straddled the cutoff; the report covers what was exported


# Slow (~4 s; ~8 s under the parallel run): an export of 3,000 rows through Spark, then a prune of
# what it exported; the gap the export saw must survive the prune.
def test_prune_deletes_exactly_the_exported_rows(
    spark: SparkSession, database_url: str, db: PipelineDatabase, lake: str
) -> None:
    cutoff = fill(database_url)
    # A gap the export will see, filled after it by a row that arrives late.
    rows(database_url, "DELETE FROM outbox.archive WHERE id = 1500 RETURNING id")
    export(spark, lake, source(database_url), db, cutoff, chunk=1000, say=quiet)
    exported = set(lake_ids(spark, lake, "archive"))
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO outbox.archive (id, message_id, exchange, routing_key, body, headers,"
            " properties, attempts, created_at, published_at) OVERRIDING SYSTEM VALUE"
            " VALUES (1500, gen_random_uuid(), 'x', 'late', '', '{}', '{}', 1, now(), now())"
        )
    before = set(ids_in(database_url, "archive"))
    result = prune(spark, lake, db, pause=0, say=quiet)
    after = set(ids_in(database_url, "archive"))
    assert before - after == exported  # every exported row, and nothing else
    assert 1500 in after
    assert (result.deleted, result.kept) == (len(exported), 1)
    assert rows(database_url, "SELECT count(*) FROM outbox.dead") == [(150,)]  # dead stays
    # The range with the late row stays unpruned and keeps it; the others are done.
    again = prune(spark, lake, db, pause=0, say=quiet)
    assert (again.deleted, again.kept) == (0, 1)


# Slow (~18 s): `pipeline export` in a subprocess starts a JVM of its own and is SIGKILLed mid-run,
# then prune and the whole pipeline run on the session's Spark; a kill is only real in a process
# of its own, and the ranges are already the least (1,000 ids).
def test_a_killed_export_leaves_nothing_pruned(
    spark: SparkSession, database_url: str, lake: str, tmp_path: Path
) -> None:
    cutoff = fill(database_url, old=2500)
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_LAKE=lake,
        OUTBOX_SPARK_MASTER="local[2]",
        OUTBOX_EXPORT_CHUNK="1000",
    )
    before = set(ids_in(database_url, "archive"))
    markers = Path(lake.removeprefix("file://"), "_exports")
    stderr = tmp_path / "stderr"
    with stderr.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "pipeline", "export", "--until", cutoff.isoformat()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            start_new_session=True,  # its JVM too
        )
    try:
        second = markers / "archive.1000-2000.started"
        until(second.exists, timeout=60, message="the second range to start")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    names = {p.name for p in markers.iterdir() if p.name.startswith("archive.")}
    started = {n.removesuffix(".started") for n in names if n.endswith(".started")}
    done = {n.removesuffix(".done") for n in names if n.endswith(".done")}
    assert started - done, f"killed after every range was done: {sorted(names)}"
    # The killed run holds the pipeline lock until its backend notices the closed socket.
    killed = (
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'outbox-relay pipeline'"
    )
    until(lambda: not rows(database_url, killed), timeout=30, message="the killed run's session")
    with PipelineDatabase.connect(database_url, "outbox") as db:
        result = prune(spark, lake, db, pause=0, say=quiet)
    after = set(ids_in(database_url, "archive"))
    gone = before - after
    unfinished = [tuple(map(int, n.split(".")[1].split("-"))) for n in started - done]
    assert not any(lo < i <= hi for i in gone for lo, hi in unfinished)
    ranges = [tuple(map(int, n.split(".")[1].split("-"))) for n in done]
    assert result.deleted == len(gone) == sum(hi - lo for lo, hi in ranges)
    # Its output up to the kill (the JVM's start and a whole range's export) is the pipeline's own
    # lines and the JVM's two notices, no log4j lines.
    ours = ("spark 4.", "export archive ids ", "Picked up JAVA_TOOL_OPTIONS:", "WARNING: Using")
    log = stderr.read_text()
    assert any(line.startswith("export archive ids 1–1,000: ") for line in log.splitlines()), log
    assert all(line.startswith(ours) for line in log.splitlines()), log
    # Run the whole pipeline again, as an operator would: the unfinished range is written (once),
    # the report is made, and then everything exported can go.
    lines: list[str] = []
    settings = config.load_pipeline(
        database_url=database_url, lake=lake, export_chunk=1000, report_dir=str(tmp_path / "r")
    )
    jobs.run(settings, ["export", "report", "prune"], cutoff=cutoff, say=lines.append, spark=spark)
    for lo, hi in unfinished:
        assert any(line.startswith(f"export archive ids {lo + 1:,}–{hi:,}: ") for line in lines)
    assert any(line.startswith("prune: ") for line in lines), lines
    assert (tmp_path / "r" / "report.md").exists()
    exported = lake_ids(spark, lake, "archive")
    assert len(exported) == len(set(exported))
    old = {i for i in before if i <= max(exported)}
    assert set(exported) == old
    assert set(ids_in(database_url, "archive")) == before - old


def test_one_pipeline_run_at_a_time(database_url: str) -> None:
    with (
        PipelineDatabase.connect(database_url, "outbox"),
        pytest.raises(errors.RelayError, match="another pipeline run"),
        PipelineDatabase.connect(database_url, "outbox"),
    ):
        pass


def test_the_manifest_lists_what_each_range_reached(spark: SparkSession, lake: str) -> None:
    manifest = Manifest(spark, lake)
    assert manifest.states() == {}
    r = Range("archive", 0, 1000)
    manifest.mark(r, "started")
    manifest.mark(r, "done", rows=990)
    states = manifest.states()
    assert set(states[r]) == {"started", "done"}
    assert states[r]["done"]["rows"] == 990


def test_a_local_driver_gets_the_parallel_collector_unless_the_environment_chose_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from relay.pipeline.session import _collector

    for name in ("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert _collector() == " -XX:+UseParallelGC"
    monkeypatch.setenv("_JAVA_OPTIONS", "-Xmx2g -XX:+UseZGC")
    assert _collector() == ""  # the JVM refuses two collectors
    monkeypatch.setenv("_JAVA_OPTIONS", "-Xmx2g")
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
    assert _collector() == ""
