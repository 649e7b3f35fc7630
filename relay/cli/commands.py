"""The `outbox-relay` command line: a thin layer over the composition root, migrations and demo.

What a command needs beyond click (the composition root, the drivers, pydantic's settings, rich) it
imports when it runs: help and shell completion load none of it (tests/unit/test_startup.py)."""

from __future__ import annotations

import contextlib
import sys
from datetime import UTC, datetime
from typing import Any

import click

from relay import __version__
from relay.cli import archive as cli_archive
from relay.cli import console as cli_console
from relay.cli import dead as cli_dead
from relay.cli import keys as cli_keys
from relay.console.options import (
    CONNECTION,
    DATABASE,
    RELAY_KNOBS,
    Group,
    fail_cleanly,
    flag,
    interval_option,
    settings_options,
)
from relay.core import errors
from relay.pipeline import commands as pipeline_commands

__all__ = ["CONNECTION", "RELAY_KNOBS", "flag", "main"]


@click.group(
    cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="outbox-relay")
def main() -> None:
    """Relay committed outbox rows from PostgreSQL to RabbitMQ, with publisher confirms.

    Every setting is an OUTBOX_* environment variable and also a flag; flags win.
    Prefer the environment for URLs with passwords: flags show up in `ps`."""


@main.command()
@click.option(
    "--status", "show_status", is_flag=True, help="List each migration: applied or pending."
)
@click.option(
    "--print-sql",
    is_flag=True,
    help="Print the SQL of the pending migrations instead of applying it (for Alembic, Flyway…).",
)
@settings_options(*DATABASE, "log_level")
@fail_cleanly
def migrate(show_status: bool, print_sql: bool, **flags: Any) -> None:
    """Create or upgrade the outbox schema (idempotent; safe when several run at once)."""
    from relay.core import config, logs
    from relay.postgres import migrate as migrations

    settings = config.load(**flags)
    url, pooled = settings.database_url.get_secret_value(), settings.transaction_pooler
    if show_status and print_sql:
        raise errors.InvalidArgument("--status and --print-sql exclude each other")
    if show_status:
        for migration, state in migrations.status(url, settings.db_schema, pooled=pooled):
            click.echo(f"{migration.label:<40} {state}")
        return
    if print_sql:
        click.echo(migrations.script(url, settings.db_schema, pooled=pooled), nl=False)
        return
    logs.configure(settings.log_level, settings.log_format)
    result = migrations.migrate(url, settings.db_schema, pooled=pooled)
    if result.applied:
        names = ", ".join(m.label for m in result.applied)
        click.echo(f'applied {names}; schema "{settings.db_schema}" is at version {result.version}')
    else:
        click.echo(f'schema "{settings.db_schema}" is up to date (version {result.version})')


@main.command()
@settings_options(*DATABASE, "log_level")
@fail_cleanly
def roles(**flags: Any) -> None:
    """Create the schema's producer, relay, operator and viewer roles and grant each only what
    its job needs (idempotent; run as the schema's owner with CREATEROLE, after `migrate`).

    The roles cannot log in: grant them to your users, e.g. GRANT outbox_producer TO app;"""
    from relay.core import config, logs
    from relay.postgres import roles as access

    settings = config.load(**flags)
    logs.configure(settings.log_level, settings.log_format)
    made = access.ensure(settings.database_url.get_secret_value(), settings.db_schema)
    jobs = {
        made.producer: "enqueue only",
        made.relay: "claim, publish, settle, archive, dead-letter",
        made.operator: "dead letters, archive, keys, stats, pipeline",
        made.viewer: "read only: dashboards, the web console's read-only mode",
    }
    for name, job in jobs.items():
        state = "created" if name in made.created else "exists"
        click.echo(f"{name:<24} {state:<8} {job}")
    click.echo(f"grants applied; give them to login roles: GRANT {made.producer} TO <user>;")


@main.command()
@settings_options(*CONNECTION, *RELAY_KNOBS)
@click.option(
    "--until-empty",
    is_flag=True,
    help="Exit once no row is due instead of waiting for more (drain mode); SIGINT/SIGTERM stop "
    "it as they stop a relay that waits.",
)
@fail_cleanly
def run(until_empty: bool, **flags: Any) -> None:
    """Run one relay until SIGINT/SIGTERM, then finish the batch in flight and exit 0."""
    from relay import app
    from relay.core import config, eventloop, logs

    settings = config.load(**flags)
    logs.configure(settings.log_level, settings.log_format)
    eventloop.run(app.run(settings, until_empty=until_empty), settings.event_loop)


@main.command()
@settings_options(*DATABASE)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def stats(as_json: bool, **flags: Any) -> None:
    """Pending, in-flight, archived and dead counts, and the oldest pending message's age."""
    import asyncio

    from relay import app
    from relay.core import config

    settings = config.load(**flags)
    snapshot = asyncio.run(app.stats(settings))
    if as_json:
        from relay.console import output

        output.document(snapshot)
        return
    age = snapshot.oldest_pending_age_seconds
    reasons = ", ".join(f"{k} {v}" for k, v in snapshot.dead_by_reason.items())
    seen = snapshot.observation
    rows = [
        (
            "pending",
            f"{snapshot.pending}  (due {snapshot.due}, scheduled {snapshot.scheduled}, "
            f"gated {snapshot.gated})",
        ),
        ("in flight", str(snapshot.in_flight)),
        ("oldest pending", "-" if age is None else f"{age:.1f}s"),
        ("archived", str(snapshot.archived)),
        ("dead", f"{snapshot.dead}" + (f"  ({reasons})" if reasons else "")),
        ("blocked keys", str(snapshot.blocked_keys)),
    ]
    if seen is not None:
        rows += [
            (
                "dead tuples",
                f"{seen.dead_tuples}  (last autovacuum {_when(seen.last_autovacuum)})"
                + ("" if seen.autovacuum_on else "  AUTOVACUUM OFF"),
            ),
            (
                "vacuum horizon",
                "free"
                if seen.xmin_seconds is None
                else f"held {seen.xmin_seconds:.0f}s by pid {seen.xmin_pid} ({seen.xmin_state})",
            ),
        ]
    for label, value in rows:
        click.echo(f"{label:<15} {value}")


def _when(unix: float | None) -> str:
    return (
        "never" if unix is None else datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds")
    )


@main.command()
@settings_options(*DATABASE)
@interval_option(0.1, "Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option(
    "--svg",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also save the last frame as an SVG picture.",
)
@fail_cleanly
def top(interval: float, once: bool, svg: str | None, **flags: Any) -> None:
    """The outbox live: rates, backlog, the longest wait, dead letters, database health."""
    import asyncio

    from relay.cli import top as live
    from relay.core import config

    settings = config.load(**flags)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(live.run(settings, interval=interval, once=once, svg=svg))


@main.command(name="demo")
@settings_options(*CONNECTION, *RELAY_KNOBS)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many committed messages arrived (default: run until Ctrl-C).",
)
@interval_option(0, "Seconds between sample transactions.")
@fail_cleanly
def demo_command(count: int | None, interval: float, **flags: Any) -> None:
    """Migrate, then enqueue sample orders and print them as a consumer receives them."""
    from relay.cli import demo
    from relay.core import config, eventloop, logs

    settings = config.load(**flags)
    logs.configure(settings.log_level, settings.log_format)
    ok = eventloop.run(
        demo.run(settings, count=count, interval=interval, echo=click.echo), settings.event_loop
    )
    sys.exit(0 if ok else 1)


main.add_command(cli_dead.dead)
main.add_command(cli_archive.archive)
main.add_command(pipeline_commands.pipeline)
main.add_command(cli_keys.keys)
main.add_command(cli_console.console)
