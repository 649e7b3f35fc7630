"""Ordering keys nobody uses any more are forgotten (OUTBOX_KEY_RETENTION), and only those: not a
key with a message waiting, a blocked key, a key a producer holds right now, or one used lately."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import relay
from relay.core import config, errors
from relay.postgres.store import PgStore


def sql(url: str, text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(text.encode(), args)
        return cur.fetchall() if cur.description else []


def enqueue(url: str, key: str) -> None:
    with psycopg.connect(url) as conn:
        relay.enqueue(conn, "x", "k", b"", ordering_key=key)
        conn.commit()


def keys(url: str) -> set[str]:
    return {str(k) for (k,) in sql(url, "SELECT ordering_key FROM outbox.keys")}


async def test_idle_keys_are_forgotten_and_the_others_kept(database_url: str) -> None:
    for key in ("idle", "waiting", "blocked", "held", "recent", "paced", "died"):
        enqueue(database_url, key)
    sql(database_url, "DELETE FROM outbox.messages WHERE ordering_key <> 'waiting'")  # settled
    sql(  # a message of "died" lies in dead: a replay would need its numbering
        database_url,
        "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers, properties,"
        " ordering_key, seq, attempts, reason, created_at)"
        " VALUES (gen_random_uuid(), 'x', 'k', '', '{}', '{}', 'died', 1, 1, 'unroutable', now())",
    )
    sql(
        database_url,
        "INSERT INTO outbox.blocked_keys (ordering_key, message_id, seq, reason)"
        " VALUES ('blocked', gen_random_uuid(), 1, 'unroutable')",
    )
    sql(
        database_url, "INSERT INTO outbox.key_releases VALUES ('paced', now() - interval '40 days')"
    )
    sql(database_url, "UPDATE outbox.keys SET touched_at = now() - interval '40 days'")
    sql(database_url, "UPDATE outbox.keys SET touched_at = now() WHERE ordering_key = 'recent'")
    store = await PgStore.open(database_url, "outbox", "keys-test")
    try:
        with psycopg.connect(database_url) as producer:
            producer.execute("SELECT 1 FROM outbox.keys WHERE ordering_key = 'held' FOR UPDATE")
            forgotten = await store.forget_idle_keys(30 * 86400)  # a producer holds "held"
        assert forgotten == 2
        assert keys(database_url) == {"waiting", "blocked", "held", "recent", "died"}
        assert sql(database_url, "SELECT count(*) FROM outbox.key_releases") == [(0,)]
        assert await store.forget_idle_keys(30 * 86400) == 1  # "held" now, its producer gone
    finally:
        await store.close()
    enqueue(database_url, "idle")  # used again: numbered from 1 again
    assert sql(database_url, "SELECT seq FROM outbox.messages WHERE ordering_key = 'idle'") == [
        (1,)
    ]


async def test_a_pass_over_many_keys_takes_short_pages(database_url: str) -> None:
    sql(
        database_url,
        "INSERT INTO outbox.keys (ordering_key, last_seq, concurrency, min_interval, touched_at)"
        " SELECT 'k' || i, 1, 1, '0', now() - interval '1 year' FROM generate_series(1, 2500) i",
    )
    store = await PgStore.open(database_url, "outbox", "keys-test")
    try:
        assert await store.forget_idle_keys(86400) == 2500  # three pages of at most 1,000
    finally:
        await store.close()
    assert keys(database_url) == set()
    page = sql(database_url, "SELECT * FROM outbox.forget_idle_keys('1 day', NULL, 10)")
    assert page == [(0, None)]


def test_a_nonsense_retention_is_refused(database_url: str) -> None:
    with (
        psycopg.connect(database_url) as conn,
        pytest.raises(psycopg.errors.InvalidParameterValue, match="an hour or more"),
    ):
        conn.execute("SELECT * FROM outbox.forget_idle_keys('59 minutes', '', 10)")


def test_the_retention_setting_is_off_or_an_hour_or_more() -> None:
    assert config.load(key_retention=0).key_retention == 0
    assert config.load(key_retention="2h").key_retention == 7200
    with pytest.raises(errors.ConfigError, match="--key-retention"):
        config.load(key_retention="10m")
