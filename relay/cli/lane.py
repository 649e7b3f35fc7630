"""`outbox-relay lane …`: the ready lane's switch, and draining the lane before a downgrade."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from relay.cli.base import operator
from relay.console.options import DATABASE, fail_cleanly, settings_options
from relay.core import errors

if TYPE_CHECKING:
    from relay.postgres import admin  # psycopg: loaded by base.operator, when a command runs

#: How often `lane off` looks again while it waits (seconds), and says where it is.
LOOK_EVERY = 1.0
SAY_EVERY = 10.0


@click.group()
def lane() -> None:
    """The ready lane (unkeyed, due-now messages, stored append-only): on, off, status."""


@lane.command(name="status")
@settings_options(*DATABASE)
@fail_cleanly
def lane_status(**flags: Any) -> None:
    """Whether producers use the ready lane, and how many of its messages still wait."""
    with operator(flags) as ops:
        _say(ops.lane_state())


@lane.command(name="on")
@settings_options(*DATABASE)
@fail_cleanly
def lane_on(**flags: Any) -> None:
    """Producers use the ready lane again (only while relays of this version run: they alone
    read it; relays of this version also turn it on when they start, unless it was turned off
    with `lane off`)."""
    with operator(flags) as ops:
        _say(ops.set_fast_lane(True))


@lane.command(name="off")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Give up after this many seconds (exit 1; the lane stays off). Default: wait.",
)
@settings_options(*DATABASE)
@fail_cleanly
def lane_off(timeout: float | None, **flags: Any) -> None:
    """Turn the ready lane off and wait until it is empty: then relays of a release before
    0015, which do not read it, may replace these. Relays of this version must keep running
    meanwhile (they drain it), and do not turn it on again when they start. Run it as the
    schema's owner granted pg_read_all_stats (it must see every session's transactions), or as
    a superuser."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with operator(flags) as ops:
        state = ops.set_fast_lane(False)
        since = state.checked_at  # a transaction begun before this may have read "on"
        click.echo(f"ready lane off at {since:%Y-%m-%d %H:%M:%S%z}: producers write to messages")
        said = time.monotonic()
        while True:
            open_before, unseen = ops.transactions_since(since)
            if unseen:
                raise errors.InvalidArgument(
                    f"cannot see the transactions of {unseen} session(s), one of which may still "
                    "write to the lane (another role's: run `lane off` again as a superuser or a "
                    "role granted pg_read_all_stats; or one with track_activities off); the lane "
                    "stays off meanwhile"
                )
            state = ops.lane_state()
            if not open_before and not state.waiting:
                click.echo("the ready lane is empty: relays before 0015 may replace these now")
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.RelayError(_waiting(open_before, state) + "; gave up (--timeout)")
            if time.monotonic() - said >= SAY_EVERY:
                click.echo(_waiting(open_before, state))
                said = time.monotonic()
            time.sleep(LOOK_EVERY)


def _waiting(open_before: int, state: admin.LaneState) -> str:
    return (
        f"waiting: {open_before} transaction(s) open since the switch, "
        f"{state.waiting} message(s) in the lane"
    )


def _say(state: admin.LaneState) -> None:
    switch = "on" if state.fast_lane else "off"
    held = " (turned off: relays do not turn it on)" if state.fast_lane_off else ""
    click.echo(f"ready lane {switch}{held}; {state.waiting} message(s) waiting in it")
