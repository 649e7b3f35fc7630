"""Applies the numbered files of sql/ in order, once each, one migrator at a time per schema."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import psycopg
import psycopg.errors

from relay.core import errors, values
from relay.postgres import locks, pg, roles, sql

_FILE = re.compile(r"(\d{4})_(\w+)\.sql")


@dataclasses.dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    applied: tuple[Migration, ...]
    version: int


def migrations_dir() -> Traversable:
    """The migrations shipped in the wheel (relay/migrations), else the source tree's sql/."""
    packaged = resources.files("relay").joinpath("migrations")
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "sql"


def discover(directory: Traversable | None = None) -> list[Migration]:
    """All migrations in `directory`, by version. MigrationError on a gap or a duplicate number."""
    found = []
    for entry in (directory or migrations_dir()).iterdir():
        match = _FILE.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise errors.MigrationError(
            f"migrations must be numbered 1..n without gaps: {[m.label for m in found]}"
        )
    return found


def migrate(
    conninfo: str,
    schema: str,
    migrations: list[Migration] | None = None,
    *,
    pooled: bool = False,
) -> Result:
    """Bring `schema` up to date and return what was applied. Safe to run twice, or twice at once:
    the second waits for the first and then finds nothing to do. Each file runs in its own
    transaction, recorded with its checksum; an applied file that changed since is refused.
    `pooled`: `conninfo` goes through a transaction-mode pooler (no prepared statements).
    Raises DatabaseUnavailable or MigrationError."""
    values.check_identifier(schema)
    todo = discover() if migrations is None else migrations
    q = sql.load(schema)
    try:
        with (
            locks.exclusive(conninfo, schema, "migrate", wait=True, pooled=pooled) as held,
            psycopg.connect(conninfo, autocommit=True, **pg.options(pooled)) as conn,
        ):
            result = _apply(conn, q, todo, held)
            conn.execute(q.revoke_public_execute)
            if result.version >= len(discover()):  # roles.sql describes the newest schema
                roles.refresh(conn, schema)  # grant new objects to the roles, if set up
            return result
    except psycopg.OperationalError as exc:
        raise errors.DatabaseUnavailable(f"PostgreSQL unavailable: {pg.first_line(exc)}") from exc


def _apply(
    conn: psycopg.Connection[Any], q: sql.Queries, todo: list[Migration], held: locks.Held
) -> Result:
    conn.execute(q.create_schema)
    conn.execute(q.create_migrations_table)
    applied = {int(v): str(c) for v, _, c in conn.execute(q.applied_migrations).fetchall()}
    for migration in todo:
        if migration.version in applied and applied[migration.version] != migration.checksum:
            raise errors.MigrationError(
                f"migration {migration.label} changed after it was applied; "
                "add a new migration instead of editing an old one"
            )
    pending = [m for m in todo if m.version not in applied]
    for migration in pending:
        held.check()  # never two migrates at once, even if this one lost its lock
        _apply_one(conn, q, migration)
    version = max([*applied, *(m.version for m in pending)], default=0)
    return Result(tuple(pending), version)


#: Tries before `migrate` says who holds the lock and fails (run it again later).
LOCK_TRIES = 30


def _apply_one(conn: psycopg.Connection[Any], q: sql.Queries, migration: Migration) -> None:
    for tries in range(1, LOCK_TRIES + 1):
        try:
            _apply_once(conn, q, migration)
            return
        except psycopg.errors.LockNotAvailable as exc:
            if tries == LOCK_TRIES:
                raise errors.MigrationError(
                    f"migration {migration.label} could not take its locks in {LOCK_TRIES} tries "
                    f"({exc.diag.message_primary}): a long transaction holds a table it changes; "
                    "run migrate again once it has ended"
                ) from exc
            time.sleep(min(0.1 * tries, 2.0))


def _apply_once(conn: psycopg.Connection[Any], q: sql.Queries, migration: Migration) -> None:
    try:
        with conn.transaction():
            conn.execute(q.migration_search_path)
            conn.execute(q.migration_lock_timeout)
            # A migration file is several statements of our own, run as one simple query.
            conn.execute(migration.text.encode("utf-8"))
            conn.execute(
                q.record_migration,
                {
                    "version": migration.version,
                    "name": migration.name,
                    "checksum": migration.checksum,
                },
            )
    except (psycopg.OperationalError, psycopg.errors.LockNotAvailable):
        raise
    except psycopg.Error as exc:
        raise errors.MigrationError(
            f"migration {migration.label} failed: {exc.diag.message_primary or exc}"
        ) from exc


def status(conninfo: str, schema: str, *, pooled: bool = False) -> list[tuple[Migration, str]]:
    """Each migration in this release with its state in the database: `applied`, `pending`, or
    `changed` (applied, but the file differs: migrate will refuse). Reads only."""
    values.check_identifier(schema)
    with pg.session(conninfo, schema, "migrate --status", pooled=pooled) as conn:
        applied = _recorded(conn, sql.load(schema), schema)
    return [
        (
            m,
            "pending"
            if m.version not in applied
            else "applied"
            if applied[m.version] == m.checksum
            else "changed",
        )
        for m in discover()
    ]


def script(conninfo: str, schema: str, *, pooled: bool = False) -> str:
    """The SQL `migrate` would run now, for a schema-change tool (Alembic, Flyway, Liquibase) to
    apply instead: each pending migration in a transaction of its own, recorded as `migrate`
    records it, so `migrate` afterwards finds nothing to do. Reads only. MigrationError if an
    applied file changed."""
    values.check_identifier(schema)
    q = sql.load(schema)
    with pg.session(conninfo, schema, "migrate --print-sql", pooled=pooled) as conn:
        applied = _recorded(conn, q, schema)
        ours = discover()
        changed = [m.label for m in ours if applied.get(m.version, m.checksum) != m.checksum]
        if changed:
            raise errors.MigrationError(
                f"migration {changed[0]} changed after it was applied; "
                "add a new migration instead of editing an old one"
            )
        pending = [m for m in ours if m.version not in applied]
        literal = psycopg.ClientCursor(conn)
        parts = [
            f"-- outbox-relay: {len(pending)} pending migration(s) for schema {schema}.",
            "-- Apply as the schema's owner; then run `outbox-relay roles` if you use its roles.",
            f"{q.create_schema};",
            f"{q.create_migrations_table};",
        ]
        for m in pending:
            record = literal.mogrify(
                q.record_migration,
                {"version": m.version, "name": m.name, "checksum": m.checksum},
            )
            parts += [
                f"\n-- {m.label}",
                "BEGIN;",
                f"{q.migration_search_path};",
                m.text.strip(),
                f"{record};",
                "COMMIT;",
            ]
        parts.append(f"\n{q.revoke_public_execute};")
    return "\n".join(parts) + "\n"


def _recorded(conn: psycopg.Connection[Any], q: sql.Queries, schema: str) -> dict[int, str]:
    """Applied versions and their checksums; none before the first migrate."""
    row = conn.execute(q.migrations_recorded, {"table": f'"{schema}".schema_migrations'}).fetchone()
    if row is None or not row[0]:
        return {}
    return {int(v): str(c) for v, _, c in conn.execute(q.applied_migrations).fetchall()}
