"""`outbox-relay archive …`: the archive's size and age, and pruning it by hand."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import click

from relay.cli.base import operator
from relay.console import output
from relay.console.options import DATABASE, batch_option, fail_cleanly, settings_options
from relay.core import errors, values


@click.group()
def archive() -> None:
    """The archive of published messages: stats and retention."""


@archive.command(name="stats")
@click.option("--exact", is_flag=True, help="Count rows exactly (reads the whole table).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@settings_options(*DATABASE)
@fail_cleanly
def archive_stats(exact: bool, as_json: bool, **flags: Any) -> None:
    """Rows, size on disk, oldest and newest publish time."""
    with operator(flags) as ops:
        stats = ops.archive_stats(exact=exact)
    if as_json:
        output.document(stats)
        return
    rows = (
        f"{stats.exact_rows:,}"
        if stats.exact_rows is not None
        else f"≈{stats.estimated_rows:,} (PostgreSQL's estimate; --exact counts them)"
    )
    click.echo(f"rows    {rows}")
    click.echo(f"size    {stats.bytes / 2**20:,.1f} MiB")
    click.echo(f"oldest  {output.show(stats.oldest)}")
    click.echo(f"newest  {output.show(stats.newest)}")


@archive.command(name="prune")
@click.option(
    "--older-than",
    required=True,
    metavar="DURATION",
    help="Delete rows published longer ago than this (e.g. 7d, 12h).",
)
@batch_option(1000)
@click.option("--dry-run", is_flag=True, help="Print how many rows would go, and delete nothing.")
@settings_options(*DATABASE)
@fail_cleanly
def archive_prune(older_than: str, batch: int, dry_run: bool, **flags: Any) -> None:
    """Delete old archived rows in small paced batches (safe while relays run)."""
    try:
        age = timedelta(seconds=values.parse_duration(older_than))
    except ValueError as exc:
        raise errors.InvalidArgument(f"--older-than: {exc}") from None
    with operator(flags) as ops:
        if dry_run:
            count = ops.archive_count_older(age)
            click.echo(f"would delete {count:,} archived rows published before {output.ago(age)}")
            return
        with output.progress("pruning", None) as advance:
            deleted = ops.archive_prune(age, batch=batch, progress=advance)
    if deleted is None:
        raise errors.RelayError("another prune is running (a relay or an operator); try later")
    click.echo(f"deleted {deleted:,} archived rows published before {output.ago(age)}")
