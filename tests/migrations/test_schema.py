"""sql/schema.sql is the schema the migrations leave: a database migrated 0001…N and one loaded
from schema.sql have the same catalog, function bodies, views, triggers, partitions and table
settings included."""

from __future__ import annotations

from typing import Any

import psycopg

from tests.migrations import schema

CATALOG = """
SELECT 'relation', c.relname || ' ' || c.relkind::text || ' ' || c.relispartition
       || ' ' || coalesce(pg_get_expr(c.relpartbound, c.oid), '')
       || ' ' || coalesce(array_to_string(c.reloptions, ','), '')
       || ' ' || coalesce(obj_description(c.oid, 'pg_class'), '')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s
UNION ALL
-- A column's place among its table's columns: a column a migration dropped leaves a gap in the
-- positions that a table created afresh does not have.
SELECT 'column', table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
       || ' ' || coalesce(column_default, '') || ' '
       || rank() OVER (PARTITION BY table_name ORDER BY ordinal_position)
FROM information_schema.columns WHERE table_schema = %(schema)s
UNION ALL
SELECT 'index', indexdef FROM pg_indexes WHERE schemaname = %(schema)s
UNION ALL
SELECT 'function',
       p.oid::regprocedure::text || ' ' || pg_get_function_result(p.oid) || ' '
       || p.provolatile::text || p.prosecdef || ' '
       || coalesce(array_to_string(p.proconfig, ','), '') || ' ' || md5(p.prosrc)
       || ' ' || coalesce(obj_description(p.oid, 'pg_proc'), '')
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %(schema)s
UNION ALL
SELECT 'constraint', conrelid::regclass::text || ' ' || conname || ' '
       || pg_get_constraintdef(c.oid)
FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = %(schema)s
UNION ALL
SELECT 'view', viewname || ' ' || md5(definition) FROM pg_views WHERE schemaname = %(schema)s
UNION ALL
SELECT 'trigger', pg_get_triggerdef(t.oid)
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND NOT t.tgisinternal
UNION ALL
SELECT 'type', t.typname || ' ' || t.typtype::text
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE n.nspname = %(schema)s AND t.typtype <> 'b'::"char" AND t.typrelid = 0
ORDER BY 1, 2
"""


def catalog(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(CATALOG, {"schema": "outbox"}).fetchall()


def test_schema_sql_is_exactly_what_the_migrations_leave(
    database_url: str, empty_database_url: str
) -> None:
    migrated = catalog(database_url)
    assert any(kind == "function" and "_claim" in what for kind, what in migrated)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(schema.SCHEMA_SQL.read_text(encoding="utf-8"))
    loaded = catalog(empty_database_url)
    stale = sorted(set(migrated) ^ set(loaded))
    assert not stale, (
        "sql/schema.sql differs from what the migrations leave (run "
        f"`.venv/bin/python -m tests.migrations.schema`): {stale[:5]}"
    )
    assert loaded == migrated


def test_schema_sql_names_the_newest_migration() -> None:
    from relay.postgres import migrate

    newest = len(migrate.discover())
    assert schema.SCHEMA_SQL.read_text(encoding="utf-8").startswith(schema.header(newest))
