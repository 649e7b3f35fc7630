"""A rolling upgrade under traffic: the previous release's relay (taken from git) keeps relaying
while this release's `migrate` runs under it, with messages waiting and producers committing;
this release's relay takes over; `roles` then narrows the grants. Nothing is lost, nothing from a
rolled-back transaction goes out, and every key arrives in order."""

from __future__ import annotations

import asyncio
import collections
import io
import random
import subprocess
import sys
import tarfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

import relay
from relay.postgres import migrate, roles
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env
from tests.support.wait import until

pytestmark = pytest.mark.slow

#: The last release before migrations 0010 onwards (the key gate, the relay's functions, the ready
#: lane, …): the upgrade applies every migration from FIRST_NEW on.
PREVIOUS = "21e837a"
FIRST_NEW = 10
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def previous_release(tmp_path: Path) -> Path:
    """A folder whose `relay` package and `sql` migrations are the previous release's."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", PREVIOUS, "relay", "sql"],
            capture_output=True,
            check=True,
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip(f"needs the git history holding the previous release ({PREVIOUS})")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path


@pytest.fixture
def schema(empty_database_url: str) -> Iterator[str]:
    """A schema name of this test's own (role names are global); its roles dropped afterwards."""
    name = f"u{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        found = [
            str(r)
            for (r,) in conn.execute(
                "SELECT rolname FROM pg_roles WHERE rolname LIKE %s", [f"{name}\\_%"]
            )
        ]
        for role in found:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
    admin = urlsplit(empty_database_url)._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        for role in found:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def login(owner_url: str, schema: str, job: str) -> str:
    """A login user holding `job`'s role; its URL."""
    name = f"{schema}_{job}_login"
    with psycopg.connect(owner_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(name), sql.Identifier(f"{schema}_{job}")
            )
        )
    parts = urlsplit(owner_url)
    return parts._replace(netloc=f"{name}@{parts.hostname}:{parts.port or 5432}").geturl()


def install(release: Path, owner_url: str, schema: str) -> None:
    """`migrate` and `roles` of the release in `release`, as it was installed."""
    env = clean_env(OUTBOX_DATABASE_URL=owner_url, OUTBOX_SCHEMA=schema)
    for command in ("migrate", "roles"):
        done = subprocess.run(
            [sys.executable, "-m", "relay", command],
            cwd=release,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr


class Traffic:
    """Producers committing keyed and unkeyed messages (one in ten rolled back) until stopped."""

    def __init__(self, url: str, schema: str, exchange: str) -> None:
        self.committed: set[str] = set()
        self.rolled_back: set[str] = set()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, schema, exchange, n)) for n in range(3)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, url: str, schema: str, exchange: str, n: int) -> None:
        rng = random.Random(n)
        with psycopg.connect(url) as conn:
            while not self._stop.is_set():
                key = rng.choice([None, f"key-{rng.randrange(8)}"])
                ids = [
                    str(relay.enqueue(conn, exchange, "k", b"", ordering_key=key, schema=schema))
                    for _ in range(rng.randint(1, 5))
                ]
                if rng.random() < 0.1:
                    conn.rollback()
                    self.rolled_back.update(ids)
                else:
                    conn.commit()
                    self.committed.update(ids)
                self._stop.wait(0.01)  # a steady trickle, not a flood

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def archived(url: str, schema: str) -> int:
    with psycopg.connect(url) as conn:
        query = sql.SQL("SELECT count(*) FROM {}.archive").format(sql.Identifier(schema))
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def ready_rows(url: str, schema: str) -> int:
    with psycopg.connect(url) as conn:
        query = sql.SQL("SELECT count(*) FROM {}.done").format(sql.Identifier(schema))
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def more_archived(url: str, schema: str, than: int) -> int:
    return until(lambda: archived(url, schema) > than + 50 and archived(url, schema), timeout=60)


async def test_a_rolling_upgrade_under_traffic_loses_nothing_and_keeps_keys_in_order(
    empty_database_url: str,
    amqp_url: str,
    broker: Broker,
    previous_release: Path,
    schema: str,
) -> None:
    owner = empty_database_url
    await asyncio.to_thread(install, previous_release, owner, schema)
    producer, relay_url = login(owner, schema, "producer"), login(owner, schema, "relay")
    await broker.declare()
    env = clean_env(
        OUTBOX_DATABASE_URL=relay_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_SCHEMA=schema,
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_BATCH_SIZE="20",
    )
    traffic = Traffic(producer, schema, broker.exchange)
    procs: list[RelayProcess] = []
    try:
        with RelayProcess(env, cwd=str(previous_release)) as old:
            procs.append(old)
            old.wait_ready()
            seen = more_archived(owner, schema, 0)
            result = migrate.migrate(owner, schema)  # under the old relay, messages waiting
            assert [m.version for m in result.applied] == [
                m.version for m in migrate.discover() if m.version >= FIRST_NEW
            ]
            seen = more_archived(owner, schema, seen)  # the old relay relays on
            with RelayProcess(env) as new:
                procs.append(new)
                new.wait_ready()  # producers now use the ready lane (0015), which only it reads
                seen = more_archived(owner, schema, seen)  # both relays side by side
                assert old.stop() == 0, old.output
                roles.ensure(owner, schema)  # after the rollout: the narrowed grants
                seen = more_archived(owner, schema, seen)
                traffic.stop()
                until(lambda: archived(owner, schema) >= len(traffic.committed), timeout=60)
                assert new.stop() == 0, new.output
            for proc in (old, new):
                assert '"level": "ERROR"' not in proc.output, proc.output
    except BaseException:
        for proc in procs:  # what each relay said, to see which one failed and why
            print(f"---- {'old' if proc is procs[0] else 'new'} relay:\n{proc.output[-6000:]}")
        raise
    finally:
        traffic.stop()
    assert ready_rows(owner, schema) > 0  # the new relay's lane was in use
    got = await broker.collect(len(traffic.committed), timeout=60, settle=0.5)
    assert {g.message_id for g in got} == traffic.committed
    firsts: dict[str, list[int]] = collections.defaultdict(list)
    highest: dict[str, int] = {}
    seen_ids: set[str] = set()
    for g in got:
        key, seq = g.headers.get("x-outbox-ordering-key"), g.headers.get("x-outbox-sequence")
        if key is None or seq is None:
            continue
        assert seq >= highest.get(key, 0), f"{key}#{seq} arrived after a successor"
        highest[key] = max(seq, highest.get(key, 0))
        if g.message_id not in seen_ids:
            firsts[key].append(seq)
        seen_ids.add(g.message_id)
    for key, seqs in firsts.items():
        assert seqs == list(range(1, len(seqs) + 1)), f"{key}: {seqs}"
