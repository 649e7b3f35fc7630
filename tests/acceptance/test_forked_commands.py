"""`run_cli` forks each command from a zygote that has the CLI imported (tests/support/
zygote.py): each is still a process of its own, with the environment, exit code and output the
test gave and saw, nothing left from the command before, and a timeout that kills it."""

from __future__ import annotations

import signal
import subprocess
import threading
from urllib.parse import urlsplit

import pytest

from tests.support.processes import _ZYGOTE, assert_one_line_error, clean_env, run_cli
from tests.support.wait import until


def test_each_command_has_the_environment_it_was_given_and_nothing_of_the_last(
    database_url: str,
) -> None:
    bad = run_cli("run", env=clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_BATCH_SIZE="many"))
    assert_one_line_error(bad, 2, "OUTBOX_BATCH_SIZE")
    fine = run_cli("stats", env=clean_env(OUTBOX_DATABASE_URL=database_url))
    assert fine.returncode == 0, fine.stderr
    # libpq reads PGUSER from the process's own environment, not os.environ's copy of it.
    parts = urlsplit(database_url)
    no_user = parts._replace(netloc=f"{parts.hostname}:{parts.port}").geturl()
    as_postgres = run_cli("stats", env=clean_env(OUTBOX_DATABASE_URL=no_user, PGUSER="postgres"))
    assert as_postgres.returncode == 0, as_postgres.stderr
    as_nobody = run_cli("stats", env=clean_env(OUTBOX_DATABASE_URL=no_user, PGUSER="no_such_role"))
    assert as_nobody.returncode != 0
    assert "no_such_role" in as_nobody.stderr


def test_a_command_past_its_timeout_is_killed_and_another_thread_still_runs_one(
    database_url: str, amqp_url: str
) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_AMQP_URL=amqp_url)
    outcome: list[BaseException] = []

    def relay_for_two_seconds() -> None:
        try:
            run_cli("run", env=env, timeout=2)
        except subprocess.TimeoutExpired as expired:
            outcome.append(expired)

    running = threading.Thread(target=relay_for_two_seconds)
    running.start()
    until(_ZYGOTE.busy, timeout=10, message="the relay to run in the zygote")
    version = run_cli("--version")  # the zygote is busy: a process of its own
    running.join(30)
    assert not running.is_alive()
    assert version.returncode == 0, version.stderr
    assert "outbox-relay" in version.stdout
    assert len(outcome) == 1, "the relay's command did not time out"
    assert not _ZYGOTE.busy()  # free again: the zygote killed the relay and answered


class Interrupted(Exception):
    pass


def test_a_wait_interrupted_as_a_test_timeout_does_leaves_the_next_command_its_own_answer(
    database_url: str, amqp_url: str
) -> None:
    def interrupt(*_: object) -> None:
        raise Interrupted

    env = clean_env(OUTBOX_DATABASE_URL=database_url, OUTBOX_AMQP_URL=amqp_url)
    before = signal.signal(signal.SIGALRM, interrupt)  # as pytest-timeout interrupts a test
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.5)
        with pytest.raises(Interrupted):
            run_cli("run", env=env, timeout=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert not _ZYGOTE.busy()
    version = run_cli("--version")  # not the relay's late answer
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("outbox-relay, version")
    stats = run_cli("stats", env=env)
    assert stats.returncode == 0, stats.stderr
