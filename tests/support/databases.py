"""A migrated database for each test, as a fresh copy of the session's template would be, at a
third of a copy's price.

A copy (CREATE DATABASE … TEMPLATE, then DROP … WITH (FORCE)) costs about 0.27 s idle and twice
that while other workers run: half of the fast tier's worker time went there. Most tests change
only rows, so a test's database is given to the next test after a reset instead:

1. every session still connected to it is ended, and the database is renamed, so that nothing
   the last test started (a relay it left running, a connection retrying) can reach it again:
   for them it is gone, as if it had been dropped;
2. every table of every schema the template has is emptied (TRUNCATE … RESTART IDENTITY), the
   rows the migrations left (schema_migrations, settings, key_policies) are copied back in, with
   triggers off, every sequence is set back, and the statistics counters are reset;
3. its catalogs are compared with the template's (`FINGERPRINT`: relations, columns,
   functions, types, triggers, constraints, indexes, privileges, planner statistics, comments,
   extensions, database settings, prepared transactions). Any difference (a test that ran DDL,
   ANALYZE, GRANT, ALTER DATABASE … SET, or left a prepared transaction) and the database is
   dropped; the next test gets a new copy. Only a database equal to a fresh copy is reused.

`tests/migrations/test_reset.py` holds a reset database to a fresh copy, and shows that each
kind of change a test may make is either undone or sends the database to be dropped."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
from psycopg import sql

#: Each part is an md5 over a catalog's rows of objects that are not the system's (their oids
#: start at 16384; `public`, 2200, is the one system object a test may grant on). Volatile
#: columns are left out: pg_class's file node, frozen xids and size estimates (TRUNCATE renews
#: the first and resets the last).
FINGERPRINT = """
SELECT concat_ws(' ',
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM (
     SELECT oid, relname, relnamespace, reltype, relowner, relam, reltoastrelid, relhasindex,
            relisshared, relpersistence, relkind, relnatts, relchecks, relhasrules,
            relhastriggers, relhassubclass, relrowsecurity, relforcerowsecurity, relispopulated,
            relreplident, relispartition, relacl, reloptions
     FROM pg_class WHERE oid >= 16384) t),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text))
   FROM pg_namespace t WHERE oid >= 16384 OR oid = 2200),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_attribute t
   WHERE attrelid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_attrdef t),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_proc t WHERE oid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_type t WHERE oid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_trigger t),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_constraint t
   WHERE oid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_index t
   WHERE indexrelid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_rewrite t WHERE oid >= 16384),
  (SELECT count(*) || '/' || max(objid) || '/' || max(refobjid) FROM pg_depend
   WHERE objid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_description t
   WHERE objoid >= 16384),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_sequence t),
  (SELECT count(*) FROM pg_statistic WHERE starelid >= 16384),
  (SELECT count(*) FROM pg_statistic_ext),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_policy t),
  (SELECT count(*) FROM pg_inherits),
  (SELECT md5(string_agg(t::text, ',' ORDER BY t::text)) FROM pg_extension t),
  (SELECT count(*) FROM pg_event_trigger),
  (SELECT count(*) FROM pg_publication),
  (SELECT count(*) FROM pg_default_acl),
  (SELECT count(*) FROM pg_largeobject_metadata),
  (SELECT md5(string_agg(s.setrole::text || coalesce(s.setconfig::text, ''), ','
                         ORDER BY s.setrole))
   FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase
   WHERE d.datname = current_database()),
  (SELECT concat_ws('/', datacl, datconnlimit, datallowconn, datistemplate)
   FROM pg_database WHERE datname = current_database()),
  (SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()))
"""

#: The tables and sequences of the schemas a test may have filled (not the system's).
TABLES = """
SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_%'
ORDER BY 1
"""
SEQUENCES = """
SELECT format('%I.%I', schemaname, sequencename), start_value, last_value FROM pg_sequences
ORDER BY 1
"""


class Copies:
    """Databases equal to fresh copies of `template`, handed out by `take` and given back by
    `give_back` (reset for the next test, or dropped)."""

    def __init__(self, admin_url: str, url_for: Callable[[str], str], template: str) -> None:
        self._admin_url = admin_url
        self._url_for = url_for
        self._template = template
        self._spare: str | None = None
        self._out: set[str] = set()  # taken and not given back yet: dropped by close()
        self.reused = self.dropped = 0  # databases given back, by what became of them
        with self._connect(template) as conn:
            self._fingerprint = _fingerprint(conn)
            self._tables = [str(t) for (t,) in conn.execute(TABLES)]
            self._sequences = conn.execute(SEQUENCES).fetchall()
            self._seeds: dict[str, bytes] = {}  # the rows the migrations left, by table
            for table in self._tables:
                any_row = sql.SQL("SELECT 1 FROM {} LIMIT 1").format(sql.SQL(table))
                if conn.execute(any_row).fetchone():
                    self._seeds[table] = _rows(conn, table)

    def _connect(self, database: str) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self._url_for(database), autocommit=True)

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self._admin_url, autocommit=True)

    def take(self) -> str:
        """A database equal to a fresh copy of the template, and this test's alone."""
        name, self._spare = self._spare, None
        name = name if name is not None else create(self._admin_url, self._template)
        self._out.add(name)
        return name

    def give_back(self, name: str) -> None:
        """Reset `name` for the next test, under a new name; or drop it if it cannot be."""
        self._out.discard(name)
        if self._spare is not None:  # a second spare: the first is left for close() to drop
            self._out.add(self._spare)
        try:
            self._spare = self._reset(name)
            self.reused += 1
        except (psycopg.Error, _Changed):
            self.drop(name)
            self.dropped += 1

    def drop(self, name: str) -> None:
        self._out.discard(name)
        drop(self._admin_url, name)

    def close(self) -> None:
        """Drop the spare, and every database taken and never given back (a test that took one
        itself): none is left behind (test_reset.py's took 12 a run, and the server kept them)."""
        for name in sorted(self._out):
            self.drop(name)
        if self._spare is not None:
            self.drop(self._spare)
            self._spare = None

    def _reset(self, name: str) -> str:
        renamed = _new_name()
        with self._admin() as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )
            conn.execute(
                sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                    sql.Identifier(name), sql.Identifier(renamed)
                )
            )
        try:
            with self._connect(renamed) as conn:
                self._empty(conn)
                if _fingerprint(conn) != self._fingerprint:
                    raise _Changed(name)
        except BaseException:
            self.drop(renamed)
            raise
        return renamed

    def _empty(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        conn.execute("SET lock_timeout = '5s'")
        with conn.transaction():
            tables = [str(t) for (t,) in conn.execute(TABLES)]
            if tables != self._tables:
                raise _Changed("its tables")
            filled = sql.SQL(" UNION ALL ").join(
                [
                    sql.SQL("(SELECT {} FROM {} LIMIT 1)").format(sql.Literal(t), sql.SQL(t))
                    for t in tables
                ]
            )
            # Only what differs from a fresh copy: an empty table is as it was, and so is one
            # that holds exactly the migrations' rows.
            holding = [str(t) for (t,) in conn.execute(filled).fetchall()]
            changed = [t for t in holding if _rows(conn, t) != self._seeds.get(t)]
            changed += [t for t in self._seeds if t not in holding]  # emptied by the test
            if changed:
                conn.execute(
                    sql.SQL("TRUNCATE {} CASCADE").format(
                        sql.SQL(", ").join([sql.SQL(t) for t in changed])
                    )
                )
            conn.execute("SET LOCAL session_replication_role = replica")  # no triggers
            for table in changed:
                if table in self._seeds:
                    with conn.cursor().copy(
                        sql.SQL("COPY {} FROM STDIN (FORMAT binary)").format(sql.SQL(table))
                    ) as copy:
                        copy.write(self._seeds[table])
            for sequence, start, last in self._sequences:
                if last is None:
                    conn.execute("SELECT setval(%s, %s, false)", [sequence, start])
                else:
                    conn.execute("SELECT setval(%s, %s, true)", [sequence, last])
        conn.execute("SELECT pg_stat_reset()")


def _rows(conn: psycopg.Connection[tuple[object, ...]], table: str) -> bytes:
    """A table's rows as COPY's binary format writes them (in their physical order)."""
    data = bytearray()
    with conn.cursor().copy(
        sql.SQL("COPY {} TO STDOUT (FORMAT binary)").format(sql.SQL(table))
    ) as copy:
        for chunk in copy:
            data += chunk
    return bytes(data)


class _Changed(Exception):
    """A test changed more than rows: its database is dropped, not reused."""


def _fingerprint(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    row = conn.execute(FINGERPRINT).fetchone()
    assert row is not None
    return str(row[0])


def _new_name() -> str:
    return f"outbox_t_{uuid.uuid4().hex[:12]}"


def create(admin_url: str, template: str) -> str:
    """A new database copied from `template`; its name."""
    name = _new_name()
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    return name


def drop(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def each(copies: Copies) -> Iterator[str]:
    """A test's database name, given back after it."""
    name = copies.take()
    try:
        yield name
    finally:
        copies.give_back(name)
