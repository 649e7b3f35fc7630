"""`outbox-relay pipeline …`: the Spark data pipeline's commands (pyspark and pydantic load only
when one runs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from types import ModuleType
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


@pipeline.command(name="replay")
@click.option(
    "--since", default=None, metavar="WHEN", help="Published at or after: a time, or 90d ago."
)
@click.option("--until", default=None, metavar="WHEN", help="Published before: the same.")
@click.option("--exchange", default=None, help="Their exchange, exactly.")
@click.option("--routing-key", default=None, metavar="GLOB", help="Their routing key (* and ?).")
@click.option("--key", default=None, metavar="GLOB", help="Their ordering key (* and ?).")
@click.option("--to-exchange", default=None, help="Send them to this exchange instead.")
@click.option("--to-routing-key", default=None, help="Send them with this routing key instead.")
@click.option(
    "--name",
    default=None,
    metavar="NAME",
    help="The replay's name (default: one made from these options): run again, it continues.",
)
@click.option(
    "--rate",
    default=1000.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="At most this many messages a second, so live traffic keeps its share.",
)
@click.option(
    "--batch",
    default=500,
    show_default=True,
    type=click.IntRange(min=1, max=10_000),
    help="Messages per transaction (the relays' batch size suits).",
)
@click.option(
    "--include-replays",
    is_flag=True,
    help="Also take messages that were themselves replays (they carry x-replay).",
)
@click.option(
    "--dry-run", is_flag=True, help="Count what would be replayed, per route; send nothing."
)
@settings_options(*SPARK)
@spark_conf
@fail_cleanly
def replay_command(
    since: str | None,
    until: str | None,
    exchange: str | None,
    routing_key: str | None,
    key: str | None,
    to_exchange: str | None,
    to_routing_key: str | None,
    name: str | None,
    rate: float,
    batch: int,
    include_replays: bool,
    dry_run: bool,
    conf: tuple[str, ...],
    **flags: Any,
) -> None:
    """Put archived messages from the lake back in the outbox, to be sent again.

    Each gets a new message_id (the same each time this replay runs) and the headers x-replay,
    x-replay-of (the original message_id), x-replay-published-at, x-replay-exchange and
    x-replay-routing-key; messages of an ordering key keep the order they were published in.
    Only days the time bounds allow are read. Batches are transactions: run the same command
    again and it continues where it stopped, adding nothing twice. A message the outbox refuses
    today (e.g. over a since-lowered size limit) is skipped and listed."""
    from relay.core import config

    given: dict[str, Any] = {
        "since": since,
        "until": until,
        "exchange": exchange,
        "routing_key": routing_key,
        "key": key,
        "to_exchange": to_exchange,
        "to_routing_key": to_routing_key,
        "include_replays": include_replays,
    }
    settings = config.load_pipeline(**flags)
    jobs = _jobs()
    from relay.console import output
    from relay.pipeline import replay

    now = datetime.now(UTC)
    resolved = {
        "since": None if since is None else when(since, now),
        "until": now if until is None else when(until, now),
    }
    selection = replay.Selection(**{**given, **resolved})
    jobs.replay_lake(
        settings,
        selection,
        name=name,
        given=given,
        rate=rate,
        batch=batch,
        dry_run=dry_run,
        conf=dict(_pair(item) for item in conf),
        say=lambda line: click.echo(line, err=True),
        bar=lambda total: output.progress("replaying", total),
    )


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
    _jobs().run(
        settings,
        phases,
        cutoff=cutoff or datetime.now(UTC),
        since=since,
        conf=spark_settings,
        say=lambda line: click.echo(line, err=True),
    )


def _jobs() -> ModuleType:
    try:
        from relay.pipeline import jobs  # pyspark loads here, and only here
    except ImportError as exc:
        raise errors.ConfigError(
            f"the pipeline needs the spark extra ({exc.name} is missing): "
            "pip install 'outbox-relay[spark]'"
        ) from None
    return jobs


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
