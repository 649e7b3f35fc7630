"""How the dead-letter and archive commands print: JSON records (times in ISO 8601 UTC), times for
people, progress bars, and a console as wide as the terminal."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from relay.console.options import die

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
    """A dataclass as JSON-ready values (times in ISO 8601 UTC, ids as text, bytes left out)."""
    return {k: _json(v) for k, v in dataclasses.asdict(item).items() if not isinstance(v, bytes)}


def _json(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    return value if isinstance(value, int | str | dict | list | None) else str(value)


def show(value: Any) -> str:
    """A value for people: times in UTC to the second, nothing as '-'."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="seconds")
    return str(value)


def ago(age: timedelta) -> str:
    return show(datetime.now(UTC) - age)
