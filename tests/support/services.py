"""Where the tests find PostgreSQL and RabbitMQ: env vars, then the local defaults, then Docker."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from relay.postgres import migrate

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


@dataclasses.dataclass
class Services:
    database_url: str  # a superuser connection to a maintenance database (creates test databases)
    amqp_url: str
    broker_ctl: Callable[..., str]  # runs `rabbitmqctl ARGS…` wherever the broker lives
    database_ctl: Callable[..., None] | None  # `pg_ctlcluster … VERB [OPTIONS]`, a local cluster

    def with_database(self, name: str) -> str:
        """The admin URL pointed at database `name`."""
        return urlsplit(self.database_url)._replace(path=f"/{name}").geturl()

    @contextlib.contextmanager
    def scratch_database(self, prefix: str) -> Iterator[str]:
        """A new database with the outbox schema migrated, dropped on exit; its URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            url = self.with_database(name)
            migrate.migrate(url, "outbox")
            yield url
        finally:
            with psycopg.connect(self.database_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1.0
        ):
            return True
    except OSError:
        return False


def _docker_works() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=20)
    return probe.returncode == 0


def _local_pg_ctlcluster() -> Callable[..., None] | None:
    """Control of the machine's own PostgreSQL cluster, if it has one (Debian's layout)."""
    versions = sorted(Path("/etc/postgresql").glob("*/main"))
    if not versions or shutil.which("pg_ctlcluster") is None:
        return None
    version = versions[-1].parent.name

    def ctl(verb: str, *options: str) -> None:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", verb, *options],
            check=True,
            capture_output=True,
            timeout=120,
        )

    return ctl


def _local_rabbitmqctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], check=True, capture_output=True, text=True, timeout=120
    )
    return done.stdout


@contextlib.contextmanager
def discover() -> Iterator[Services]:
    """Use OUTBOX_TEST_DATABASE_URL / OUTBOX_TEST_AMQP_URL (defaulting to the local servers);
    start containers with testcontainers only for a service that is unreachable and only when a
    Docker engine answers. Raises RuntimeError naming what is missing otherwise."""
    database_url = os.environ.get("OUTBOX_TEST_DATABASE_URL", DEFAULT_DATABASE_URL)
    amqp_url = os.environ.get("OUTBOX_TEST_AMQP_URL", DEFAULT_AMQP_URL)
    broker_ctl: Callable[..., str] = _local_rabbitmqctl
    database_ctl = _local_pg_ctlcluster()
    with contextlib.ExitStack() as stack:
        pg_up, mq_up = reachable(database_url, 5432), reachable(amqp_url, 5672)
        if not (pg_up and mq_up):
            if not _docker_works():
                missing = [
                    name
                    for name, up in (
                        ("PostgreSQL at " + database_url, pg_up),
                        ("RabbitMQ at " + amqp_url, mq_up),
                    )
                    if not up
                ]
                raise RuntimeError(
                    f"unreachable: {', '.join(missing)}; start them (see "
                    "DEVELOPERS.md) or set OUTBOX_TEST_DATABASE_URL / "
                    "OUTBOX_TEST_AMQP_URL, or run a Docker engine"
                )
            if not pg_up:
                database_url = stack.enter_context(_postgres_container())
                database_ctl = None
            if not mq_up:
                amqp_url, broker_ctl = stack.enter_context(_rabbitmq_container())
        yield Services(database_url, amqp_url, broker_ctl, database_ctl)


@contextlib.contextmanager
def _postgres_container() -> Iterator[str]:
    from testcontainers.community.postgres import PostgresContainer

    with PostgresContainer("postgres:16", driver=None) as container:
        yield str(container.get_connection_url())


@contextlib.contextmanager
def _rabbitmq_container() -> Iterator[tuple[str, Callable[..., str]]]:
    from testcontainers.community.rabbitmq import RabbitMqContainer

    with RabbitMqContainer("rabbitmq:3.13") as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(5672)

        def ctl(*args: str) -> str:
            result: Any = container.exec(["rabbitmqctl", "-q", *args])
            if result.exit_code != 0:
                raise RuntimeError(f"rabbitmqctl {args} failed: {result.output!r}")
            return str(result.output)

        yield f"amqp://guest:guest@{host}:{port}/", ctl
