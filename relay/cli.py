"""The `outbox-relay` command line: a thin layer over the composition root, migrations and demo."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from relay import __version__, app, config, demo, errors, logs
from relay import migrate as migrations

F = TypeVar("F", bound=Callable[..., Any])

CONNECTION = ("database_url", "amqp_url", "db_schema")
RELAY_KNOBS = (
    "batch_size",
    "poll_interval",
    "lease",
    "confirm_timeout",
    "max_attempts",
    "max_ambiguous",
    "retry_delay",
    "retry_max_delay",
    "shutdown_timeout",
    "startup_timeout",
    "relay_name",
    "log_level",
)


def flag(field: str) -> str:
    """The command-line flag of a setting: OUTBOX_BATCH_SIZE → --batch-size."""
    return "--" + config.env_name(field).removeprefix("OUTBOX_").lower().replace("_", "-")


def settings_options(*fields: str) -> Callable[[F], F]:
    """Add one flag per setting; a flag wins over its environment variable."""

    def decorate(command: F) -> F:
        for field in reversed(fields):
            info = config.Settings.model_fields[field]
            command = click.option(
                flag(field),
                field,
                default=None,
                metavar="VALUE",
                help=f"{info.description} [env: {config.env_name(field)}]",
            )(command)
        return command

    return decorate


def fail_cleanly(command: F) -> F:
    """Expected failures print one line on stderr and exit non-zero: 2 for bad settings, 1 else."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except errors.ConfigError as exc:
            _die(str(exc), 2)
        except errors.RelayError as exc:
            _die(str(exc), 1)
        except KeyboardInterrupt:
            _die("interrupted", 130)

    return wrapper  # type: ignore[return-value]


def _die(message: str, code: int) -> None:
    click.echo(f"outbox-relay: error: {config.redact_secrets(message)}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="outbox-relay")
def main() -> None:
    """Relay committed outbox rows from PostgreSQL to RabbitMQ, with publisher confirms.

    Every setting is an OUTBOX_* environment variable and also a flag; flags win.
    Prefer the environment for URLs with passwords: flags show up in `ps`."""


@main.command()
@settings_options("database_url", "db_schema", "log_level")
@fail_cleanly
def migrate(**flags: Any) -> None:
    """Create or upgrade the outbox schema (idempotent; safe when several run at once)."""
    settings = config.load(**flags)
    logs.configure(settings.log_level)
    result = migrations.migrate(settings.database_url.get_secret_value(), settings.db_schema)
    if result.applied:
        names = ", ".join(m.label for m in result.applied)
        click.echo(f'applied {names}; schema "{settings.db_schema}" is at version {result.version}')
    else:
        click.echo(f'schema "{settings.db_schema}" is up to date (version {result.version})')


@main.command()
@settings_options(*CONNECTION, *RELAY_KNOBS)
@click.option(
    "--until-empty",
    is_flag=True,
    help="Exit once no row is due instead of waiting for more (drain mode).",
)
@fail_cleanly
def run(until_empty: bool, **flags: Any) -> None:
    """Run one relay until SIGINT/SIGTERM, then finish the batch in flight and exit 0."""
    settings = config.load(**flags)
    logs.configure(settings.log_level)
    asyncio.run(app.run(settings, until_empty=until_empty))


@main.command()
@settings_options("database_url", "db_schema")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def stats(as_json: bool, **flags: Any) -> None:
    """Pending, in-flight, archived and dead counts, and the oldest pending message's age."""
    settings = config.load(**flags)
    snapshot = asyncio.run(app.stats(settings))
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(snapshot), sort_keys=True))
        return
    age = snapshot.oldest_pending_age_seconds
    reasons = ", ".join(f"{k} {v}" for k, v in snapshot.dead_by_reason.items())
    rows = [
        ("pending", f"{snapshot.pending}  (due {snapshot.due}, scheduled {snapshot.scheduled})"),
        ("in flight", str(snapshot.in_flight)),
        ("oldest pending", "-" if age is None else f"{age:.1f}s"),
        ("archived", str(snapshot.archived)),
        ("dead", f"{snapshot.dead}" + (f"  ({reasons})" if reasons else "")),
    ]
    for label, value in rows:
        click.echo(f"{label:<15} {value}")


@main.command(name="demo")
@settings_options(*CONNECTION, *RELAY_KNOBS)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many committed messages arrived (default: run until Ctrl-C).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Seconds between sample transactions.",
)
@fail_cleanly
def demo_command(count: int | None, interval: float, **flags: Any) -> None:
    """Migrate, then enqueue sample orders and print them as a consumer receives them."""
    settings = config.load(**flags)
    logs.configure(settings.log_level)
    ok = asyncio.run(demo.run(settings, count=count, interval=interval, echo=click.echo))
    sys.exit(0 if ok else 1)
