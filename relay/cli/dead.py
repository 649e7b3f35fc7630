"""`outbox-relay dead …`: list, show, stats, replay and purge dead letters (over Admin)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from relay.cli.base import operator
from relay.console import output
from relay.console.options import (
    DATABASE,
    batch_option,
    fail_cleanly,
    list_json_options,
    settings_options,
)
from relay.core import errors, model, render
from relay.core.filters import DeadFilter

if TYPE_CHECKING:
    from relay.postgres import admin

F = TypeVar("F", bound=Callable[..., Any])

#: How much of a body `dead show` prints unless --full.
BODY_PREVIEW = 2000
#: How many rows a dry run lists.
DRY_RUN_ROWS = 20


def dead_filters(command: F) -> F:
    """The options every dead-letter command selects rows with; all of them must match."""
    options = [
        click.option(
            "--reason",
            "reasons",
            multiple=True,
            type=click.Choice([r.value for r in model.DeadReason]),
            help="Why it died (repeat for several).",
        ),
        click.option("--exchange", default=None, help="Its exchange, exactly."),
        click.option(
            "--routing-key", default=None, metavar="GLOB", help="Its routing key (* and ?)."
        ),
        click.option("--key", default=None, metavar="GLOB", help="Its ordering key (* and ?)."),
        click.option(
            "--since", default=None, metavar="WHEN", help="Died at or after: a time, or 2h, 7d ago."
        ),
        click.option("--until", default=None, metavar="WHEN", help="Died before: the same."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _where(
    ids: Sequence[str] = (),
    *,
    reasons: Sequence[str],
    exchange: str | None,
    routing_key: str | None,
    key: str | None,
    since: str | None,
    until: str | None,
) -> DeadFilter:
    return DeadFilter.build(
        message_ids=ids,
        reasons=reasons,
        exchange=exchange,
        routing_key=routing_key,
        key=key,
        since=since,
        until=until,
    )


def _split(flags: dict[str, Any]) -> dict[str, Any]:
    """Take the filter options out of a command's keyword arguments (the rest are settings)."""
    names = ("reasons", "exchange", "routing_key", "key", "since", "until")
    return {name: flags.pop(name) for name in names}


@click.group()
def dead() -> None:
    """Dead letters: list, show, stats, replay, purge."""


@dead.command(name="list")
@dead_filters
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@list_json_options
@settings_options(*DATABASE)
@fail_cleanly
def dead_list(limit: int, as_json: bool, as_jsonl: bool, **flags: Any) -> None:
    """Dead letters, oldest failure first."""
    where = _where(**_split(flags))
    with operator(flags) as ops:
        rows = ops.dead_list(where, limit)
        more = ops.dead_count(where) - len(rows) if len(rows) == limit else 0
    if as_json or as_jsonl:
        output.records(rows, as_json=as_json, as_jsonl=as_jsonl)
    elif rows:
        _table(rows)
        if more:
            click.echo(f"… and {more:,} more (raise --limit, or narrow the filter)")
    else:
        click.echo("no dead letters match")


@dead.command(name="show")
@click.argument("message_id")
@click.option("--full", is_flag=True, help=f"The whole body (else its first {BODY_PREVIEW:,}).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@settings_options(*DATABASE)
@fail_cleanly
def dead_show(message_id: str, full: bool, as_json: bool, **flags: Any) -> None:
    """One dead letter in full: why it died, its headers, properties and body. MESSAGE_ID may be
    the start of one, as `dead list` shows it (at least 4 hex digits, naming one dead letter)."""
    with operator(flags) as ops:
        (wanted,) = DeadFilter.build(message_ids=_ids(ops, [message_id])).message_ids or ()
        message = ops.dead_get(wanted)
    if message is None:
        raise errors.RelayError(f"no dead letter with message_id {wanted}")
    body = render.body(message.body, None if full else BODY_PREVIEW)
    record = output.record(message) | {"body": dataclasses.asdict(body)}
    if as_json:
        click.echo(json.dumps(record, indent=2, sort_keys=True))
        return
    for name in (
        "message_id",
        "reason",
        "detail",
        "failed_at",
        "created_at",
        "exchange",
        "routing_key",
        "ordering_key",
        "seq",
        "attempts",
        "ambiguous",
        "replays",
        "replayed_at",
        "replayed_from",
    ):
        click.echo(f"{name:<14} {render.printable(output.show(getattr(message, name)))}")
    for name in ("headers", "properties"):
        click.echo(f"{name:<14} {render.printable(json.dumps(record[name], sort_keys=True))}")
    click.echo(f"body           {body.bytes:,} bytes, shown as {body.encoding}")
    click.echo(body.text)
    if body.truncated:
        click.echo(f"… truncated at {BODY_PREVIEW:,} characters: --full shows it all")


@dead.command(name="stats")
@list_json_options
@settings_options(*DATABASE)
@fail_cleanly
def dead_stats(as_json: bool, as_jsonl: bool, **flags: Any) -> None:
    """Dead letters grouped by reason and exchange."""
    with operator(flags) as ops:
        groups = ops.dead_stats()
    if as_json or as_jsonl:
        output.records(groups, as_json=as_json, as_jsonl=as_jsonl)
        return
    if not groups:
        click.echo("no dead letters")
        return
    from rich.table import Table  # rich loads to print, not for help
    from rich.text import Text

    table = Table("reason", "exchange", "count", "first", "last", box=None)
    for g in groups:
        table.add_row(
            g.reason, Text(g.exchange), f"{g.count:,}", output.show(g.first), output.show(g.last)
        )
    table.add_row("[b]total", "", f"[b]{sum(g.count for g in groups):,}", "", "")
    output.console().print(table)


@dead.command(name="replay")
@click.argument("message_ids", nargs=-1)
@dead_filters
@click.option("--all", "everything", is_flag=True, help="Needed to replay every dead letter.")
@click.option("--to-exchange", default=None, help="Send them to this exchange instead.")
@click.option("--to-routing-key", default=None, help="Send them with this routing key instead.")
@click.option("--dry-run", is_flag=True, help="Print what would move, and move nothing.")
@batch_option(500)
@settings_options(*DATABASE)
@fail_cleanly
def dead_replay(
    message_ids: tuple[str, ...],
    everything: bool,
    to_exchange: str | None,
    to_routing_key: str | None,
    dry_run: bool,
    batch: int,
    **flags: Any,
) -> None:
    """Put dead letters (by MESSAGE_IDS, or by filter) back in the outbox to be sent again.

    Each keeps its message_id, starts again at attempt 1, and is sent with x-outbox-replays,
    x-outbox-replayed-at and x-outbox-replayed-from headers. Batches are transactions: if
    interrupted, run the same command again; no message moves twice. A MESSAGE_ID may be the start
    of one, as `dead list` shows it."""
    target = _target(to_exchange, to_routing_key)
    with _chosen(flags, message_ids, "replay", everything, dry_run, target) as chosen:
        if chosen is None:
            return
        with output.progress("replaying", chosen.count) as advance:
            moved = chosen.ops.dead_replay(
                chosen.where,
                to_exchange=to_exchange,
                to_routing_key=to_routing_key,
                batch=batch,
                progress=advance,
            )
    left = chosen.count - moved
    left_in_dead = f"; {left:,} left in dead (already waiting in the outbox)" if left > 0 else ""
    click.echo(f"replayed {render.count(moved, 'dead letter')}{target}{left_in_dead}")


@dead.command(name="purge")
@click.argument("message_ids", nargs=-1)
@dead_filters
@click.option("--all", "everything", is_flag=True, help="Needed to purge every dead letter.")
@click.option("--dry-run", is_flag=True, help="Print what would go, and delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@batch_option(1000)
@settings_options(*DATABASE)
@fail_cleanly
def dead_purge(
    message_ids: tuple[str, ...],
    everything: bool,
    dry_run: bool,
    yes: bool,
    batch: int,
    **flags: Any,
) -> None:
    """Delete dead letters (by MESSAGE_IDS, or by filter) for good. A MESSAGE_ID may be the start
    of one, as `dead list` shows it."""
    with _chosen(flags, message_ids, "purge", everything, dry_run) as chosen:
        if chosen is None:
            return
        question = f"delete {render.count(chosen.count, 'dead letter')} for good?"
        if not yes and not _confirmed(question):
            click.echo("nothing purged")
            return
        with output.progress("purging", chosen.count) as advance:
            purged = chosen.ops.dead_purge(chosen.where, batch=batch, progress=advance)
    click.echo(f"purged {render.count(purged, 'dead letter')}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Chosen:
    """The dead letters a replay or purge acts on, in the operator session that counted them."""

    ops: admin.Admin
    where: DeadFilter
    count: int


@contextlib.contextmanager
def _chosen(
    flags: dict[str, Any],
    message_ids: Sequence[str],
    verb: str,
    everything: bool,
    dry_run: bool,
    target: str = "",
) -> Iterator[_Chosen | None]:
    """An operator session on the dead letters a replay or purge names (by message ids and the
    filters in `flags`), or None when there is nothing to do: none match, or a dry run, which lists
    what it would `verb`."""
    filtering = _split(flags)
    with operator(flags) as ops:
        where = _where(_ids(ops, message_ids), **filtering)
        _needs_all(where, everything, dry_run, verb)
        count = ops.dead_count(where)
        if dry_run or not count:
            _dry_run(ops, where, count, verb, target)
            yield None
        else:
            yield _Chosen(ops, where, count)


def _confirmed(question: str) -> bool:
    """The operator's answer; RelayError when there is no one to ask (no terminal on stdin)."""
    try:
        return click.confirm(question, err=True)
    except click.Abort:
        click.echo(err=True)  # end the question's line: the error gets its own
        raise errors.RelayError(
            "cannot ask for confirmation without a terminal: pass --yes to purge"
        ) from None


#: How much of a message id `dead list` shows: 12 hex digits, unique among millions of dead letters.
SHORT_ID = len("0b8e4c1a-7f3d")


def _ids(ops: admin.Admin, given: Sequence[str]) -> list[str]:
    """Whole message ids as given; each shorter start resolved to the one dead letter it names.
    InvalidArgument when a start names none, or several."""
    whole = []
    for value in given:
        if len(value.strip().replace("-", "")) == 32:
            whole.append(value)  # checked, and matched exactly, by the filter
            continue
        found = ops.dead_ids_starting(value)
        if not found:
            raise errors.InvalidArgument(f"no dead letter's message_id starts with {value!r}")
        if len(found) > 1:
            raise errors.InvalidArgument(
                f"{value!r} starts more than one dead letter's message_id: give more of it"
            )
        whole.append(str(found[0]))
    return whole


def _needs_all(where: DeadFilter, everything: bool, dry_run: bool, verb: str) -> None:
    if where.is_everything and not everything and not dry_run:
        raise errors.InvalidArgument(
            f"{verb} needs message ids, a filter, or --all for every dead letter"
        )


def _dry_run(ops: admin.Admin, where: DeadFilter, count: int, verb: str, target: str) -> None:
    if not count:
        click.echo("no dead letters match")
        return
    click.echo(f"would {verb} {render.count(count, 'dead letter')}{target}:")
    _table(ops.dead_list(where, DRY_RUN_ROWS))
    if count > DRY_RUN_ROWS:
        click.echo(f"… and {count - DRY_RUN_ROWS:,} more")


def _target(exchange: str | None, routing_key: str | None) -> str:
    parts = [f"exchange {exchange!r}"] * (exchange is not None)
    parts += [f"routing key {routing_key!r}"] * (routing_key is not None)
    return f" to {' and '.join(parts)}" if parts else ""


def _table(rows: Sequence[admin.DeadRow]) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(
        "message_id…",
        "failed_at",
        "reason",
        "exchange",
        "routing_key",
        "key/seq",
        "tries",
        "detail",
    )
    for r in rows:
        key = "" if r.ordering_key is None else f"{r.ordering_key}/{r.seq}"
        table.add_row(
            str(r.message_id)[:SHORT_ID],  # every command takes it; --json has the whole
            output.show(r.failed_at),
            r.reason,
            Text(render.printable(r.exchange)),
            Text(render.printable(r.routing_key)),
            Text(render.printable(key)),
            f"{r.attempts}" + (f" (replayed {r.replays})" if r.replays else ""),
            Text(render.printable(r.detail), overflow="ellipsis", no_wrap=True),
        )
    output.console().print(table)
