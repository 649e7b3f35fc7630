"""Migrations: from empty, twice, at once, tampered with, failing, and under another schema name."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

import relay
from relay.core import errors
from relay.postgres import migrate

ALL = migrate.discover()

CATALOG = """
SELECT 'column', table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
       || ' ' || coalesce(column_default, '')
FROM information_schema.columns WHERE table_schema = %(schema)s
UNION ALL
SELECT 'index', indexdef FROM pg_indexes WHERE schemaname = %(schema)s
UNION ALL
SELECT 'function',
       p.oid::regprocedure::text || ' ' || coalesce(array_to_string(p.proconfig, ','), '')
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(schema)s
UNION ALL
SELECT 'constraint', conname || ' ' || pg_get_constraintdef(c.oid)
FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = %(schema)s
ORDER BY 1, 2
"""


def catalog(url: str, schema: str = "outbox") -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(CATALOG, {"schema": schema}).fetchall()


def test_from_empty_then_again_is_a_no_op(empty_database_url: str) -> None:
    first = migrate.migrate(empty_database_url, "outbox")
    assert [m.label for m in first.applied] == [m.label for m in ALL]
    assert first.version == len(ALL)
    before = catalog(empty_database_url)
    assert any("messages_due_idx" in row[1] for row in before)
    second = migrate.migrate(empty_database_url, "outbox")
    assert (second.applied, second.version) == ((), len(ALL))
    assert catalog(empty_database_url) == before


def test_two_at_once_apply_each_migration_once(empty_database_url: str) -> None:
    results: list[migrate.Result] = []
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def one() -> None:
        start.wait()
        try:
            results.append(migrate.migrate(empty_database_url, "outbox"))
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    assert sorted(len(r.applied) for r in results) == [0, len(ALL)]
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT version FROM outbox.schema_migrations").fetchall()
    assert rows == [(m.version,) for m in ALL]


def test_edited_migration_is_refused(database_url: str) -> None:
    tampered = migrate.discover()
    tampered[0] = migrate.Migration(1, tampered[0].name, tampered[0].text + "\n-- edited\n")
    with pytest.raises(errors.MigrationError, match="0001_tables changed after it was applied"):
        migrate.migrate(database_url, "outbox", tampered)


def test_failing_migration_leaves_nothing_half_applied(database_url: str) -> None:
    broken = [
        *ALL,
        migrate.Migration(len(ALL) + 1, "broken", "CREATE TABLE half_done (id int);\nSELECT 1/0;"),
    ]
    with pytest.raises(errors.MigrationError, match="_broken failed: division by zero"):
        migrate.migrate(database_url, "outbox", broken)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT to_regclass('outbox.half_done')").fetchone() == (None,)
        assert conn.execute("SELECT max(version) FROM outbox.schema_migrations").fetchone() == (
            len(ALL),
        )


def test_gap_in_numbering_is_refused(tmp_path: Any) -> None:
    (tmp_path / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "0003_c.sql").write_text("SELECT 1;")
    with pytest.raises(errors.MigrationError, match="without gaps"):
        migrate.discover(tmp_path)


def test_another_schema_name_works_end_to_end(empty_database_url: str) -> None:
    migrate.migrate(empty_database_url, "Billing_Outbox")
    with (
        psycopg.connect(empty_database_url, autocommit=True) as listener,
        psycopg.connect(empty_database_url) as conn,
    ):
        listener.execute('LISTEN "Billing_Outbox_new"')
        message_id = relay.enqueue(conn, "x", "k", b"", schema="Billing_Outbox")
        conn.commit()
        row = conn.execute(
            'SELECT count(*) FROM "Billing_Outbox".messages WHERE message_id = %s', [message_id]
        ).fetchone()
        assert row == (1,)
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == [
            "Billing_Outbox_new"
        ]
        assert conn.execute("SELECT to_regclass('outbox.messages')").fetchone() == (None,)


@pytest.mark.parametrize("schema", ['outbox"; DROP TABLE x; --', "1abc", "pg_catalog", "a-b", ""])
def test_unsafe_schema_names_are_refused_before_connecting(schema: str) -> None:
    with pytest.raises(errors.ConfigError, match="invalid schema name"):
        migrate.migrate("postgresql://nobody@127.0.0.1:1/none", schema)


def test_enqueue_ignores_the_callers_search_path(database_url: str) -> None:
    # A caller (or attacker) whose search_path puts a look-alike `messages` table first must not
    # redirect enqueue: the functions pin search_path to their own schema.
    with psycopg.connect(database_url) as conn:
        conn.execute("CREATE SCHEMA decoy")
        conn.execute("CREATE TABLE decoy.messages (LIKE outbox.messages INCLUDING ALL)")
        conn.execute("CREATE TABLE decoy.settings (LIKE outbox.settings INCLUDING ALL)")
        conn.execute("SET search_path TO decoy, public")
        conn.execute("SELECT outbox.enqueue('x', 'k', 'b'::bytea)")
        conn.commit()
        assert conn.execute("SELECT count(*) FROM decoy.messages").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM outbox.messages").fetchone() == (1,)
