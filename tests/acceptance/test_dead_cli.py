"""`outbox-relay dead …` and `archive …` as an operator runs them: output, exit codes, prompts,
one-line errors, and a replay killed half-way and run again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from tests.integration.test_dead_letters import archive, bury, rows
from tests.support.processes import RelayProcess, assert_one_line_error, clean_env, run_cli
from tests.support.wait import until


@pytest.fixture
def env(database_url: str) -> dict[str, str]:
    return clean_env(OUTBOX_DATABASE_URL=database_url)


def snapshot(url: str) -> list[tuple[Any, ...]]:
    return rows(url, "SELECT * FROM outbox.dead ORDER BY id") + rows(
        url, "SELECT message_id FROM outbox.messages ORDER BY message_id"
    )


# Slow (~4-10 s): six `outbox-relay` processes, each ~0.4 s of start-up (more in the parallel
# run): the command as users run it, its exit code and its one line on stderr.
def test_list_show_and_stats(env: dict[str, str], database_url: str) -> None:
    old = bury(database_url, 3, reason="rejected", routing_key="orders.eu.created")
    bury(database_url, 2, reason="unroutable", exchange="billing", routing_key="invoice.paid")
    with psycopg.connect(database_url) as conn:  # one failed a day ago
        conn.execute(
            "UPDATE outbox.dead SET failed_at = now() - interval '1 day' WHERE message_id = %s",
            (old[0],),
        )
    listed = run_cli(
        "dead", "list", "--routing-key", "orders.*", "--since", "2h", "--json", env=env
    )
    assert listed.returncode == 0, listed.stderr
    got = json.loads(listed.stdout)
    assert sorted(r["message_id"] for r in got) == sorted(str(m) for m in old[1:])
    assert {r["reason"] for r in got} == {"rejected"}
    lines = run_cli("dead", "list", "--reason", "unroutable", "--jsonl", env=env).stdout
    assert [json.loads(line)["exchange"] for line in lines.splitlines()] == ["billing"] * 2
    table = run_cli("dead", "list", "--limit", "2", env=env).stdout
    assert str(old[0])[:13] in table  # oldest failure first, by the start of its id
    assert "… and 3 more" in table
    shown = run_cli("dead", "show", str(old[0]), "--json", env=env)
    record = json.loads(shown.stdout)
    assert (record["message_id"], record["routing_key"]) == (str(old[0]), "orders.eu.created")
    assert record["body"] == {
        "bytes": 36,
        "encoding": "utf-8",
        "text": str(old[0]),
        "truncated": False,
    }
    stats = json.loads(run_cli("dead", "stats", "--json", env=env).stdout)
    assert [(s["reason"], s["exchange"], s["count"]) for s in stats] == [
        ("rejected", "x", 3),
        ("unroutable", "billing", 2),
    ]
    assert "total" in run_cli("dead", "stats", env=env).stdout


def test_show_is_safe_with_binary_and_hostile_text(env: dict[str, str], database_url: str) -> None:
    (binary,) = bury(database_url, 1)
    (hostile,) = bury(database_url, 1)
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "UPDATE outbox.dead SET body = %s WHERE message_id = %s", (b"\x00\xff" * 3000, binary)
        )
        conn.execute(
            "UPDATE outbox.dead SET body = %s, detail = %s WHERE message_id = %s",
            (b"\x1b[2Jgone", "\x1b]0;pwned\x07", hostile),
        )
    short = run_cli("dead", "show", str(binary), env=env).stdout
    assert "6,000 bytes, shown as base64" in short
    assert "truncated at 2,000 characters" in short
    full = json.loads(run_cli("dead", "show", str(binary), "--full", "--json", env=env).stdout)
    assert (full["body"]["encoding"], len(full["body"]["text"]), full["body"]["truncated"]) == (
        "base64",
        8000,
        False,
    )
    shown = run_cli("dead", "show", str(hostile), env=env).stdout
    assert "\x1b" not in shown
    assert "\\x1b]0;pwned\\x07" in shown


# Slow (~4-10 s): seven `outbox-relay` processes, each ~0.4 s of start-up (more in the parallel
# run): the command as users run it, its exit code and its one line on stderr.
@pytest.mark.parametrize(
    "hostile",
    [
        "x' OR '1'='1",
        "x'; DROP TABLE outbox.dead; --",
        "%",
        "_",
    ],
)
def test_filters_are_data_never_sql(env: dict[str, str], database_url: str, hostile: str) -> None:
    # Every filter goes to PostgreSQL as a bound parameter, and globs escape LIKE's own
    # wildcards: an injection string or a stray % matches only itself.
    bury(database_url, 2, exchange="safe", routing_key="a.b", ordering_key="k-1")
    target = bury(database_url, 1, exchange=hostile, routing_key=hostile, ordering_key=hostile)
    before = snapshot(database_url)
    for option in ("--exchange", "--routing-key", "--key"):
        listed = run_cli("dead", "list", option, hostile, "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        assert [r["message_id"] for r in json.loads(listed.stdout)] == [str(target[0])]
        dry = run_cli("dead", "purge", option, hostile, "--dry-run", env=env)
        assert dry.returncode == 0, dry.stderr
    assert snapshot(database_url) == before  # nothing dropped, deleted or changed
    purged = run_cli("dead", "purge", "--routing-key", hostile, "--yes", env=env)
    assert purged.returncode == 0, purged.stderr
    assert len(rows(database_url, "SELECT 1 FROM outbox.dead")) == 2


def test_errors_are_one_clear_line(env: dict[str, str], closed_port: int) -> None:
    missing = str(uuid.uuid4())
    assert_one_line_error(
        run_cli("dead", "show", missing, env=env), 1, f"no dead letter with message_id {missing}"
    )
    assert_one_line_error(
        run_cli("dead", "show", "42", env=env),
        2,
        "not a message id or the start of one (4 or more hex digits): '42'",
    )
    assert_one_line_error(
        run_cli("dead", "list", "--since", "last tuesday", env=env), 2, "not a time"
    )
    assert_one_line_error(
        run_cli("dead", "list", "--since", "1h", "--until", "2h", env=env),
        2,
        "--since must be before --until",
    )
    assert_one_line_error(
        run_cli("dead", "list", "--reason", "gone", env=env),
        2,
        "'--reason'",
        "'gone' is not one of",
    )
    assert_one_line_error(
        run_cli("dead", "list", "--json", "--jsonl", env=env), 2, "exclude each other"
    )
    assert_one_line_error(run_cli("dead", "replay", env=env), 2, "--all")
    assert_one_line_error(run_cli("dead", "purge", "--yes", env=env), 2, "--all")
    assert_one_line_error(run_cli("archive", "prune", env=env), 2, "--older-than")
    url = f"postgresql://ops:s3cret@127.0.0.1:{closed_port}/db"
    down = run_cli("dead", "list", env=clean_env(OUTBOX_DATABASE_URL=url))
    assert_one_line_error(down, 1, "PostgreSQL unavailable")
    assert "s3cret" not in down.stderr


# Slow (~4-10 s): eight `outbox-relay` processes, each ~0.4 s of start-up (more in the parallel
# run): the command as users run it, its exit code and its one line on stderr.
def test_ids_as_dead_list_shows_them_work_in_every_command(
    env: dict[str, str], database_url: str
) -> None:
    (target,) = bury(database_url, 1, reason="rejected")
    listed = run_cli("dead", "list", env=env)
    short = str(target)[:13]
    assert short in listed.stdout
    assert str(target) not in listed.stdout  # the whole id is --json's
    shown = run_cli("dead", "show", short, env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"message_id     {target}" in shown.stdout
    undashed = short.replace("-", "").upper()[:6]  # any 4+ hex digits, dashes and case aside
    assert run_cli("dead", "show", undashed, env=env).returncode == 0
    # Two dead letters whose ids share their first 12 hex digits: their start names neither.
    twins = [
        uuid.UUID("0b8e4c1a-7f3d-4000-8000-000000000001"),
        uuid.UUID("0b8e4c1a-7f3d-4000-8000-000000000002"),
    ]
    with psycopg.connect(database_url) as conn:
        for twin in twins:
            conn.execute(
                "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,"
                " properties, attempts, reason, detail, created_at, failed_at)"
                " VALUES (%s, 'x', 'k', 'b', '{}', '{}', 1, 'rejected', 't', now(), now())",
                [twin],
            )
    assert_one_line_error(
        run_cli("dead", "show", "0b8e4c1a-7f3d", env=env),
        2,
        "'0b8e4c1a-7f3d' starts more than one dead letter's message_id: give more of it",
    )
    assert_one_line_error(
        run_cli("dead", "purge", "ffff0000", "--yes", env=env),
        2,
        "no dead letter's message_id starts with 'ffff0000'",
    )
    replayed = run_cli("dead", "replay", short, env=env)
    assert replayed.stdout.strip() == "replayed 1 dead letter"
    purged = run_cli(
        "dead", "purge", str(twins[1]), "0b8e4c1a-7f3d-4000-8000-00000000000", "--yes", env=env
    )
    assert purged.returncode == 2  # the second still names both twins
    assert run_cli("dead", "purge", str(twins[1]), "--yes", env=env).stdout.strip() == (
        "purged 1 dead letter"
    )
    assert rows(database_url, "SELECT message_id FROM outbox.dead") == [(twins[0],)]


def test_replay_dry_run_then_for_real(env: dict[str, str], database_url: str) -> None:
    ids = bury(database_url, 25, reason="no_exchange", exchange="gone")
    bury(database_url, 3, reason="rejected")
    before = snapshot(database_url)
    dry = run_cli(
        "dead", "replay", "--reason", "no_exchange", "--to-exchange", "orders", "--dry-run", env=env
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("would replay 25 dead letters to exchange 'orders':")
    assert "… and 5 more" in dry.stdout
    assert snapshot(database_url) == before
    done = run_cli("dead", "replay", "--reason", "no_exchange", "--to-exchange", "orders", env=env)
    assert done.stdout.strip() == "replayed 25 dead letters to exchange 'orders'"
    moved = rows(
        database_url, "SELECT message_id, exchange, attempts, replays FROM outbox.messages"
    )
    assert sorted(moved) == sorted((m, "orders", 0, 1) for m in ids)
    assert rows(database_url, "SELECT reason FROM outbox.dead") == [("rejected",)] * 3
    assert run_cli("dead", "replay", "--all", env=env).stdout.strip() == "replayed 3 dead letters"
    (one,) = bury(database_url, 1, reason="rejected")
    assert run_cli("dead", "replay", str(one), env=env).stdout.strip() == "replayed 1 dead letter"


def test_purge_dry_run_changes_nothing_and_asks_first(
    env: dict[str, str], database_url: str
) -> None:
    bury(database_url, 4, reason="rejected")
    keep = bury(database_url, 2, reason="unroutable")
    before = snapshot(database_url)
    dry = run_cli("dead", "purge", "--reason", "rejected", "--dry-run", env=env)
    assert dry.stdout.startswith("would purge 4 dead letters:")
    assert snapshot(database_url) == before
    declined = run_cli("dead", "purge", "--reason", "rejected", env=env, answer="n\n")
    assert declined.returncode == 0  # a "no" is an answer, not an error
    assert "delete 4 dead letters for good?" in declined.stderr
    assert declined.stdout.strip() == "nothing purged"
    assert snapshot(database_url) == before
    no_terminal = run_cli("dead", "purge", "--reason", "rejected", env=env)  # no stdin: no
    assert no_terminal.returncode == 1
    question, error = no_terminal.stderr.splitlines()
    assert question.startswith("delete 4 dead letters for good?")
    assert error.startswith("outbox-relay: error: cannot ask for confirmation without a terminal")
    assert snapshot(database_url) == before
    agreed = run_cli("dead", "purge", "--reason", "rejected", env=env, answer="y\n")
    assert agreed.stdout.strip() == "purged 4 dead letters"
    assert rows(database_url, "SELECT message_id FROM outbox.dead ORDER BY id") == [
        (k,) for k in keep
    ]
    assert (
        run_cli("dead", "purge", "--all", "--yes", env=env).stdout.strip()
        == "purged 2 dead letters"
    )


# Slow (~5-7 s): 20,000 dead rows buried, a `dead replay` process SIGKILLed mid-way (batches of 3,
# so it is still running when it is killed), then run again to the end; the promise is about a
# real process killed, so the zygote is not used.
@pytest.mark.slow
def test_a_replay_killed_half_way_run_again_moves_everything_once(
    env: dict[str, str], database_url: str
) -> None:
    ids = set(bury(database_url, 20_000))
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "dead", "replay", "--all", "--batch", "3"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until(lambda: rows(database_url, "SELECT count(*) FROM outbox.messages")[0][0] >= 300)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # Its server session may still commit the batch it was running: wait until it is gone.
    until(
        lambda: (
            not rows(
                database_url,
                "SELECT 1 FROM pg_stat_activity WHERE application_name = 'outbox-relay admin'"
                " AND datname = current_database()",
            )
        ),
        message="the killed replay's session to end",
    )
    (moved,) = rows(database_url, "SELECT count(*) FROM outbox.messages")[0]
    (left,) = rows(database_url, "SELECT count(*) FROM outbox.dead")[0]
    assert 300 <= moved < 20_000  # killed half-way …
    assert moved + left == 20_000  # … and every row is in exactly one place
    again = run_cli("dead", "replay", "--all", env=env)
    assert again.stdout.strip() == f"replayed {left:,} dead letters"
    got = [r[0] for r in rows(database_url, "SELECT message_id FROM outbox.messages")]
    assert len(got) == len(set(got)) == 20_000
    assert set(got) == ids


def test_archive_prune_and_stats(env: dict[str, str], database_url: str) -> None:
    archive(database_url, 7000, timedelta(days=9))
    archive(database_url, 300, timedelta(hours=2))
    stats = json.loads(run_cli("archive", "stats", "--exact", "--json", env=env).stdout)
    assert stats["exact_rows"] == 7300
    assert stats["bytes"] > 0
    dry = run_cli("archive", "prune", "--older-than", "7d", "--dry-run", env=env)
    assert dry.stdout.startswith("would delete 7,000 archived rows published before ")
    assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(7300,)]
    done = run_cli("archive", "prune", "--older-than", "7d", "--batch", "1000", env=env)
    assert done.stdout.startswith("deleted 7,000 archived rows published before "), done.stderr
    assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(300,)]
    assert "rows    300" in run_cli("archive", "stats", "--exact", env=env).stdout


@pytest.mark.slow
def test_a_running_relay_prunes_the_archive(database_url: str, amqp_url: str) -> None:
    archive(database_url, 2500, timedelta(days=2))
    archive(database_url, 10, timedelta(minutes=5))
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_ARCHIVE_RETENTION="1d",
        OUTBOX_LOG_FORMAT="text",
    )
    with RelayProcess(env) as relay:
        relay.wait_for("archive pruned: 2500 rows deleted")
        assert relay.stop() == 0
    assert rows(database_url, "SELECT count(*) FROM outbox.archive") == [(10,)]
