"""The suite's databases (tests/support/databases.py): a database given back after a test that
changed only rows is reset and handed to the next test, equal to a fresh copy of the template;
one whose catalogs changed is dropped; nothing the last test left running can reach it."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

import relay
from tests.support import databases, services


@pytest.fixture
def copies(svc: services.Services, template_db: str) -> Iterator[databases.Copies]:
    made = databases.Copies(svc.database_url, svc.with_database, template_db)
    yield made
    made.close()


def exists(svc: services.Services, name: str) -> bool:
    with psycopg.connect(svc.database_url) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
    return found is not None


def contents(url: str) -> dict[str, object]:
    """Every row of every table of the schema, and where each sequence would go next."""
    found: dict[str, object] = {}
    with psycopg.connect(url) as conn:
        for (table,) in conn.execute(databases.TABLES).fetchall():
            query = sql.SQL("SELECT * FROM {} ORDER BY 1").format(sql.SQL(str(table)))
            found[str(table)] = [
                tuple(v for v in row if not hasattr(v, "tzinfo"))  # applied_at: when migrated
                for row in conn.execute(query).fetchall()
            ]
        for (sequence,) in conn.execute("SELECT sequencename FROM pg_sequences").fetchall():
            found[str(sequence)] = conn.execute(
                "SELECT nextval(%s)", [f"outbox.{sequence}"]
            ).fetchone()
    return found


def test_a_database_whose_rows_changed_is_reset_to_what_a_fresh_copy_holds(
    svc: services.Services, copies: databases.Copies
) -> None:
    fresh = copies.take()
    expected = contents(svc.with_database(fresh))
    copies.drop(fresh)

    used = copies.take()
    with psycopg.connect(svc.with_database(used)) as conn:
        for key in (None, "k", "k"):
            relay.enqueue(conn, "x", "rk", b"{}", ordering_key=key)
        conn.execute("UPDATE outbox.settings SET doorbell = true")
        conn.execute("DELETE FROM outbox.key_policies")
        conn.execute("DELETE FROM outbox.schema_migrations WHERE version = 1")
        conn.execute(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, created_at, reason)"
            " VALUES (gen_random_uuid(), 'x', 'rk', '', '{}', '{}', 1, now(), 'nacked')"
        )
    copies.give_back(used)
    assert (copies.reused, copies.dropped) == (1, 0)

    again = copies.take()
    assert again != used  # renamed: the last test's URL reaches nothing
    assert not exists(svc, used)
    assert contents(svc.with_database(again)) == expected


@pytest.mark.parametrize(
    "change",
    [
        "CREATE TABLE public.business (id int)",
        "ANALYZE outbox.key_policies",  # a table with rows: planner statistics
        "GRANT SELECT ON outbox.messages TO PUBLIC",
        "ALTER DATABASE {db} SET work_mem = '8MB'",
        "COMMENT ON TABLE outbox.messages IS 'changed'",
        "ALTER TABLE outbox.messages SET (fillfactor = 50)",
        "ALTER TABLE outbox.messages DISABLE TRIGGER USER",
        "CREATE OR REPLACE FUNCTION outbox._ring() RETURNS void LANGUAGE sql AS ''",
        "DROP SCHEMA outbox CASCADE",
        "CREATE SEQUENCE public.s",
        "ALTER SEQUENCE outbox.messages_id_seq INCREMENT BY 2",
    ],
)
def test_a_database_whose_catalogs_changed_is_dropped(
    svc: services.Services, copies: databases.Copies, change: str
) -> None:
    used = copies.take()
    with psycopg.connect(svc.with_database(used), autocommit=True) as conn:
        conn.execute(change.format(db=sql.Identifier(used).as_string(conn)))
    copies.give_back(used)
    assert (copies.reused, copies.dropped) == (0, 1)
    assert not exists(svc, used)
    after = copies.take()  # a new copy, made from the template
    with psycopg.connect(svc.with_database(after)) as conn:
        assert conn.execute("SELECT count(*) FROM outbox.schema_migrations").fetchone() != (0,)
        assert conn.execute("SELECT to_regclass('public.business')").fetchone() == (None,)


def test_a_session_the_last_test_left_open_cannot_reach_the_next_one(
    svc: services.Services, copies: databases.Copies
) -> None:
    used = copies.take()
    left = psycopg.connect(svc.with_database(used), autocommit=True)
    left.execute("LISTEN anything")
    copies.give_back(used)
    assert copies.reused == 1
    with pytest.raises(psycopg.OperationalError):
        left.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        psycopg.connect(svc.with_database(used))


def test_closing_drops_every_database_taken_and_not_given_back(
    svc: services.Services, template_db: str
) -> None:
    made = databases.Copies(svc.database_url, svc.with_database, template_db)
    kept, given = made.take(), made.take()
    made.give_back(given)
    spare = made.take()  # `given`, reset under a new name
    made.give_back(made.take())  # a new spare, left for close()
    made.close()
    assert [n for n in (kept, given, spare) if exists(svc, n)] == []
    assert (made.reused, made.dropped) == (2, 0)
