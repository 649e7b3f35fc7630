"""Report: delivery figures from the lake — latency percentiles and attempts per route, dead
letters per reason, volume per day — written back to the lake as Parquet."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from datetime import date
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # Spark's own convention
from pyspark.sql import types as T

from relay.pipeline.lake import read, report_path, table_path

#: What the report reads of the lake's tables: columns every version of them had, given rather
#: than inferred (inferring reads a file's footer, in a job of its own per table).
ARCHIVE = T.StructType(
    [
        T.StructField("exchange", T.StringType()),
        T.StructField("routing_key", T.StringType()),
        T.StructField("attempts", T.IntegerType()),
        T.StructField("created_at", T.TimestampType()),
        T.StructField("published_at", T.TimestampType()),
        T.StructField("day", T.DateType()),
    ]
)
DEAD = T.StructType(
    [
        T.StructField("exchange", T.StringType()),
        T.StructField("reason", T.StringType()),
        T.StructField("day", T.DateType()),
    ]
)


def latency() -> Column:
    """Enqueue (created_at, the database's clock) to confirm (published_at: archived right after
    the broker's confirm, the same clock), in seconds."""
    return (F.unix_micros("published_at") - F.unix_micros("created_at")) / 1e6


#: The order of each table's rows: most messages first, then by name (names by code point, as
#: PostgreSQL's "C" collation and Spark order them).
ORDER: dict[str, Callable[[dict[str, Any]], Any]] = {
    "by_route": lambda r: (-r["messages"], r["exchange"], r["routing_key"]),
    "attempts": lambda r: (r["exchange"], r["routing_key"], r["attempts"]),
    "dead_by_reason": lambda r: (-r["messages"], r["reason"]),
    "daily": lambda r: r["day"],
}


@dataclasses.dataclass(frozen=True)
class Report:
    """The report's tables, as rows of plain values (also written to `<lake>/report/<name>`)."""

    by_route: list[dict[str, Any]]
    attempts: list[dict[str, Any]]
    dead_by_reason: list[dict[str, Any]]
    daily: list[dict[str, Any]]
    first_day: str | None
    last_day: str | None


def build(spark: SparkSession, lake: str, since: date | None = None) -> Report:
    """Compute the report over the lake (from `since` on), write its tables, return them.

    Every table is small (a row per route, attempt count, reason or day), so its shuffles run in
    a few partitions, not Spark's default 200 (which cost more than the work on 1,000,000 rows:
    docs/decisions/0007), and the lake's Parquet is read for the columns they use only, with
    the schema given (no footer read to infer it); a lake of one task's input is read as one
    partition, so that they need no shuffle at all (`_small`)."""
    with _shuffle_partitions(spark, max(4, 2 * spark.sparkContext.defaultParallelism)):
        archive = _small(_days(read(spark, table_path(lake, "archive"), schema=ARCHIVE), since))
        if archive is not None:
            archive = archive.select(
                "exchange", "routing_key", "attempts", "day", latency().alias("latency")
            )
        dead = _small(_days(read(spark, table_path(lake, "dead"), schema=DEAD), since))
        # Messages per route, attempt count and day: one scan, a small table, cached for the
        # two tables made from it.
        counts = None
        if archive is not None:
            counts = (
                archive.groupBy("exchange", "routing_key", "attempts", "day")
                .agg(F.count(F.lit(1)).alias("messages"))
                .cache()
            )
        tables = {
            "by_route": _by_route(archive),
            "attempts": _attempts(counts),
            "dead_by_reason": _dead_by_reason(dead),
            "daily": _daily(counts, dead),
        }
        found: dict[str, list[dict[str, Any]]] = {}
        for name, frame in tables.items():
            if frame is None:
                found[name] = []
                continue
            # Collected, then written from the cache; sorted here, as a few rows (a sort in
            # Spark is a sampling job and a shuffle more per table).
            frame = frame.cache()
            found[name] = sorted((row.asDict() for row in frame.collect()), key=ORDER[name])
            frame.write.mode("overwrite").parquet(report_path(lake, name))
            frame.unpersist()
        if counts is not None:
            counts.unpersist()
    days = [str(row["day"]) for row in found["daily"]]  # a date: Spark reads the partition so
    return Report(**found, first_day=min(days, default=None), last_day=max(days, default=None))


@contextlib.contextmanager
def _shuffle_partitions(spark: SparkSession, n: int) -> Iterator[None]:
    key = "spark.sql.shuffle.partitions"
    before = spark.conf.get(key, None)
    spark.conf.set(key, str(n))
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)


def _small(data: DataFrame | None) -> DataFrame | None:
    """`data` in one partition when its files (those of the days read) hold no more than one
    task's worth of input, `spark.sql.files.maxPartitionBytes`: aggregated there, it needs no
    shuffle, whose fixed costs are most of a small report's time on a new JVM (a 1,000,000-row
    lake, about 60 MB: docs/decisions/0007). A bigger lake is read and aggregated in parallel."""
    if data is None:
        return None
    size = data._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()
    task = data.sparkSession._jsparkSession.sessionState().conf().filesMaxPartitionBytes()
    return data.coalesce(1) if int(size) <= int(task) else data


def _days(data: DataFrame | None, since: date | None) -> DataFrame | None:
    if data is None or since is None:
        return data
    return data.where(F.col("day") >= since.isoformat())  # a partition filter: older days unread


def _by_route(archive: DataFrame | None) -> DataFrame | None:
    if archive is None:
        return None
    return (
        archive.groupBy("exchange", "routing_key")
        .agg(
            F.count("*").alias("messages"),
            F.expr("percentile(latency, array(0.5, 0.95, 0.99))").alias("p"),
            F.max("latency").alias("max_seconds"),
        )
        .select(
            "exchange",
            "routing_key",
            "messages",
            F.col("p")[0].alias("p50_seconds"),
            F.col("p")[1].alias("p95_seconds"),
            F.col("p")[2].alias("p99_seconds"),
            "max_seconds",
        )
    )


def _attempts(counts: DataFrame | None) -> DataFrame | None:
    if counts is None:
        return None
    return counts.groupBy("exchange", "routing_key", "attempts").agg(
        F.sum("messages").alias("messages")
    )


def _dead_by_reason(dead: DataFrame | None) -> DataFrame | None:
    if dead is None:
        return None
    return dead.groupBy("reason").agg(
        F.count("*").alias("messages"), F.countDistinct("exchange").alias("exchanges")
    )


def _daily(counts: DataFrame | None, dead: DataFrame | None) -> DataFrame | None:
    parts = []
    if counts is not None:
        parts.append(counts.groupBy("day").agg(F.sum("messages").alias("published")))
    if dead is not None:
        parts.append(dead.groupBy("day").agg(F.count("*").alias("dead")))
    if not parts:
        return None
    daily = parts[0]
    for part in parts[1:]:
        daily = daily.join(part, "day", "full_outer")
    for name in ("published", "dead"):
        value = F.coalesce(F.col(name), F.lit(0)) if name in daily.columns else F.lit(0)
        daily = daily.withColumn(name, value)
    return daily.select("day", "published", "dead")
