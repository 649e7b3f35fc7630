"""How the commands print: JSON for scripts (one convention for every `--json`), times for people,
progress bars, and a console as wide as the terminal."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click

from relay.console.options import die
from relay.core import errors

if TYPE_CHECKING:
    from rich.console import Console


@contextmanager
def progress(verb: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr when it is a terminal; on interrupt, how far it got."""
    from rich.console import Console  # rich loads when a command prints, not for its help
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    done = 0
    console = Console(stderr=True)
    columns = [TextColumn(verb), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(verb, total=total)

        def advance(n: int) -> None:
            nonlocal done
            done += n
            bar.advance(task, n)

        try:
            yield advance
        except KeyboardInterrupt:
            die(
                f"interrupted after {verb} {done:,} rows; each batch is a transaction, "
                "so running the same command again goes on from there",
                130,
            )


def console() -> Console:
    """Stdout, as wide as the terminal, or wide enough not to fold rows into a pipe."""
    from rich.console import Console

    probe = Console()
    return probe if probe.is_terminal else Console(width=240)


def record(item: Any) -> dict[str, Any]:
    """A dataclass as JSON-ready values, by the one convention of every `--json`
    (docs/guides/operations.md): times in ISO 8601 UTC, ids as text, nothing as null, bytes left
    out."""
    return {k: _json(v) for k, v in dataclasses.asdict(item).items() if not isinstance(v, bytes)}


def records(items: Any, *, as_json: bool, as_jsonl: bool) -> None:
    """A list for scripts: `--json` one array, `--jsonl` one object per line."""
    if as_json and as_jsonl:
        raise errors.InvalidArgument("--json and --jsonl exclude each other")
    if as_json:
        click.echo(json.dumps([record(i) for i in items], indent=2, sort_keys=True))
    else:
        for item in items:
            click.echo(json.dumps(record(item), sort_keys=True))


def document(item: Any) -> None:
    """One thing for scripts (`--json`): one object."""
    click.echo(json.dumps(record(item), indent=2, sort_keys=True))


def _json(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, dict):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    return value if isinstance(value, bool | int | float | str | None) else str(value)


def show(value: Any) -> str:
    """A value for people: times in UTC to the second, nothing as '-'."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="seconds")
    return str(value)


def ago(age: timedelta) -> str:
    return show(datetime.now(UTC) - age)
