"""Prune: delete from PostgreSQL the archive rows proven to be in the lake, batch by batch."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # Spark's own convention

from relay.core import render
from relay.pipeline.database import PipelineDatabase
from relay.pipeline.lake import Manifest, Range, read, table_path

Say = Callable[[str], object]


def message_hash(message_id: Column) -> Column:
    """The first 48 bits of md5 of the message_id's text, as a number: the same figure as the
    SQL of `pipeline_prune_batch` computes on the table's side."""
    return F.conv(F.substring(F.md5(message_id), 1, 12), 16, 10).cast("decimal(20,0)")


@dataclasses.dataclass(frozen=True)
class Pruned:
    deleted: int
    kept: int  # rows in exported ranges the lake does not have: never deleted


def prune(
    spark: SparkSession,
    lake: str,
    db: PipelineDatabase,
    *,
    batch: int = 1000,
    pause: float = 0.05,
    say: Callable[[str], object] = print,
) -> Pruned:
    """Delete the archive rows of every exported, not yet pruned range, `batch` ids per
    transaction, `pause` seconds apart. A batch goes only if the table holds exactly what the
    lake holds for it (count, sum of ids, sum of message_id hashes); otherwise only the rows the
    lake lists (by id and message_id) go, and the rest — rows that appeared after the export —
    stay. A range that was started and never finished (a killed export) is never pruned."""
    manifest = Manifest(spark, lake)
    states = manifest.states()
    ranges = sorted(
        r for r, s in states.items() if r.table == "archive" and "done" in s and "pruned" not in s
    )
    if not ranges:
        say("prune: no exported range is waiting to be pruned")
        return Pruned(0, 0)
    data = read(spark, table_path(lake, "archive"))
    sums = _sums(data, ranges, batch)
    deleted = kept = 0
    for r in ranges:
        started = time.monotonic()
        gone_here = kept_here = 0
        for k in range(r.lo // batch, (r.hi - 1) // batch + 1):
            lo, hi = max(r.lo, k * batch), min(r.hi, (k + 1) * batch)
            there, gone = db.prune_batch(lo, hi, *sums.get((r.name, k), (0, 0, 0)))
            if there and not gone and data is not None:
                gone = _prune_listed(data, db, r, lo, hi)
            gone_here += gone
            kept_here += there - gone
            if gone:
                time.sleep(pause)  # vacuum and the live queue come first
        if not kept_here:
            manifest.mark(r, "pruned", deleted=gone_here)
        deleted += gone_here
        kept += kept_here
        say(
            f"prune archive ids {r.lo + 1:,}–{r.hi:,}: {render.count(gone_here, 'row')} deleted"
            + (f", {kept_here:,} kept (not in the lake)" if kept_here else "")
            + f" in {time.monotonic() - started:.1f}s"
        )
    return Pruned(deleted, kept)


def _sums(
    data: DataFrame | None, ranges: list[Range], batch: int
) -> dict[tuple[str, int], tuple[int, int, int]]:
    """Per (range, batch): the lake's row count, sum of ids and sum of message_id hashes."""
    if data is None:
        return {}
    rows = (
        data.where(F.col("id_range").isin([r.name for r in ranges]))
        .groupBy("id_range", F.floor((F.col("id") - 1) / batch).alias("k"))
        .agg(
            F.count("*").alias("n"),
            F.sum("id").alias("ids"),
            F.sum(message_hash(F.col("message_id"))).alias("hashes"),
        )
        .collect()
    )
    return {(row.id_range, int(row.k)): (int(row.n), int(row.ids), int(row.hashes)) for row in rows}


def _prune_listed(data: DataFrame, db: PipelineDatabase, r: Range, lo: int, hi: int) -> int:
    listed = (
        data.where((F.col("id_range") == r.name) & (F.col("id") > lo) & (F.col("id") <= hi))
        .select("id", "message_id")
        .collect()
    )
    return db.prune_rows([row.id for row in listed], [row.message_id for row in listed])
