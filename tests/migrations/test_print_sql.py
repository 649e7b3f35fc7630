"""`migrate --status` and `--print-sql`: for teams whose schema changes go through Alembic,
Flyway or Liquibase, the SQL `migrate` would run, applied by psql, leaves exactly what `migrate`
leaves, and `migrate` afterwards has nothing to do."""

from __future__ import annotations

import subprocess

import pytest

from relay.postgres import migrate
from tests.migrations.test_schema import catalog
from tests.support.processes import assert_one_line_error, clean_env, run_cli

ALL = migrate.discover()
DONE_BEFORE = len(ALL) - 2  # an installation two releases behind


def psql(url: str, script: str) -> None:
    subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-f", "-"],
        input=script,
        text=True,
        check=True,
        capture_output=True,
    )


def test_the_printed_sql_applied_by_psql_leaves_what_migrate_leaves(
    database_url: str, empty_database_url: str
) -> None:
    migrate.migrate(empty_database_url, "outbox", ALL[:DONE_BEFORE])
    states = [state for _, state in migrate.status(empty_database_url, "outbox")]
    assert states == ["applied"] * DONE_BEFORE + ["pending"] * 2
    script = migrate.script(empty_database_url, "outbox")
    assert [m.label for m in ALL if f"\n-- {m.label}\n" in script] == [m.label for m in ALL[-2:]]
    assert [
        state for _, state in migrate.status(empty_database_url, "outbox")
    ] == states  # read only
    psql(empty_database_url, script)
    assert {state for _, state in migrate.status(empty_database_url, "outbox")} == {"applied"}
    assert migrate.migrate(empty_database_url, "outbox").applied == ()
    assert catalog(empty_database_url) == catalog(database_url)


def test_from_nothing_the_printed_sql_is_every_migration(empty_database_url: str) -> None:
    assert {state for _, state in migrate.status(empty_database_url, "outbox")} == {"pending"}
    psql(empty_database_url, migrate.script(empty_database_url, "outbox"))
    assert migrate.migrate(empty_database_url, "outbox").applied == ()
    assert "0 pending" in migrate.script(empty_database_url, "outbox")


# Slow (out of the fast tier): each `outbox-relay migrate --print-sql` form, run as a command.
@pytest.mark.slow
def test_the_commands(database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    status = run_cli("migrate", "--status", env=env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[-1].split() == [ALL[-1].label, "applied"]
    printed = run_cli("migrate", "--print-sql", env=env)
    assert printed.stdout.startswith("-- outbox-relay: 0 pending migration(s) for schema outbox.")
    assert_one_line_error(
        run_cli("migrate", "--status", "--print-sql", env=env), 2, "exclude each other"
    )
