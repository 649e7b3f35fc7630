"""Fixtures shared by the suite: real services, a fresh migrated database per test, a broker."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from relay.postgres import migrate
from tests.support import amqp, databases, services


@pytest.fixture(autouse=True)
def _hermetic_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings come from each test, never from the developer's shell (OUTBOX_TEST_* excepted)."""
    for name in list(os.environ):
        if name.startswith("OUTBOX_") and not name.startswith("OUTBOX_TEST_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def svc() -> Iterator[services.Services]:
    try:
        with services.discover() as found:
            yield found
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


def _admin(svc: services.Services) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(svc.database_url, autocommit=True)


@pytest.fixture(scope="session")
def template_db(svc: services.Services) -> Iterator[str]:
    """A database migrated once per worker; each test gets a copy of it (`database_url`)."""
    name = f"outbox_template_{os.getpid()}"
    with _admin(svc) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate.migrate(svc.with_database(name), "outbox")
    yield name
    with _admin(svc) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _fresh_database(svc: services.Services, template: str) -> Iterator[str]:
    name = databases.create(svc.database_url, template)
    try:
        yield svc.with_database(name)
    finally:
        databases.drop(svc.database_url, name)


@pytest.fixture(scope="session")
def _copies(svc: services.Services, template_db: str) -> Iterator[databases.Copies]:
    copies = databases.Copies(svc.database_url, svc.with_database, template_db)
    yield copies
    copies.close()


@pytest.fixture
def database_url(svc: services.Services, _copies: databases.Copies) -> Iterator[str]:
    """A migrated database of this test's own: equal to a fresh copy of the template, and out of
    reach of anything an earlier test left running (tests/support/databases.py)."""
    for name in databases.each(_copies):
        yield svc.with_database(name)


@pytest.fixture
def empty_database_url(svc: services.Services) -> Iterator[str]:
    """A database with no outbox schema at all."""
    yield from _fresh_database(svc, "template1")


@pytest.fixture
def amqp_url(svc: services.Services) -> str:
    return svc.amqp_url


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[amqp.Broker]:
    """An exchange and a queue named for this test alone (declared by the test), deleted after."""
    async with amqp.broker(amqp_url) as b:
        yield b


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port where nothing listens (bound, never listening: connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


# -- budgets: what each test took, for tests/support/budget.py ---------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="write each test's setup + call + teardown seconds and the run's wall time as JSON",
    )


class _Durations:
    """On the controller (xdist hands it every worker's reports), or in a run without workers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.tests: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        wall = time.monotonic() - self.started
        self.path.write_text(json.dumps({"wall": wall, "tests": self.tests}))


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("record_durations")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Durations(Path(path)), "outbox-durations")
