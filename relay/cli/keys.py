"""`outbox-relay keys …`: blocked ordering keys, releasing them, per-prefix policies, and
forgetting idle keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from relay.cli.base import operator
from relay.console.options import DATABASE, fail_cleanly, list_json_options, settings_options
from relay.core import errors, values

if TYPE_CHECKING:
    from relay.postgres import admin  # psycopg: loaded by base.operator, when a command runs


@click.group()
def keys() -> None:
    """Ordering keys: blocked keys, releasing them, and per-prefix policies."""


@keys.command(name="blocked")
@settings_options(*DATABASE)
@list_json_options
@fail_cleanly
def keys_blocked(as_json: bool, as_jsonl: bool, **flags: Any) -> None:
    """Keys held because one of their messages was dead-lettered (policy 'block')."""
    from relay.console import output

    with operator(flags) as ops:
        blocked = ops.blocked_keys()
    if as_json or as_jsonl:
        output.records(blocked, as_json=as_json, as_jsonl=as_jsonl)
        return
    for key in blocked:
        click.echo(
            f"{key.ordering_key}  seq {key.seq} dead ({key.reason}) since "
            f"{output.show(key.blocked_at)}, {key.waiting} waiting, message_id {key.message_id}"
        )
    if not blocked:
        click.echo("no blocked keys")


@keys.command(name="release")
@click.argument("ordering_key")
@click.option(
    "--replay",
    is_flag=True,
    help="Put the dead message back in its place (sent first) instead of skipping it.",
)
@settings_options(*DATABASE)
@fail_cleanly
def keys_release(ordering_key: str, replay: bool, **flags: Any) -> None:
    """Let a blocked key go on."""
    with operator(flags) as ops:
        if not ops.release_key(ordering_key, replay=replay):
            raise errors.InvalidArgument(f"key {ordering_key!r} is not blocked")
    what = "its dead message goes first" if replay else "skipping its dead message"
    click.echo(f"released {ordering_key!r}: {what}")


@keys.command(name="forget")
@click.option(
    "--idle",
    default="30d",
    show_default=True,
    metavar="DURATION",
    help="Forget keys nobody has used for this long (an hour or more, e.g. 30d, 12h).",
)
@settings_options(*DATABASE)
@fail_cleanly
def keys_forget(idle: str, **flags: Any) -> None:
    """Forget idle ordering keys (no message waiting or dead, no block): a key used again is
    numbered from 1. Run it now and then (deploy/cron has an example); relays never do, since a
    producer of a key being forgotten would wait for it."""
    from datetime import timedelta

    try:
        idle_for = timedelta(seconds=values.parse_duration(idle))
    except ValueError as exc:
        raise errors.InvalidArgument(f"--idle: {exc}") from None
    with operator(flags) as ops:
        forgotten = ops.keys_forget(idle_for)
    click.echo(f"forgot {forgotten:,} ordering keys unused for {idle}")


@keys.group(name="policy")
def keys_policy() -> None:
    """Per-prefix policies: on dead letter block or skip, concurrency, minimum interval."""


@keys_policy.command(name="list")
@settings_options(*DATABASE)
@fail_cleanly
def keys_policy_list(**flags: Any) -> None:
    """Every policy ('' is the default for all keys)."""
    with operator(flags) as ops:
        for policy in ops.policies():
            _echo_policy(policy)


@keys_policy.command(name="set")
@click.argument("prefix")
@click.option(
    "--on-dead",
    type=click.Choice(["block", "skip"]),
    default=None,
    help="When a message of a key is dead-lettered: hold the key, or go on.",
)
@click.option(
    "--concurrency",
    type=int,
    default=None,
    help="How many messages of a key may be in flight at once (1 keeps order).",
)
@click.option(
    "--min-interval",
    default=None,
    metavar="DURATION",
    help="Least time between releases of a key's messages (e.g. 200ms, 1s).",
)
@settings_options(*DATABASE)
@fail_cleanly
def keys_policy_set(
    prefix: str,
    on_dead: admin.OnDead | None,
    concurrency: int | None,
    min_interval: str | None,
    **flags: Any,
) -> None:
    """Create or change the policy of keys starting with PREFIX ('' for the default)."""
    try:
        interval = None if min_interval is None else values.parse_duration(min_interval)
    except ValueError as exc:
        raise errors.InvalidArgument(f"--min-interval: {exc}") from None
    with operator(flags) as ops:
        _echo_policy(
            ops.set_policy(prefix, on_dead=on_dead, concurrency=concurrency, min_interval=interval)
        )


@keys_policy.command(name="delete")
@click.argument("prefix")
@settings_options(*DATABASE)
@fail_cleanly
def keys_policy_delete(prefix: str, **flags: Any) -> None:
    """Remove the policy of PREFIX (keys fall back to a shorter prefix, or the default)."""
    with operator(flags) as ops:
        if not ops.delete_policy(prefix):
            raise errors.InvalidArgument(f"no policy for prefix {prefix!r} (the default stays)")
    click.echo(f"deleted the policy of {prefix!r}")


def _echo_policy(policy: admin.KeyPolicy) -> None:
    click.echo(
        f"{policy.prefix!r:<24} on dead: {policy.on_dead:<5}  concurrency: "
        f"{policy.concurrency:<4}  min interval: {policy.min_interval:g}s"
    )
