"""Loads the named statements of queries/*.sql (one file per role that runs them: relay,
producer, migrate, admin, pipeline, console; and the locks they share), bound to one outbox
schema."""

from __future__ import annotations

import dataclasses
import re
from functools import cache
from importlib import resources
from typing import LiteralString, cast

from relay.core import errors, values

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True, slots=True)
class Queries:
    """One field per `-- name:` block in queries/*.sql; the loader fails if the two disagree."""

    claim: LiteralString
    fetch: LiteralString
    extend_leases: LiteralString
    behind: LiteralString
    settle: LiteralString
    forget_idle_keys: LiteralString
    message_stats: LiteralString
    blocked_key_count: LiteralString
    archive_count: LiteralString
    dead_by_reason: LiteralString
    listen: LiteralString
    arm_doorbell: LiteralString
    use_doorbell: LiteralString
    doorbell_session: LiteralString
    no_idle_session_timeout: LiteralString
    doorbell_no_transaction_timeout: LiteralString
    enqueue: LiteralString
    enqueue_many: LiteralString
    create_schema: LiteralString
    create_migrations_table: LiteralString
    applied_migrations: LiteralString
    migrations_recorded: LiteralString
    migration_search_path: LiteralString
    migration_lock_timeout: LiteralString
    record_migration: LiteralString
    revoke_public_execute: LiteralString
    relay_session: LiteralString
    relay_settings: LiteralString
    schema_version: LiteralString
    blocked_keys: LiteralString
    release_key: LiteralString
    key_policies: LiteralString
    set_key_policy: LiteralString
    delete_key_policy: LiteralString
    observe: LiteralString
    table_inserts: LiteralString
    dead_list: LiteralString
    dead_count: LiteralString
    dead_get: LiteralString
    dead_ids_starting: LiteralString
    dead_last_id: LiteralString
    dead_stats: LiteralString
    dead_replay_batch: LiteralString
    dead_purge_batch: LiteralString
    archive_prune_batch: LiteralString
    archive_stats: LiteralString
    archive_exact_count: LiteralString
    archive_count_older: LiteralString
    try_lock: LiteralString
    lock_no_transaction_timeout: LiteralString
    lock_holder: LiteralString
    lock_alive: LiteralString
    export_horizon_archive: LiteralString
    export_horizon_dead: LiteralString
    snapshot_settled: LiteralString
    pipeline_prune_batch: LiteralString
    pipeline_prune_rows: LiteralString
    replay_start: LiteralString
    replay_batch: LiteralString
    replay_skip: LiteralString
    console_read_bound: LiteralString
    console_rights: LiteralString
    console_backlog: LiteralString
    console_rates: LiteralString
    console_relays: LiteralString
    console_horizon: LiteralString
    console_dead_by_reason: LiteralString
    dead_page_head: LiteralString
    dead_page_searched_head: LiteralString
    dead_page_searched_tail: LiteralString
    dead_page_reasons: LiteralString
    dead_page_exchange: LiteralString
    dead_page_routing_key: LiteralString
    dead_page_key: LiteralString
    dead_page_since: LiteralString
    dead_page_until: LiteralString
    dead_page_ids: LiteralString
    dead_page_id_range: LiteralString
    dead_page_before: LiteralString
    dead_page_upto: LiteralString
    dead_page_window_end: LiteralString
    dead_count_head: LiteralString
    dead_window_head: LiteralString
    console_last_dead: LiteralString
    dead_page_tail: LiteralString
    dead_by_id: LiteralString
    message_whereabouts: LiteralString
    gated_keys: LiteralString
    action_start: LiteralString
    action_interrupt_stale: LiteralString
    action_lock_wait: LiteralString
    action_progress: LiteralString
    action_end: LiteralString
    action_get: LiteralString
    action_latest: LiteralString
    action_list: LiteralString


def parse(text: str) -> dict[str, str]:
    """Split a queries file into {name: statement}, without comments or the trailing semicolon."""
    chunks = _HEADER.split(text)
    named = dict(zip(chunks[1::2], chunks[2::2], strict=True))
    return {name: _strip(body) for name, body in named.items()}


def _strip(body: str) -> str:
    lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(lines).strip().removesuffix(";")


def new_channel(schema: str) -> str:
    """The NOTIFY channel enqueue signals (the functions compute the same name in SQL)."""
    return f"{values.check_identifier(schema)}_new"


@cache
def load(schema: str = "outbox") -> Queries:
    """The queries bound to `schema`. ConfigError if the name is unsafe."""
    quoted_schema = f'"{values.check_identifier(schema)}"'
    quoted_channel = f'"{new_channel(schema)}"'
    named: dict[str, str] = {}
    folder = resources.files("relay.postgres").joinpath("queries")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, body in parse(entry.read_text(encoding="utf-8")).items():
            if name in named:
                raise errors.RelayError(f"queries/{entry.name}: {name} is named twice")
            named[name] = body
    expected = {f.name for f in dataclasses.fields(Queries)}
    if set(named) != expected:
        raise errors.RelayError(f"queries/*.sql and sql.Queries disagree: {set(named) ^ expected}")
    bound = {
        name: body.replace("{schema}", quoted_schema).replace("{new_channel}", quoted_channel)
        for name, body in named.items()
    }
    # The one cast in the project: the texts are our own file, and the only parts spliced in are
    # identifiers that check_identifier() admitted (letters, digits, underscores) and that we quote.
    # (mypy treats LiteralString as str and calls the cast redundant; pyright enforces it.)
    return Queries(**{name: cast(LiteralString, body) for name, body in bound.items()})  # type: ignore[redundant-cast]
