"""What every `outbox-relay` command shares: settings as flags, `--batch` and `--interval`
options, one-line errors with their exit codes, and a command group whose usage errors are one
line too. The flags are read off settings.json (console.settings), not the models: help and
completion start without pydantic."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
from click.exceptions import NoArgsIsHelpError

from relay.console import settings
from relay.core import errors, values

F = TypeVar("F", bound=Callable[..., Any])

CONNECTION = ("database_url", "amqp_url", "db_schema")
#: What every command that works on the database alone takes.
DATABASE = ("database_url", "db_schema", "transaction_pooler")
#: Every other setting of the relay, in the order Settings defines them: a new field is a new flag.
RELAY_KNOBS = tuple(f for f in settings.fields("Settings") if f not in CONNECTION)


def flag(field: str) -> str:
    """The command-line flag of a setting: OUTBOX_BATCH_SIZE → --batch-size."""
    return settings.setting(field).flag


def settings_options(*fields: str) -> Callable[[F], F]:
    """Add one flag per setting; a flag wins over its environment variable."""

    def decorate(command: F) -> F:
        for field in reversed(fields):
            told = settings.setting(field)
            command = click.option(
                told.flag, field, default=None, metavar=told.metavar, help=told.help
            )(command)
        return command

    return decorate


def list_json_options(command: F) -> F:
    """`--json` (one array) and `--jsonl` (one object per line) for a command that lists."""
    command = click.option(
        "--jsonl", "as_jsonl", is_flag=True, help="Print one JSON object per line."
    )(command)
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON array.")(command)


def batch_option(default: int) -> Callable[[F], F]:
    """`--batch N`: rows per transaction of a command that moves or deletes many (1–100,000)."""
    return click.option(
        "--batch",
        type=click.IntRange(1, 100_000),
        default=default,
        show_default=True,
        help="Rows per transaction.",
    )


def interval_option(least: float, help: str) -> Callable[[F], F]:
    """`--interval SECONDS`: the pause between a command's rounds (default 1, at least `least`)."""
    return click.option(
        "--interval",
        type=click.FloatRange(min=least),
        default=1.0,
        show_default=True,
        help=help,
    )


def fail_cleanly(command: F) -> F:
    """Expected failures print one line on stderr and exit non-zero: 2 for bad settings, 1 else."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (errors.ConfigError, errors.InvalidArgument) as exc:
            die(str(exc), 2)
        except errors.RelayError as exc:
            die(str(exc), 1)
        except KeyboardInterrupt:
            die("interrupted", 130)

    return wrapper  # type: ignore[return-value]


def die(message: str, code: int) -> NoReturn:
    click.echo(f"outbox-relay: error: {values.redact_secrets(message)}", err=True)
    sys.exit(code)


class Group(click.Group):
    """A command group whose usage errors (bad option, bad value) are one line too."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        for name, closest in settings.unknown_variables(os.environ):
            hint = f" (did you mean {closest}?)" if closest else ""
            click.echo(f"outbox-relay: warning: {name} is not a setting: ignored{hint}", err=True)
        for name in sorted(settings.RETIRED.keys() & os.environ.keys()):
            why = settings.RETIRED[name]
            click.echo(f"outbox-relay: warning: {name} is no longer a setting: {why}", err=True)
        try:
            result = super().main(*args, **kwargs)
        except NoArgsIsHelpError as exc:  # a bare group: its help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            die(exc.format_message().replace("\n", " "), exc.exit_code)
        except click.Abort:
            die("aborted", 1)
        except click.ClickException as exc:
            die(exc.format_message(), exc.exit_code)
        sys.exit(result if isinstance(result, int) else 0)
