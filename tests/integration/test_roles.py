"""Least privilege: each role `outbox-relay roles` creates can do its job, and nothing more."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import errors as pgerrors

import relay
from relay.core.filters import DeadFilter
from relay.postgres import admin, migrate, roles
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env, run_cli


@dataclass(frozen=True)
class Secured:
    """A schema of its own (role names are global), its roles, and a login user for each."""

    owner_url: str
    schema: str

    def url(self, job: str) -> str:
        """The database as the login user holding `job`'s role."""
        parts = urlsplit(self.owner_url)
        netloc = f"{self.schema}_{job}_login@{parts.hostname}:{parts.port or 5432}"
        return parts._replace(netloc=netloc).geturl()


@pytest.fixture
def secured(empty_database_url: str) -> Iterator[Secured]:
    schema = f"s{uuid.uuid4().hex[:10]}"
    migrate.migrate(empty_database_url, schema)
    made = roles.ensure(empty_database_url, schema)
    logins = [f"{schema}_{job}_login" for job in roles.JOBS]
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for group, login in zip(made.names(), logins, strict=True):
            conn.execute(
                psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    psycopg.sql.Identifier(login), psycopg.sql.Identifier(group)
                )
            )
    try:
        yield Secured(empty_database_url, schema)
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            for name in [*logins, *made.names()]:
                conn.execute(
                    psycopg.sql.SQL("DROP OWNED BY {}").format(psycopg.sql.Identifier(name))
                )
        # DROP ROLE needs the roles to own and hold nothing, in any database: the fixture's
        # database is dropped after this, so drop the roles from the server's own database.
        admin = urlsplit(empty_database_url)._replace(path="/postgres").geturl()
        with psycopg.connect(admin, autocommit=True) as conn:
            for name in [*logins, *made.names()]:
                conn.execute(
                    psycopg.sql.SQL("DROP ROLE IF EXISTS {}").format(psycopg.sql.Identifier(name))
                )


def forbidden(url: str, statement: str) -> None:
    """`statement` fails with a permission error (and changes nothing: it is rolled back)."""
    with psycopg.connect(url) as conn, pytest.raises(pgerrors.InsufficientPrivilege):
        conn.execute(statement.encode())


def count(s: Secured, table: str) -> int:
    with psycopg.connect(s.owner_url) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{s.schema}".{table}'.encode()).fetchone()
    assert row is not None
    return int(row[0])


# Slow (out of the fast tier): `outbox-relay roles` and psql, run as commands.
@pytest.mark.slow
def test_roles_command_creates_the_roles_once(empty_database_url: str) -> None:
    schema = f"s{uuid.uuid4().hex[:10]}"
    migrate.migrate(empty_database_url, schema)
    env = clean_env(OUTBOX_DATABASE_URL=empty_database_url, OUTBOX_SCHEMA=schema)
    try:
        first = run_cli("roles", env=env)
        assert first.returncode == 0, first.stderr
        for job in roles.JOBS:
            assert f"{schema}_{job}" in first.stdout
        assert first.stdout.count("created") == len(roles.JOBS)
        again = run_cli("roles", env=env)  # idempotent: the roles exist, the grants are redone
        assert again.returncode == 0, again.stderr
        assert again.stdout.count("exists") == len(roles.JOBS)
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            for job in roles.JOBS:
                name = psycopg.sql.Identifier(f"{schema}_{job}")
                conn.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(name))
                conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(name))


def test_producer_can_enqueue_and_nothing_else(secured: Secured) -> None:
    s, producer = secured, secured.url("producer")
    with psycopg.connect(producer) as conn:
        relay.enqueue(conn, "x", "a.b", b"one", schema=s.schema)
        relay.enqueue(conn, "x", "a.b", b"two", ordering_key="k", schema=s.schema)
        relay.enqueue(conn, "x", "a.b", b"three", ordering_key="k", schema=s.schema)
        conn.execute(f"SELECT \"{s.schema}\".enqueue_json('x', 'a.b', '{{}}')".encode())
        batch = [relay.Message("x", "a.b", b"5"), relay.Message("x", "a.b", b"6", ordering_key="k")]
        relay.enqueue_many(conn, batch, schema=s.schema)
    assert count(s, "messages") == 6
    q = f'"{s.schema}"'
    for statement in (
        f"SELECT * FROM {q}.messages",
        f"INSERT INTO {q}.messages (message_id, exchange, routing_key, body) "
        "VALUES (gen_random_uuid(), 'x', 'y', '')",
        f"UPDATE {q}.messages SET body = ''",
        f"DELETE FROM {q}.messages",
        f"SELECT * FROM {q}.archive",
        f"SELECT * FROM {q}.dead",
        f"UPDATE {q}.settings SET max_body_bytes = 0",
        f"SELECT {q}._enqueue('x', 'y', '', '{{}}', '{{}}', now(), NULL, NULL, 'c')",
        f"SELECT {q}.replay_dead(ARRAY[1::bigint])",
        f"SELECT {q}.release_key('k')",
        f"CREATE TABLE {q}.mine (i int)",
        f"TRUNCATE {q}.messages",
    ):
        forbidden(producer, statement)


def FORGERIES(q: str) -> tuple[str, ...]:  # a constant table, spelt as one
    """What a relay's login must not do to a waiting message, a key or a dead letter: rewrite
    what will be published or where, reorder a key, or make up a message (a forged dead row
    would become a real one on `dead replay --all`)."""
    return (
        *(
            f"UPDATE {q}.messages SET {column}"
            for column in (
                "body = 'forged'",
                "exchange = 'elsewhere'",
                "routing_key = 'elsewhere'",
                "headers = '{}'",
                "properties = '{}'",
                "message_id = gen_random_uuid()",
                "ordering_key = 'other'",
                "seq = 1",
                "gated = false",
                "replays = 0",
                "created_at = now()",
            )
        ),
        f"DELETE FROM {q}.messages",
        f"UPDATE {q}.keys SET last_seq = 0",
        f"DELETE FROM {q}.keys",
        f"INSERT INTO {q}.dead (message_id, exchange, routing_key, body, headers, properties, "
        "attempts, reason, created_at) "
        "VALUES (gen_random_uuid(), 'x', 'y', 'forged', '{}', '{}', 1, 'r', now())",
        f"INSERT INTO {q}.archive (message_id, exchange, routing_key, body, headers, properties, "
        "attempts, created_at) VALUES (gen_random_uuid(), 'x', 'y', '', '{}', '{}', 1, now())",
        f"INSERT INTO {q}.blocked_keys (ordering_key, message_id, seq, reason) "
        "VALUES ('k', gen_random_uuid(), 1, 'r')",
        f"DELETE FROM {q}.blocked_keys",
        f"SELECT {q}._keys_settled(array['k'], array[1::bigint], array[NULL::text], "
        "array[gen_random_uuid()])",
    )


# Slow (out of the fast tier): a relay and `outbox-relay` commands run under the role.
@pytest.mark.slow
async def test_relay_role_relays_and_nothing_else(secured: Secured, broker: Broker) -> None:
    s = secured
    await broker.declare(binding="r.#")
    with psycopg.connect(s.url("producer")) as conn:
        for n in range(3):
            relay.enqueue(conn, broker.exchange, "r.ok", b"%d" % n, schema=s.schema)
        relay.enqueue(conn, broker.exchange, "r.k", b"k1", ordering_key="k", schema=s.schema)
        relay.enqueue(conn, broker.exchange, "r.k", b"k2", ordering_key="k", schema=s.schema)
        relay.enqueue(conn, f"{broker.exchange}.missing", "r", b"lost", schema=s.schema)
    env = clean_env(
        OUTBOX_DATABASE_URL=s.url("relay"), OUTBOX_AMQP_URL=broker.url, OUTBOX_SCHEMA=s.schema
    )
    with RelayProcess(env, "--until-empty") as proc:
        proc.wait_for("no due rows left")
        assert proc.exited() == 0, proc.output
    assert (count(s, "messages"), count(s, "archive"), count(s, "dead")) == (0, 5, 1)
    assert '"level": "ERROR"' not in proc.output  # no chore lacked a right (keys, watcher, …)
    q = f'"{s.schema}"'
    for statement in (
        f"INSERT INTO {q}.messages (message_id, exchange, routing_key, body) "
        "VALUES (gen_random_uuid(), 'x', 'y', '')",
        *FORGERIES(q),
        f"SELECT {q}.enqueue('x', 'y', ''::bytea)",
        f"UPDATE {q}.settings SET max_body_bytes = 0",
        f"DELETE FROM {q}.dead",
        f"UPDATE {q}.archive SET body = ''",
        f"INSERT INTO {q}.key_policies (prefix) VALUES ('a')",
        f"SELECT {q}.replay_dead(ARRAY[1::bigint])",
        f"TRUNCATE {q}.messages",
        f"DROP TABLE {q}.archive",
        f"ALTER TABLE {q}.messages ADD COLUMN evil int",
        f"CREATE TABLE {q}.mine (i int)",
    ):
        forbidden(s.url("relay"), statement)
    # No write to a table at all, so no lock stronger than a read's on one: a relay login that
    # misbehaves can stall neither producers nor other relays (migration 0026).
    for statement in (
        f"UPDATE {q}.messages SET claim_id = gen_random_uuid()",
        f"UPDATE {q}.messages SET available_at = now()",
        f"SELECT 1 FROM {q}.messages FOR UPDATE",
        f"SELECT 1 FROM {q}.messages FOR KEY SHARE",
        f"LOCK TABLE {q}.messages IN ROW EXCLUSIVE MODE",
        f"LOCK TABLE {q}.archive IN SHARE MODE",
        f"DELETE FROM {q}.archive",
        f"SELECT * FROM {q}.forget_idle_keys('1 hour', NULL, 10)",
    ):
        forbidden(s.url("relay"), statement)
    # Its functions are fenced by claim ids it cannot forge: a made-up one settles nothing.
    with psycopg.connect(s.url("producer")) as conn:
        relay.enqueue(conn, broker.exchange, "r.k", b"k3", ordering_key="k", schema=s.schema)
    with psycopg.connect(s.url("relay"), autocommit=True) as conn:
        settle = (
            f"SELECT archived FROM {q}.settle(gen_random_uuid(),"
            f" ARRAY(SELECT id FROM {q}.messages), ARRAY['archive'], NULL, NULL, NULL, '{{}}',"
            " true, NULL)"
        )
        assert conn.execute(settle.encode()).fetchall() == [(0,)]
    assert count(s, "archive") == 5


# Slow (~6-11 s; out of the fast tier): a relay process drains four rows to dead letters as the
# relay role, then a dozen `outbox-relay` commands run as the operator, each a Python start-up of
# ~0.4 s; the promise is what each role may do through the commands users run.
@pytest.mark.slow
async def test_operator_role_runs_the_cli_and_nothing_else(
    secured: Secured, broker: Broker
) -> None:
    s = secured
    await broker.declare(binding="r.#")
    with psycopg.connect(s.url("producer")) as conn:
        for n in range(4):
            relay.enqueue(conn, f"{broker.exchange}.missing", "r", b"%d" % n, schema=s.schema)
    env = clean_env(
        OUTBOX_DATABASE_URL=s.url("relay"), OUTBOX_AMQP_URL=broker.url, OUTBOX_SCHEMA=s.schema
    )
    with RelayProcess(env, "--until-empty") as proc:
        proc.wait_for("no due rows left")
        assert proc.exited() == 0, proc.output
    assert count(s, "dead") == 4
    with psycopg.connect(s.owner_url) as conn:
        query = f'SELECT message_id FROM "{s.schema}".dead ORDER BY id'
        dead = [str(m) for (m,) in conn.execute(query.encode())]
    ops = clean_env(OUTBOX_DATABASE_URL=s.url("operator"), OUTBOX_SCHEMA=s.schema)
    for args in (
        ("dead", "list"),
        ("dead", "stats"),
        ("stats",),
        ("dead", "replay", dead[0], dead[1], "--to-exchange", broker.exchange),
        ("dead", "purge", dead[2], "--yes"),
        ("archive", "stats"),
        ("archive", "prune", "--older-than", "1s"),
        ("keys", "policy", "set", "acct-", "--on-dead", "skip"),
    ):
        result = run_cli(*args, env=ops)
        assert result.returncode == 0, (args, result.stderr)
    assert (count(s, "messages"), count(s, "dead")) == (2, 1)
    q = f'"{s.schema}"'
    for statement in (
        f"UPDATE {q}.messages SET body = ''",
        f"DELETE FROM {q}.messages",
        f"INSERT INTO {q}.messages (message_id, exchange, routing_key, body) "
        "VALUES (gen_random_uuid(), 'x', 'y', '')",
        f"INSERT INTO {q}.archive (message_id, exchange, routing_key, body, headers, properties, "
        "attempts, created_at) VALUES (gen_random_uuid(), 'x', 'y', '', '{}', '{}', 1, now())",
        f"UPDATE {q}.settings SET max_body_bytes = 0",
        f"UPDATE {q}.dead SET body = ''",
        f"SELECT {q}.enqueue('x', 'y', ''::bytea)",
        f"TRUNCATE {q}.dead",
        f"DROP TABLE {q}.dead",
        f"CREATE TABLE {q}.mine (i int)",
    ):
        forbidden(s.url("operator"), statement)


def test_migrations_keep_the_roles_grants_current(secured: Secured) -> None:
    # A later migration's new function is callable by nobody, PUBLIC included; and a grant the
    # migration lost (here: revoked outright, as DROP + CREATE of a function would) comes back.
    s = secured
    text = (
        "CREATE FUNCTION probe() RETURNS int LANGUAGE sql AS 'SELECT 1';"
        "REVOKE EXECUTE ON FUNCTION enqueue(text, text, bytea, jsonb, jsonb, timestamptz, text,"
        f' uuid) FROM "{s.schema}_producer";'
    )
    migrate.migrate(
        s.owner_url, s.schema, [*migrate.discover(), migrate.Migration(9999, "p", text)]
    )
    forbidden(s.url("producer"), f'SELECT "{s.schema}".probe()')
    with psycopg.connect(s.url("producer")) as conn:
        relay.enqueue(conn, "x", "a.b", b"after", schema=s.schema)


def test_replays_from_the_lake_run_as_producers_through_their_functions(
    secured: Secured,
) -> None:
    s = secured
    q = f'"{s.schema}"'
    one_batch = (
        f"SELECT {q}.replay_batch('r1', 0, ARRAY[7::bigint], ARRAY['x'], ARRAY['r'],"
        " ARRAY['{}'::bytea], ARRAY['{}'], ARRAY['{\"x-replay\": \"r1\"}'::jsonb], ARRAY['{}'],"
        " ARRAY[NULL::text], ARRAY[gen_random_uuid()])"
    )
    with psycopg.connect(s.url("producer")) as conn:
        conn.execute(f"SELECT * FROM {q}.start_replay('r1', '{{}}')".encode())
        conn.execute(one_batch.encode())
        conn.execute(f"SELECT {q}.replay_skip('r1', 7, 8, 'm', 'too big')".encode())
    assert count(s, "messages") == 1
    # A replay enqueues: the operator and the relay cannot, and a producer cannot write the
    # table but through the functions (their fence).
    for job in ("operator", "relay"):
        forbidden(s.url(job), one_batch)
        forbidden(s.url(job), f"SELECT * FROM {q}.start_replay('r2', '{{}}')")
    for job in ("producer", "operator"):
        for statement in (
            f"UPDATE {q}.replays SET position = 0",
            f"DELETE FROM {q}.replays",
            f"INSERT INTO {q}.replays (name, selection) VALUES ('r3', '{{}}')",
            f"SELECT {q}._replay_moves('r1', 8, 9)",
        ):
            forbidden(s.url(job), statement)
    # A replay belongs to the login that started it: another producer login can neither see
    # it, nor continue it, nor skip through it (nor take over a name an operator will use).
    other = f"{s.schema}_other_login"
    with psycopg.connect(s.owner_url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                psycopg.sql.Identifier(other), psycopg.sql.Identifier(f"{s.schema}_producer")
            )
        )
    try:
        url = s.url("producer").replace(f"{s.schema}_producer_login@", f"{other}@")
        for statement in (
            f"SELECT * FROM {q}.start_replay('r1', NULL, false)",
            f"SELECT {q}.replay_skip('r1', 8, 9223372036854775807, 'x', 'sabotage')",
            one_batch.replace("'r1', 0", "'r1', 8"),
        ):
            forbidden(url, statement)
    finally:
        with psycopg.connect(s.owner_url, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(other)))


def test_viewer_reads_what_an_operator_reads_and_changes_nothing(secured: Secured) -> None:
    # The web console's read-only mode and dashboards log in as the viewer: every table, the
    # dead-letter filter, the operators' read paths; no write, no other function.
    s, viewer = secured, secured.url("viewer")
    q = f'"{s.schema}"'
    with psycopg.connect(s.url("producer")) as conn:
        relay.enqueue(conn, "x", "a.b", b"waiting", ordering_key="k", schema=s.schema)
    with psycopg.connect(s.owner_url) as conn:
        conn.execute(
            f"INSERT INTO {q}.dead (message_id, exchange, routing_key, body, headers, properties, "
            "attempts, reason, created_at) "
            "VALUES (gen_random_uuid(), 'x', 'a.b', 'b', '{}', '{}', 1, 'nope', now())".encode()
        )
        conn.execute(
            f"INSERT INTO {q}.archive (message_id, exchange, routing_key, body, headers, "
            "properties, attempts, created_at) "
            "VALUES (gen_random_uuid(), 'x', 'a.b', 'b', '{}', '{}', 1, now())".encode()
        )
        tables = [
            str(name)
            for (name,) in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s", [s.schema]
            )
        ]
    assert {"messages", "archive", "dead", "key_policies", "settings"} <= set(tables)
    with psycopg.connect(viewer) as conn:
        for table in tables:  # every table, as the operator's GRANT SELECT ON ALL TABLES
            conn.execute(f'SELECT * FROM {q}."{table}"'.encode()).fetchall()
        counts = [
            conn.execute(f"SELECT count(*) FROM {q}.{table}".encode()).fetchone()
            for table in ("messages", "archive", "dead")
        ]
        assert counts == [(1,), (1,), (1,)]
        matched = conn.execute(
            f"SELECT count(*) FROM {q}.dead d WHERE {q}.dead_matches(d, ARRAY['nope'])".encode()
        ).fetchone()
        assert matched == (1,)
    with admin.Admin.connect(viewer, s.schema) as ops:  # what `dead list`, `stats`... read
        assert [row.reason for row in ops.dead_list(DeadFilter.build(reasons=["nope"]))] == ["nope"]
        assert ops.dead_count() == 1
        assert len(ops.dead_stats()) == 1
        ops.blocked_keys()
        ops.policies()
        ops.archive_stats(exact=True)
    for statement in (
        f"DELETE FROM {q}.dead",
        f"SELECT {q}.replay_dead(ARRAY[1::bigint])",
        f"SELECT {q}.release_key('k')",
        f"INSERT INTO {q}.key_policies (prefix) VALUES ('a')",
        f"SELECT {q}.enqueue('x', 'y', ''::bytea)",
        f"SELECT {q}.enqueue_json('x', 'y', '{{}}')",
        f"UPDATE {q}.dead SET detail = ''",
        f"SELECT 1 FROM {q}.dead FOR UPDATE",
        f"UPDATE {q}.messages SET body = ''",
        f"INSERT INTO {q}.messages (message_id, exchange, routing_key, body) "
        "VALUES (gen_random_uuid(), 'x', 'y', '')",
        f"DELETE FROM {q}.archive",
        f"TRUNCATE {q}.dead",
        f"UPDATE {q}.settings SET max_body_bytes = 0",
        f"LOCK TABLE {q}.messages IN ROW EXCLUSIVE MODE",
        f"SELECT * FROM {q}.prune_archive(now(), 10)",
        f"SELECT * FROM {q}.forget_idle_keys('1 hour', NULL, 10)",
        f"SELECT * FROM {q}.key_policy('k')",
        f"SELECT * FROM {q}.claim(NULL)",
        f"CREATE TABLE {q}.mine (i int)",
    ):
        forbidden(viewer, statement)
    assert (count(s, "messages"), count(s, "archive"), count(s, "dead")) == (1, 1, 1)


def test_migrate_grants_the_roles_an_earlier_roles_set_up(secured: Secured) -> None:
    # An installation whose roles `roles` of an earlier version created has no viewer role:
    # `migrate` (which creates no role) succeeds and still grants the other roles theirs; the
    # next `roles` creates the viewer.
    s = secured
    viewer = f"{s.schema}_viewer"
    with psycopg.connect(s.owner_url, autocommit=True) as conn:  # as if `roles` never made it
        conn.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(psycopg.sql.Identifier(viewer)))
        conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(viewer)))
    lost = (
        "REVOKE EXECUTE ON FUNCTION enqueue(text, text, bytea, jsonb, jsonb, timestamptz, text,"
        f' uuid) FROM "{s.schema}_producer";'
    )
    migrate.migrate(
        s.owner_url, s.schema, [*migrate.discover(), migrate.Migration(9999, "p", lost)]
    )
    with psycopg.connect(s.url("producer")) as conn:  # the producer's grant came back
        relay.enqueue(conn, "x", "a.b", b"after", schema=s.schema)
    with psycopg.connect(s.owner_url) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [viewer]).fetchone()
    assert exists is None  # migrate created no role
    made = roles.ensure(s.owner_url, s.schema)
    assert made.created == (viewer,)
    with psycopg.connect(s.owner_url) as conn:
        can = conn.execute(
            "SELECT has_table_privilege(%s, %s, 'SELECT'), has_table_privilege(%s, %s, 'DELETE')",
            [viewer, f"{s.schema}.dead", viewer, f"{s.schema}.dead"],
        ).fetchone()
    assert can == (True, False)


def test_migrate_grants_nothing_before_the_roles_are_set_up(empty_database_url: str) -> None:
    # Before `roles` has run, migrate grants nothing and creates no role.
    schema = f"s{uuid.uuid4().hex[:10]}"
    migrate.migrate(empty_database_url, schema)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        assert not roles.refresh(conn, schema)
        found = conn.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname LIKE %s", [f"{schema}\\_%"]
        ).fetchone()
    assert found == (0,)
