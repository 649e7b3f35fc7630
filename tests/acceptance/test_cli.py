"""`outbox-relay` commands as a user runs them: output, exit codes, and one-line errors."""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest

import relay
from relay.postgres import migrate
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, assert_one_line_error, clean_env, run_cli


def test_migrate_twice_then_stats(empty_database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=empty_database_url)
    first = run_cli("migrate", env=env)
    assert first.returncode == 0, first.stderr
    labels = ", ".join(m.label for m in migrate.discover())
    version = len(migrate.discover())
    assert first.stdout.strip() == f'applied {labels}; schema "outbox" is at version {version}'
    second = run_cli("migrate", env=env)
    assert second.stdout.strip() == f'schema "outbox" is up to date (version {version})'
    stats = run_cli("stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    figures = json.loads(stats.stdout)
    seen = figures.pop("observation")
    assert (seen["due"], seen["gated"], seen["dead"]) == (0, 0, 0)
    assert "xmin_pid" in seen  # the server's oldest horizon holder: another test's, in parallel
    assert figures == {
        "archived": 0,
        "blocked_keys": 0,
        "dead": 0,
        "dead_by_reason": {},
        "due": 0,
        "gated": 0,
        "in_flight": 0,
        "oldest_pending_age_seconds": None,
        "pending": 0,
        "scheduled": 0,
    }


def test_flags_override_the_environment(empty_database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL="postgresql://nobody@127.0.0.1:1/nothing")
    result = run_cli(
        "migrate", "--database-url", empty_database_url, "--schema", "flagged", env=env
    )
    assert result.returncode == 0, result.stderr
    assert 'schema "flagged"' in result.stdout


def test_stats_in_human_form(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        relay.enqueue(conn, "x", "k", b"")
        conn.commit()
    result = run_cli("stats", env=clean_env(OUTBOX_DATABASE_URL=database_url))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split()[:2] == ["pending", "1"]


def test_missing_schema_says_to_migrate(empty_database_url: str) -> None:
    result = run_cli("stats", env=clean_env(OUTBOX_DATABASE_URL=empty_database_url))
    assert_one_line_error(result, 1, "run `outbox-relay migrate`")


def test_unreachable_database_is_one_line_without_the_password(closed_port: int) -> None:
    url = f"postgresql://app:hunter2@127.0.0.1:{closed_port}/db"
    result = run_cli("stats", env=clean_env(OUTBOX_DATABASE_URL=url))
    assert_one_line_error(result, 1, "PostgreSQL unavailable")
    assert "hunter2" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("OUTBOX_DATABASE_URL", "mysql://root@localhost/db", "must start with postgresql://"),
        ("OUTBOX_AMQP_URL", "http://guest:guest@localhost/", "must start with amqp://"),
        ("OUTBOX_SCHEMA", 'outbox"; DROP TABLE x; --', "invalid schema name"),
        ("OUTBOX_BATCH_SIZE", "lots", "OUTBOX_BATCH_SIZE"),
        ("OUTBOX_LEASE", "forever", "not a duration"),
    ],
)
def test_bad_settings_exit_2_before_connecting(variable: str, value: str, fragment: str) -> None:
    result = run_cli("run", env=clean_env(**{variable: value}))
    assert_one_line_error(result, 2, "invalid settings", fragment)


def test_a_bad_flag_is_named_as_the_flag_and_a_negative_duration_as_out_of_range() -> None:
    result = run_cli("run", "--lease", "-1", env=clean_env())
    assert_one_line_error(result, 2, "invalid settings", "--lease: Input should be greater than 0")


def test_a_misspelt_variable_is_named_with_the_setting_it_resembles(database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_DATABSE_URL="postgresql://x/y")
    result = run_cli("stats", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "outbox-relay: warning: OUTBOX_DATABSE_URL is not a setting: ignored "
        "(did you mean OUTBOX_DATABASE_URL?)"
    ]


def test_password_in_a_bad_url_is_not_echoed() -> None:
    result = run_cli("run", env=clean_env(OUTBOX_AMQP_URL="amqp://guest:s3cret@host:port/"))
    assert_one_line_error(result, 2, "OUTBOX_AMQP_URL")
    assert "s3cret" not in result.stderr


def test_run_gives_up_on_an_unreachable_broker_after_the_startup_timeout(
    database_url: str, closed_port: int
) -> None:
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_STARTUP_TIMEOUT="1",
        OUTBOX_AMQP_URL=f"amqp://guest:t0psecret@127.0.0.1:{closed_port}/",
    )
    result = run_cli("run", env=env)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1
    assert last.startswith("outbox-relay: error: RabbitMQ unavailable")
    assert "Traceback" not in result.stderr
    assert "t0psecret" not in result.stderr


@pytest.mark.parametrize(
    ("database", "broker", "says"),
    [
        (
            "nothing_here",
            None,
            'database "nothing_here" does not exist; check the user',
        ),
        (None, "amqp://guest:wrong-pw@127.0.0.1:5672/", "RabbitMQ refused the login"),
        (None, "amqp://guest:guest@127.0.0.1:5672/no-such-vhost", "the virtual host in"),
        # TLS that cannot work: a server without it says so, one with it fails the certificate
        # check (the root certificate is missing); either is a refusal, not an outage.
        (
            "?sslmode=verify-full&sslrootcert=/nonexistent/root.crt",
            None,
            "PostgreSQL refused the connection",
        ),
    ],
)
def test_a_refusal_fails_start_up_at_once_saying_what_to_check(
    database_url: str, database: str | None, broker: str | None, says: str
) -> None:
    """Wrong credentials, or a database or vhost that does not exist, are not outages: start-up
    ends in one line (it retried them for the whole start-up timeout before)."""
    if database is None:
        url = database_url
    elif database.startswith("?"):
        url = database_url + database
    else:
        url = database_url.rsplit("/", 1)[0] + "/" + database
    env = clean_env(OUTBOX_DATABASE_URL=url, OUTBOX_STARTUP_TIMEOUT="60")
    if broker is not None:
        env["OUTBOX_AMQP_URL"] = broker
    started = time.monotonic()
    result = run_cli("run", env=env)
    assert time.monotonic() - started < 30  # well inside the 60 s it would have retried
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr
    assert last.startswith("outbox-relay: error: "), result.stderr
    assert says in last
    assert "wrong-pw" not in result.stderr


@pytest.mark.parametrize("command", ["run", "migrate", "stats"])
@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("nosuchparam=1", 'invalid URI query parameter: "nosuchparam"'),
        ("sslmode=bogus", 'invalid sslmode value: "bogus"'),
        ("target_session_attrs=bogus", 'invalid target_session_attrs value: "bogus"'),
    ],
)
def test_a_url_that_can_never_work_fails_at_once_with_exit_2(
    database_url: str, command: str, query: str, says: str
) -> None:
    """A typo in the URL is no outage: one line naming it, exit 2, and no start-up retries (`run`
    retried `sslmode=bogus` for its whole start-up timeout, and `nosuchparam` was a traceback)."""
    env = clean_env(OUTBOX_DATABASE_URL=f"{database_url}?{query}", OUTBOX_STARTUP_TIMEOUT="60")
    started = time.monotonic()
    result = run_cli(command, env=env)
    assert time.monotonic() - started < 30  # well inside the 60 s it would have retried
    if command == "run":  # its log lines come first (the metrics endpoint); the error is the last
        result.stderr = result.stderr.strip().splitlines()[-1]
    assert_one_line_error(result, 2, "the PostgreSQL URL cannot work", says)


def test_roles_before_migrate_says_to_migrate(empty_database_url: str) -> None:
    result = run_cli("roles", env=clean_env(OUTBOX_DATABASE_URL=empty_database_url))
    assert_one_line_error(result, 1, "run `outbox-relay migrate`")


def test_run_on_a_database_without_the_schema(empty_database_url: str, amqp_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=empty_database_url, OUTBOX_AMQP_URL=amqp_url)
    result = run_cli("run", env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith("run `outbox-relay migrate`")


async def test_run_until_empty_drains_and_exits_zero(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    with psycopg.connect(database_url) as conn:
        for i in range(1200):
            relay.enqueue(conn, broker.exchange, f"k.{i}", b"")
        conn.commit()
    env = clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_AMQP_URL=amqp_url)
    result = run_cli("run", "--until-empty", env=env)
    assert result.returncode == 0, result.stderr
    assert "1200 claimed, 1200 archived, 0 dead" in result.stderr
    assert len(await broker.collect(1200)) == 1200


def test_demo_shows_messages_flowing(empty_database_url: str, amqp_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=empty_database_url, OUTBOX_AMQP_URL=amqp_url)
    result = run_cli("demo", "--count", "3", "--interval", "0.05", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("← received") >= 3
    assert "✗ rolled back" not in result.stdout or "must never arrive" in result.stdout
    assert "missing 0, from rolled-back transactions 0" in result.stdout
    database = empty_database_url.rsplit("/", 1)[1]
    assert f"/{database}, schema 'outbox' (OUTBOX_DATABASE_URL)" in result.stdout.splitlines()[0]


def test_version_and_module_entry_point() -> None:
    result = run_cli("--version", fresh=True)  # `python -m relay` from the interpreter's start
    assert result.returncode == 0
    assert result.stdout.strip() == f"outbox-relay, version {relay.__version__}"


def test_sigterm_while_starting_exits_zero_at_once(database_url: str, closed_port: int) -> None:
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_STARTUP_TIMEOUT="60",
        OUTBOX_AMQP_URL=f"amqp://guest:guest@127.0.0.1:{closed_port}/",
    )
    with RelayProcess(env) as proc:
        proc.wait_for("waiting for RabbitMQ")
        started = time.monotonic()
        assert proc.stop(timeout=20) == 0, proc.output
        assert time.monotonic() - started < 5
    assert "stopped before it was ready" in proc.output


def test_keys_commands(database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    with psycopg.connect(database_url) as conn:  # a key blocked by a dead message, two waiting
        conn.execute("INSERT INTO outbox.keys VALUES ('order-9', 3, 1, '0', NULL)")
        conn.execute(
            "INSERT INTO outbox.blocked_keys (ordering_key, message_id, seq, reason)"
            " VALUES ('order-9', gen_random_uuid(), 1, 'unroutable')"
        )
        conn.execute(
            "INSERT INTO outbox.messages (message_id, exchange, routing_key, body,"
            " ordering_key, seq, gated) SELECT gen_random_uuid(), 'x', 'k', '',"
            " 'order-9', i, true FROM generate_series(2, 3) i"
        )
        conn.commit()
    listed = run_cli("keys", "blocked", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)  # one array, as every listing's --json
    assert entry["blocked_at"].endswith("+00:00")  # ISO 8601 in UTC, as every --json
    lines = run_cli("keys", "blocked", "--jsonl", env=env).stdout.splitlines()
    assert [json.loads(line) for line in lines] == [entry]
    assert (entry["ordering_key"], entry["seq"], entry["reason"], entry["waiting"]) == (
        "order-9",
        1,
        "unroutable",
        2,
    )
    released = run_cli("keys", "release", "order-9", env=env)
    assert released.stdout.strip() == "released 'order-9': skipping its dead message"
    with psycopg.connect(database_url) as conn:
        gates = conn.execute("SELECT seq, gated FROM outbox.messages ORDER BY seq").fetchall()
    assert gates == [(2, False), (3, True)]  # the next one goes; the one after waits its turn
    assert run_cli("keys", "blocked", env=env).stdout.strip() == "no blocked keys"
    assert_one_line_error(run_cli("keys", "release", "order-9", env=env), 2, "is not blocked")


def test_key_policy_commands(database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    made = run_cli(
        "keys", "policy", "set", "slow.", "--min-interval", "250ms", "--on-dead", "skip", env=env
    )
    assert made.returncode == 0, made.stderr
    assert "'slow.'" in made.stdout
    assert "min interval: 0.25s" in made.stdout
    listed = run_cli("keys", "policy", "list", env=env).stdout.splitlines()
    assert [line.split()[0] for line in listed] == ["''", "'slow.'"]
    assert_one_line_error(
        run_cli("keys", "policy", "set", "x", "--concurrency", "0", env=env),
        2,
        "concurrency must be from 1 to 1000",
    )
    assert_one_line_error(
        run_cli("keys", "policy", "set", "x", "--min-interval", "soon", env=env),
        2,
        "not a duration",
    )
    assert_one_line_error(run_cli("keys", "policy", "delete", "", env=env), 2, "default stays")
    assert run_cli("keys", "policy", "delete", "slow.", env=env).returncode == 0


def test_top_renders_a_frame_and_a_picture(database_url: str, tmp_path: Any) -> None:
    picture = tmp_path / "top.svg"
    result = run_cli(
        "top",
        "--once",
        "--interval",
        "0.2",
        "--svg",
        str(picture),
        env=clean_env(OUTBOX_DATABASE_URL=database_url),
    )
    assert result.returncode == 0, result.stderr
    for label in (
        "published/s",
        "due",
        "scheduled",
        "gated",
        "in flight",
        "oldest due",
        "dead by reason",
        "blocked keys",
        "vacuum horizon",
    ):
        assert label in result.stdout
    assert picture.read_text().startswith("<svg")
