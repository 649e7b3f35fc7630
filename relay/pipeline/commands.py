"""`outbox-relay pipeline …`: the Spark data pipeline's commands (pyspark and pydantic load only
when one runs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any, TypeVar

import click

from relay.console.options import Group, fail_cleanly, settings_options
from relay.core import errors, values
from relay.core.filters import when

F = TypeVar("F", bound=Callable[..., Any])

SPARK = ("database_url", "db_schema", "transaction_pooler", "lake", "spark_master", "jdbc_jar")
EXPORT = ("export_partitions", "export_chunk", "fetch_size")


def spark_conf(command: F) -> F:
    return click.option(
        "--conf",
        "conf",
        multiple=True,
        metavar="KEY=VALUE",
        help="A Spark setting, e.g. spark.driver.memory=4g (repeatable).",
    )(command)


def cutoff_options(command: F) -> F:
    command = click.option(
        "--until",
        default=None,
        metavar="WHEN",
        help="Export rows published (dead: failed) before this time instead.",
    )(command)
    return click.option(
        "--older-than",
        default="7d",
        show_default=True,
        metavar="DURATION",
        help="Export rows published (dead: failed) longer ago than this.",
    )(command)


def since_option(command: F) -> F:
    return click.option(
        "--since",
        default=None,
        metavar="WHEN",
        help="Report on days from this one on (a date, or 30d ago); default: the whole lake.",
    )(command)


@click.group(cls=Group)
def pipeline() -> None:
    """The archive's history on Spark: export to Parquet, report, prune what is exported.

    Runs on this machine by default (local[*]); --spark-master or spark-submit take it to a
    cluster. Needs the spark extra (pip install 'outbox-relay[spark]'), Java 17+ and the
    PostgreSQL JDBC driver."""


@pipeline.command(name="export")
@cutoff_options
@settings_options(*SPARK, *EXPORT)
@spark_conf
@fail_cleanly
def export_command(older_than: str, until: str | None, conf: tuple[str, ...], **flags: Any) -> None:
    """Copy archive and dead rows up to the cutoff into the lake (resumable, idempotent)."""
    _run(("export",), flags, cutoff=_cutoff(older_than, until), conf=conf)


@pipeline.command(name="report")
@since_option
@settings_options(*SPARK, "report_dir")
@spark_conf
@fail_cleanly
def report_command(since: str | None, conf: tuple[str, ...], **flags: Any) -> None:
    """Delivery report from the lake: Parquet tables and a Markdown page with charts."""
    _run(("report",), flags, since=_day(since), conf=conf)


@pipeline.command(name="prune")
@settings_options(*SPARK)
@spark_conf
@fail_cleanly
def prune_command(conf: tuple[str, ...], **flags: Any) -> None:
    """Delete from PostgreSQL the archive rows the lake is proven to hold."""
    _run(("prune",), flags, conf=conf)


@pipeline.command(name="all")
@cutoff_options
@since_option
@settings_options(*SPARK, *EXPORT, "report_dir")
@spark_conf
@fail_cleanly
def all_command(
    older_than: str, until: str | None, since: str | None, conf: tuple[str, ...], **flags: Any
) -> None:
    """Export, then report, then prune, in one Spark session."""
    phases = ("export", "report", "prune")
    _run(phases, flags, cutoff=_cutoff(older_than, until), since=_day(since), conf=conf)


def _run(
    phases: Sequence[Any],
    flags: dict[str, Any],
    *,
    cutoff: datetime | None = None,
    since: date | None = None,
    conf: Sequence[str] = (),
) -> None:
    from relay.core import config

    settings = config.load_pipeline(**flags)
    spark_settings = dict(_pair(item) for item in conf)
    try:
        from relay.pipeline import jobs  # pyspark loads here, and only here
    except ImportError as exc:
        raise errors.ConfigError(
            f"the pipeline needs the spark extra ({exc.name} is missing): "
            "pip install 'outbox-relay[spark]'"
        ) from None
    jobs.run(
        settings,
        phases,
        cutoff=cutoff or datetime.now(UTC),
        since=since,
        conf=spark_settings,
        say=lambda line: click.echo(line, err=True),
    )


def _cutoff(older_than: str, until: str | None) -> datetime:
    if until is not None:
        return when(until)
    try:
        return datetime.now(UTC) - timedelta(seconds=values.parse_duration(older_than))
    except ValueError as exc:
        raise errors.InvalidArgument(f"--older-than: {exc}") from None


def _day(since: str | None) -> date | None:
    return None if since is None else when(since).date()


def _pair(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise errors.InvalidArgument(f"--conf wants KEY=VALUE, not {item!r}")
    return key.strip(), value.strip()
