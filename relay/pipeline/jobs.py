"""Pipeline runs: export, report and prune over one Spark session, with a line per phase."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import date, datetime
from pathlib import Path
from typing import Literal

from pyspark.sql import SparkSession

from relay.core import config, render
from relay.pipeline import charts, report, session
from relay.pipeline.database import PipelineDatabase
from relay.pipeline.export import Source, export
from relay.pipeline.prune import prune

Phase = Literal["export", "report", "prune"]
Say = Callable[[str], object]


def run(
    settings: config.PipelineSettings,
    phases: Sequence[Phase],
    *,
    cutoff: datetime,
    since: date | None = None,
    conf: Mapping[str, str] | None = None,
    say: Say = print,
    spark: SparkSession | None = None,
) -> None:
    """Run `phases` in order (export before prune, so a prune never outruns its export), in a
    session of their own or in `spark`, a running one (then `conf` and the master are its own)."""
    started = time.monotonic()
    running = session.spark_session(settings, conf) if spark is None else session.borrowed(spark)
    with running as spark:
        lake = session.lake_path(settings)
        say(f"spark {spark.version} on {spark.sparkContext.master}, lake {lake}")
        with _database(settings, phases) as db:
            if "export" in phases:
                assert db is not None
                source = Source(
                    settings.database_url.get_secret_value(),
                    settings.db_schema,
                    settings.export_partitions,
                    settings.fetch_size,
                    settings.transaction_pooler,
                )
                phase = time.monotonic()
                rows = export(spark, lake, source, db, cutoff, chunk=settings.export_chunk, say=say)
                say(f"export: {render.count(rows, 'row')} in {time.monotonic() - phase:.1f}s")
            if "report" in phases:
                phase = time.monotonic()
                built = report.build(spark, lake, since)
                path = charts.write(built, Path(settings.report_dir), lake)
                say(f"report: {path} in {time.monotonic() - phase:.1f}s")
            if "prune" in phases:
                assert db is not None
                phase = time.monotonic()
                pruned = prune(spark, lake, db, say=say)
                kept = f", {pruned.kept:,} kept" if pruned.kept else ""
                took = time.monotonic() - phase
                say(f"prune: {render.count(pruned.deleted, 'row')} deleted{kept} in {took:.1f}s")
    say(f"done in {time.monotonic() - started:.1f}s")


@contextlib.contextmanager
def _database(
    settings: config.PipelineSettings, phases: Sequence[Phase]
) -> Iterator[PipelineDatabase | None]:
    """The database session (and the pipeline lock) when a phase touches PostgreSQL."""
    if not {"export", "prune"} & set(phases):
        yield None
        return
    url = settings.database_url.get_secret_value()
    with PipelineDatabase.connect(
        url, settings.db_schema, pooled=settings.transaction_pooler
    ) as db:
        yield db
