"""Export: archive and dead rows up to a cutoff, read over JDBC in parallel, written to the lake
as Parquet partitioned by day (UTC) and by id range, resumably and idempotently."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from datetime import datetime

from pyspark.sql import Observation, SparkSession
from pyspark.sql import functions as F  # Spark's own convention

from relay.core import render
from relay.pipeline import jdbc
from relay.pipeline.database import PipelineDatabase
from relay.pipeline.lake import TABLES, TIME_COLUMN, Manifest, Range, Table, table_path

Say = Callable[[str], object]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where and how to read: the JDBC target, the schema, and the read's parallelism."""

    database_url: str
    schema: str
    partitions: int
    fetch_size: int
    pooled: bool = False  # a transaction pooler on the way (OUTBOX_TRANSACTION_POOLER)


#: Parquet writer settings: no dictionary and no min/max statistics for the columns whose values
#: are all different (message ids, bodies), where both cost CPU and give nothing back — a fifth of
#: the export's CPU in a profile (docs/decisions/0007).
WRITER = {
    f"parquet.{setting}#{column}": "false"
    for setting in ("enable.dictionary", "column.statistics.enabled")
    for column in ("message_id", "body")
}


def plan(done_up_to: int, horizon: int, chunk: int, table: Table) -> list[Range]:
    """The ranges to export after `done_up_to`, up to `horizon`, at most `chunk` ids each."""
    return [Range(table, lo, min(lo + chunk, horizon)) for lo in range(done_up_to, horizon, chunk)]


def export(
    spark: SparkSession,
    lake: str,
    source: Source,
    db: PipelineDatabase,
    cutoff: datetime,
    *,
    chunk: int,
    say: Say = print,
) -> int:
    """Export every row of archive and dead older than `cutoff` not exported yet; rows written.

    A range is marked started before it is written and done after; a range started and never
    done (a run that was killed) is written again first, with the same bounds, and its Parquet
    partitions are replaced, not added to. So re-running never duplicates or skips a row."""
    manifest = Manifest(spark, lake)
    states = manifest.states()
    written = 0
    for table in TABLES:
        ranges = [r for r in states if r.table == table]
        unfinished = sorted(r for r in ranges if "done" not in states[r])
        last = max((r.hi for r in ranges), default=0)
        horizon = db.horizon(table, cutoff)
        todo = unfinished + plan(last, horizon, chunk, table)
        if not todo:
            say(f"export {table}: nothing new before {cutoff:%Y-%m-%d %H:%M:%S}Z")
        for r in todo:
            written += _write(spark, lake, source, manifest, r, say)
    return written


def _write(
    spark: SparkSession, lake: str, source: Source, manifest: Manifest, r: Range, say: Say
) -> int:
    started = time.monotonic()
    manifest.mark(r, "started")
    url, properties = jdbc.target(source.database_url, pooled=source.pooled)
    rows = (
        spark.read.format("jdbc")
        .option("url", url)
        .options(**properties)
        .option("dbtable", f'"{source.schema}".{r.table}')
        .option("partitionColumn", "id")
        .option("lowerBound", str(r.lo + 1))
        .option("upperBound", str(r.hi + 1))
        .option("numPartitions", str(max(1, min(source.partitions, r.hi - r.lo))))
        .option("fetchsize", str(source.fetch_size))
        .load()
        .where((F.col("id") > r.lo) & (F.col("id") <= r.hi))
        .withColumn("day", F.to_date(TIME_COLUMN[r.table]))  # the UTC day: the session is UTC
        .withColumn("id_range", F.lit(r.name))
    )
    written = Observation(f"export {r.name} {uuid.uuid4().hex}")  # unique in a session
    writer = rows.observe(written, F.count(F.lit(1)).alias("rows")).write
    for option, value in WRITER.items():
        writer = writer.option(option, value)
    (
        writer.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")  # replace this range's partitions only
        .partitionBy("day", "id_range")
        .parquet(table_path(lake, r.table))
    )
    count = int(written.get["rows"])
    manifest.mark(r, "done", rows=count)
    say(
        f"export {r.table} ids {r.lo + 1:,}–{r.hi:,}: {render.count(count, 'row')} "
        f"in {time.monotonic() - started:.1f}s"
    )
    return count
