"""Ordering keys nobody uses any more are forgotten (`outbox-relay keys forget`, an operator's job:
a relay login must hold no lock a producer needs), and only those: not a key with a message
waiting, a blocked key, a key a producer holds right now, or one used lately."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

import relay
from relay.core import errors
from relay.postgres.admin import Admin
from tests.support.processes import assert_one_line_error, clean_env, run_cli


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


def test_idle_keys_are_forgotten_and_the_others_kept(database_url: str) -> None:
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
    with Admin.connect(database_url) as ops:
        with psycopg.connect(database_url) as producer:
            producer.execute("SELECT 1 FROM outbox.keys WHERE ordering_key = 'held' FOR UPDATE")
            forgotten = ops.keys_forget(timedelta(days=30))  # a producer holds "held"
        assert forgotten == 2
        assert keys(database_url) == {"waiting", "blocked", "held", "recent", "died"}
        assert sql(database_url, "SELECT count(*) FROM outbox.key_releases") == [(0,)]
        assert ops.keys_forget(timedelta(days=30)) == 1  # "held" now, its producer gone
    enqueue(database_url, "idle")  # used again: numbered from 1 again
    assert sql(database_url, "SELECT seq FROM outbox.messages WHERE ordering_key = 'idle'") == [
        (1,)
    ]


def test_a_pass_over_many_keys_takes_short_pages(database_url: str) -> None:
    sql(
        database_url,
        "INSERT INTO outbox.keys (ordering_key, last_seq, concurrency, min_interval, touched_at)"
        " SELECT 'k' || i, 1, 1, '0', now() - interval '1 year' FROM generate_series(1, 2500) i",
    )
    with Admin.connect(database_url) as ops:
        assert ops.keys_forget(timedelta(days=1)) == 2500  # three pages of at most 1,000
    assert keys(database_url) == set()
    page = sql(database_url, "SELECT * FROM outbox.forget_idle_keys('1 day', NULL, 10)")
    assert page == [(0, None)]


def test_a_nonsense_retention_is_refused(database_url: str) -> None:
    with (
        psycopg.connect(database_url) as conn,
        pytest.raises(psycopg.errors.InvalidParameterValue, match="an hour or more"),
    ):
        conn.execute("SELECT * FROM outbox.forget_idle_keys('59 minutes', '', 10)")


def test_keys_forget_is_a_command_that_refuses_less_than_an_hour(database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    done = run_cli("keys", "forget", "--idle", "2h", env=env)
    assert done.returncode == 0, done.stderr
    assert "forgot 0 ordering keys" in done.stdout
    refused = run_cli("keys", "forget", "--idle", "10m", env=env)
    assert_one_line_error(refused, 2, "an hour or more")
    with Admin.connect(database_url) as ops, pytest.raises(errors.InvalidArgument):
        ops.keys_forget(timedelta(minutes=59))
