"""The pipeline's SparkSession: local by default, the submitter's under spark-submit, quiet, UTC."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from pyspark.sql import SparkSession

from relay.core import config, errors

LOG_CONFIG = Path(__file__).with_name("log4j2.properties")

#: Every run: UTC everywhere and Parquet timestamps as real timestamps (not INT96); and a task
#: that writes several days keeps a file open per day instead of sorting its rows by day first
#: (an export task's rows come in id order, which is nearly day order; Parquet's memory manager
#: shrinks the open files' row groups if they crowd the heap): docs/decisions/0007.
_SQL = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.maxConcurrentOutputFileWriters": "4",
}
#: Every session the pipeline starts: those, and no console progress bars (it prints a line per
#: phase).
_ALWAYS = {**_SQL, "spark.ui.showConsoleProgress": "false"}


def submitted() -> bool:
    """True when spark-submit started this Python driver (its JVM is already running)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def check(settings: config.PipelineSettings) -> None:
    """Clear errors for what Spark would otherwise report as a Java stack trace."""
    if submitted():
        return  # spark-submit found Java, and its --jars carry the driver
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else None
    if not (java and java.exists()) and shutil.which("java") is None:
        raise errors.ConfigError(
            "the pipeline needs Java 17 or newer: install it (Debian: apt-get install "
            "default-jre-headless) or set JAVA_HOME"
        )
    if not Path(settings.jdbc_jar).is_file():
        raise errors.ConfigError(
            f"no PostgreSQL JDBC driver at {settings.jdbc_jar}: install it (Debian: apt-get "
            "install libpostgresql-jdbc-java) or set OUTBOX_JDBC_JAR"
        )


@contextmanager
def spark_session(
    settings: config.PipelineSettings, conf: Mapping[str, str] | None = None
) -> Iterator[SparkSession]:
    """A session for one pipeline run, stopped on exit. Locally it runs on `spark_master` with
    the JDBC driver on its classpath and Spark's logging cut to errors; under spark-submit the
    submitter's master, jars and logging stand. `conf` adds Spark settings (`--conf`)."""
    check(settings)
    builder = SparkSession.builder.appName("outbox-relay pipeline")
    if not submitted():
        if settings.spark_master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no hostname warnings
        builder = (
            builder.master(settings.spark_master)
            .config("spark.jars", settings.jdbc_jar)
            .config("spark.ui.enabled", "false")
            .config(
                "spark.driver.extraJavaOptions",
                f"-Dlog4j2.configurationFile={LOG_CONFIG.as_uri()} -Duser.timezone=UTC"
                + _collector(),
            )
        )
    for key, value in {**_ALWAYS, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        yield spark
    finally:
        spark.stop()


def _collector() -> str:
    """The throughput collector, which on this machine's own cores spends less CPU than G1 on the
    export's short-lived rows (docs/decisions/0007) — unless the environment chose one (the JVM
    refuses two)."""
    chosen = " ".join(os.environ.get(name, "") for name in ("JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS"))
    return "" if re.search(r"-XX:\+Use\w+GC\b", chosen) else " -XX:+UseParallelGC"


@contextmanager
def borrowed(spark: SparkSession) -> Iterator[SparkSession]:
    """A caller's running session (a notebook's, an application's) for one pipeline run: its SQL
    settings are UTC and real timestamps for the run and restored after it; it is left running."""
    before = {key: spark.conf.get(key, None) for key in _SQL}
    for key, value in _SQL.items():
        spark.conf.set(key, value)
    try:
        yield spark
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def lake_path(settings: config.PipelineSettings) -> str:
    """The lake as Spark should see it: URLs as given; a plain path, when Spark runs on this
    machine, made absolute (elsewhere it is a path on the cluster's default filesystem)."""
    lake = settings.lake.rstrip("/") or "/"
    if urlsplit(lake).scheme or not settings.spark_master.startswith("local") or submitted():
        return lake
    return Path(lake).resolve().as_uri()
