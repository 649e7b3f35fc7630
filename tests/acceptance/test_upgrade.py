"""Upgrades never strand a message. Rolling upgrade, mixed versions, a new relay that fails to
start, a rollback to the old version: every message is delivered within its normal latency.

From each of two earlier releases, installed from git history into a venv of its own (a real
`pip install` of the package that commit builds), and run beside this checkout's relay against one
database, under producers that never stop:

1. the old release's `migrate` and `roles`; its relay runs;
2. this checkout's `migrate` under it, with messages waiting; the old relay relays on;
3. a canary of the new version whose broker login is refused exits non-zero; the old relay, alone
   again, delivers what is committed after it;
4. a new relay joins; the old one stops; this checkout's `roles` narrows the grants;
5. rollback: the new relay stops, the old release's `roles` restores its grants, an old relay
   relays alone;
6. producers stop and everything drains.

Each phase first waits (up to BACKLOG) until every message of the phases before it has arrived,
then markers committed in it must each arrive within LATENCY; at the end the delivered
message_ids are exactly the committed ones (nothing lost, nothing from a rolled-back transaction),
every key's messages arrive in order, and no relay but the canary logged an error. The test looks
only at the broker, at the CLI and the `migrate`/`roles` APIs, and at the `messages` table's row
count: it states the promise, not how a version keeps it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import json
import math
import random
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import aio_pika.abc
import psycopg
import pytest
from psycopg import sql

import relay
from relay.postgres import migrate, roles
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env
from tests.support.wait import until

pytestmark = pytest.mark.slow

#: The old releases, each with the migrations it ships: 21e837a (0001-0009: before the key gate
#: and the relay's functions) and 368e2e9 (0001-0014: the commit before migration 0015).
OLD_RELEASES = {"21e837a": 9, "368e2e9": 14}
REPO = Path(__file__).resolve().parents[2]

#: Normal latency: the relays are woken by NOTIFY and poll every 0.2 s; a message committed while
#: a relay is running goes out in well under a second.
LATENCY = 5.0
#: How long a phase waits for the messages of the phases before it (a backlog) before its markers.
BACKLOG = 60.0
#: Unkeyed markers per phase (keyed ones: one on each of KEYS, and two on a key of their own).
MARKERS = 5
#: The producers' ordering keys (they also send unkeyed messages).
KEYS = [f"key-{i}" for i in range(8)]
#: Messages producers commit in each phase before it ends, so that each runs under traffic.
DWELL = 60


# -- the old releases, each in a venv of its own ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OldRelease:
    """An earlier release installed in `venv`, whose interpreter sees the running venv's packages
    (its dependencies) through a .pth file but imports its own `relay`."""

    rev: str
    venv: Path
    python: Path
    migrations: int  # how many it ships (relay/migrations in its wheel)
    seconds: float  # how long building and installing it took

    @property
    def command(self) -> list[str]:
        """Its interpreter: isolated (-I: no PYTHONPATH, no working directory on sys.path, which
        would bring this checkout's `relay` back), unbuffered (-u: -I ignores PYTHONUNBUFFERED)."""
        return [str(self.python), "-I", "-u"]

    def cli(self, *args: str, env: dict[str, str]) -> str:
        """`outbox-relay ARGS` of this release; its output. AssertionError if it fails."""
        done = subprocess.run(
            [*self.command, "-m", "relay", *args],
            cwd=self.venv,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, f"{self.rev} `{' '.join(args)}`: {done.stderr}"
        return done.stdout

    def relay(self, env: dict[str, str]) -> RelayProcess:
        return RelayProcess(env, python=self.command, cwd=str(self.venv))


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=300)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return _run("git", "-C", str(REPO), *args)


def _history(rev: str) -> None:
    """pytest.fail (never a skip) when the commit is not in this clone's history."""
    try:
        found = _git("cat-file", "-e", f"{rev}^{{commit}}").returncode == 0
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    except FileNotFoundError:
        pytest.fail(f"the upgrade test needs git, to install release {rev} from its history")
    if not found:
        why = "this clone is shallow" if shallow else "the commit is not in this clone"
        pytest.fail(
            f"the upgrade test needs the git history holding release {rev} ({why}): "
            f"fetch it (`git fetch --unshallow`, or clone without --depth) and run it again",
            pytrace=False,
        )


def _install(rev: str, root: Path) -> OldRelease:
    """`git archive REV`, its wheel built by pip (the commit's own build backend, hatchling, which
    pip gets from its index or its cache), a venv with that wheel installed (no dependencies), and
    a .pth file naming the running interpreter's site-packages for them."""
    started = time.monotonic()
    _history(rev)
    src, wheels, venv = root / "src", root / "wheels", root / "venv"
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev],
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert archive.returncode == 0, archive.stderr.decode(errors="replace")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(src, filter="data")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    steps = [
        [*pip, "wheel", "--no-deps", "--wheel-dir", str(wheels), str(src)],
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
    ]
    for argv in steps:
        done = _run(*argv)
        assert done.returncode == 0, f"{rev}: {' '.join(argv)}:\n{done.stdout}{done.stderr}"
    python = venv / "bin" / "python"
    (wheel,) = wheels.glob("*.whl")
    done = _run(
        *pip,
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--no-index",
        "--no-compile",
        str(wheel),
    )
    assert done.returncode == 0, f"{rev}: pip install {wheel.name}:\n{done.stderr}"
    # Only now (pip must not see this checkout's outbox-relay as already installed there): the
    # dependencies, from the running venv, after the venv's own site-packages on sys.path.
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run(str(python), "-I", "-c", ask).stdout.strip())
    running = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_outbox_test_dependencies.pth").write_text("".join(f"{p}\n" for p in running))
    where = _run(str(python), "-I", "-c", "import relay; print(relay.__file__)", cwd=venv)
    assert where.stdout.startswith(str(site)), f"{rev} imports another relay: {where}"
    shipped = len(list((site / "relay" / "migrations").glob("[0-9][0-9][0-9][0-9]_*.sql")))
    return OldRelease(rev, venv, python, shipped, time.monotonic() - started)


class OldReleases:
    """Each old release installed once per session, when a test first asks for it."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._installed: dict[str, OldRelease] = {}

    def get(self, rev: str) -> OldRelease:
        if rev not in self._installed:
            self._installed[rev] = _install(rev, self._root / rev)
        return self._installed[rev]


@pytest.fixture(scope="session")
def old_releases(tmp_path_factory: pytest.TempPathFactory) -> OldReleases:
    return OldReleases(tmp_path_factory.mktemp("releases"))


# -- the database's schema and logins -------------------------------------------------------------


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


def waiting(url: str, schema: str) -> int:
    """Rows in `messages` (waiting or in flight)."""
    with psycopg.connect(url) as conn:
        query = sql.SQL("SELECT count(*) FROM {}.messages").format(sql.Identifier(schema))
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def refused(amqp_url: str) -> str:
    """`amqp_url` with a password the broker refuses."""
    parts = urlsplit(amqp_url)
    netloc = f"{parts.username}:wrong-{uuid.uuid4().hex[:8]}@{parts.hostname}:{parts.port or 5672}"
    return parts._replace(netloc=netloc).geturl()


# -- what producers commit, and what the broker delivers -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Sent:
    phase: str
    key: str | None
    at: float  # time.monotonic() when its commit returned
    marker: bool = False

    @property
    def kind(self) -> str:
        return "unkeyed" if self.key is None else "keyed"


class Ledger:
    """Every message committed, with the phase it was committed in; the rolled-back ones."""

    def __init__(self) -> None:
        self.phase = ""
        self._lock = threading.Lock()
        self._committed: dict[str, Sent] = {}
        self._rolled_back: set[str] = set()

    def committed(self, ids: list[str], key: str | None, *, marker: bool = False) -> float:
        at = time.monotonic()
        with self._lock:
            for message_id in ids:
                self._committed[message_id] = Sent(self.phase, key, at, marker)
        return at

    def rolled_back(self, ids: list[str]) -> None:
        with self._lock:
            self._rolled_back.update(ids)

    def all(self) -> dict[str, Sent]:
        with self._lock:
            return dict(self._committed)

    def never_committed(self) -> set[str]:
        with self._lock:
            return set(self._rolled_back)

    def in_phase(self, phase: str) -> int:
        with self._lock:
            return sum(1 for s in self._committed.values() if s.phase == phase and not s.marker)


class Traffic:
    """Producers committing keyed and unkeyed messages (one in ten rolled back) until stopped."""

    def __init__(self, url: str, schema: str, exchange: str, ledger: Ledger) -> None:
        self._ledger = ledger
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run, args=(url, schema, exchange, n)) for n in range(3)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, url: str, schema: str, exchange: str, n: int) -> None:
        rng = random.Random(n)
        try:
            with psycopg.connect(url) as conn:
                while not self._stop.is_set():
                    key = rng.choice([None, rng.choice(KEYS)])
                    ids = [
                        str(
                            relay.enqueue(conn, exchange, "k", b"", ordering_key=key, schema=schema)
                        )
                        for _ in range(rng.randint(1, 5))
                    ]
                    if rng.random() < 0.1:
                        conn.rollback()
                        self._ledger.rolled_back(ids)
                    else:
                        conn.commit()
                        self._ledger.committed(ids, key)
                    self._stop.wait(0.01)  # a steady trickle, not a flood
        except BaseException as exc:
            self.failure = exc
            raise

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


@dataclasses.dataclass(frozen=True)
class Arrival:
    message_id: str
    key: str | None
    seq: int | None
    at: float  # time.monotonic()


class Deliveries:
    """What the test's queue receives, consumed from the start on a thread (and event loop) of its
    own, so that the test's blocking steps never delay it: arrival times are latencies."""

    def __init__(self, url: str, queue: str) -> None:
        self._url, self._queue = url, queue
        self._lock = threading.Lock()
        self._arrivals: list[Arrival] = []
        self._first: dict[str, float] = {}
        self._consuming, self._stop = threading.Event(), threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._consume()), daemon=True)
        self._thread.start()
        if not self._consuming.wait(30):
            raise AssertionError(f"the test's consumer never started: {self.failure!r}")

    async def _consume(self) -> None:
        try:
            async with await aio_pika.connect(self._url) as connection:
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=1000)
                queue = await channel.get_queue(self._queue, ensure=False)
                await queue.consume(self._on_message, no_ack=True)
                self._consuming.set()
                await asyncio.to_thread(self._stop.wait)
        except BaseException as exc:
            self.failure = exc
            raise

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        at = time.monotonic()
        key = message.headers.get("x-outbox-ordering-key")
        seq = message.headers.get("x-outbox-sequence")
        arrival = Arrival(
            str(message.message_id),
            None if key is None else str(key),
            None if seq is None else int(str(seq)),
            at,
        )
        with self._lock:
            self._arrivals.append(arrival)
            self._first.setdefault(arrival.message_id, at)

    def first(self) -> dict[str, float]:
        """Each message_id's first arrival."""
        with self._lock:
            return dict(self._first)

    def arrivals(self) -> list[Arrival]:
        with self._lock:
            return list(self._arrivals)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def drain(expected: set[str], deliveries: Deliveries) -> None:
    """Wait until every message in `expected` arrived, or nothing more arrives: 10 s without one
    more of them (or 60 s in all); what then is missing was stranded, and the test says so."""
    count, progress = -1, time.monotonic()
    deadline = progress + 60
    while time.monotonic() < deadline and time.monotonic() - progress < 10:
        have = len(expected & deliveries.first().keys())
        if have == len(expected):
            return
        if have != count:
            count, progress = have, time.monotonic()
        time.sleep(0.05)


# -- the figures ---------------------------------------------------------------------------------


def _seconds(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"p50 {statistics.median(values):.2f} s, max {values[-1]:.2f} s"


def phase_table(phases: list[str], ledger: Ledger, first: dict[str, float]) -> str:
    """Per phase: messages committed in it (markers aside), delivered, and of each kind how many
    arrived later than LATENCY and how many never did; latency from commit to first arrival."""
    sent = ledger.all()
    lines = []
    for phase in phases:
        mine = {m: s for m, s in sent.items() if s.phase == phase and not s.marker}
        got = [first[m] - s.at for m, s in mine.items() if m in first]
        late, missing = collections.Counter[str](), collections.Counter[str]()
        for m, s in mine.items():
            if m not in first:
                missing[s.kind] += 1
            elif first[m] - s.at > LATENCY:
                late[s.kind] += 1
        lines.append(
            f"  {phase:<34} delivered {len(got):>5}/{len(mine):<5} "
            f"late (>{LATENCY:g} s) unkeyed {late['unkeyed']:>4} keyed {late['keyed']:>4}; "
            f"missing unkeyed {missing['unkeyed']:>4} keyed {missing['keyed']:>4}; "
            f"{_seconds(got)}"
        )
    return "\n".join(lines)


def error_lines(output: str) -> list[str]:
    """The lines a relay logged at ERROR or worse, its tracebacks, and its last word on failing."""
    found = []
    for line in output.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            if line.startswith(("Traceback", "outbox-relay: error:")):
                found.append(line)
            continue
        if isinstance(record, dict) and record.get("level") in ("ERROR", "CRITICAL"):
            found.append(line)
    return found


# -- the test ------------------------------------------------------------------------------------


# Slow (~20 s and ~19 s, a case each): each old release built into a wheel by pip and installed in
# a venv of its own, then six phases under traffic, four relay processes and three runs of its
# CLI; the promise is about a real install of each release, run beside this checkout.
@pytest.mark.parametrize("old_rev", list(OLD_RELEASES))
async def test_upgrades_and_a_rollback_never_strand_a_message(
    empty_database_url: str,
    amqp_url: str,
    broker: Broker,
    old_releases: OldReleases,
    old_rev: str,
    schema: str,
) -> None:
    old = old_releases.get(old_rev)
    print(f"\n{old.rev}: venv set up in {old.seconds:.1f} s, {old.migrations} migrations")
    assert old.migrations == OLD_RELEASES[old.rev], f"{old.rev} ships {old.migrations} migrations"
    owner = empty_database_url
    owner_env = clean_env(OUTBOX_DATABASE_URL=owner, OUTBOX_SCHEMA=schema)
    old.cli("migrate", env=owner_env)
    old.cli("roles", env=owner_env)
    producer, relay_url = login(owner, schema, "producer"), login(owner, schema, "relay")
    await broker.declare()
    env = clean_env(
        OUTBOX_DATABASE_URL=relay_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_SCHEMA=schema,
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_BATCH_SIZE="20",
        OUTBOX_LOG_FORMAT="json",
    )

    ledger = Ledger()
    phases: list[str] = []
    problems: list[str] = []  # promises broken; the test goes on, to show every phase
    marker_lines: list[str] = []
    relays: list[tuple[str, RelayProcess]] = []  # their output must hold no error
    others: list[tuple[str, RelayProcess]] = []
    started = time.monotonic()

    def phase(name: str) -> None:
        """A new phase: it lasts until producers have committed DWELL messages in it, then its
        markers must each arrive within LATENCY."""
        ledger.phase = name
        phases.append(name)
        until(
            lambda: ledger.in_phase(name) >= DWELL or traffic.failure,
            timeout=30,
            message=f"producers committing {DWELL} messages in phase {name!r}",
        )
        assert traffic.failure is None, f"a producer failed: {traffic.failure!r}"
        markers(name, len(phases))

    def markers(name: str, n: int) -> None:
        # First, what the phases before committed must all arrive (BACKLOG bounds a backlog; a
        # message still missing then is stranded). Only then the markers, which time this
        # phase's own pace: a key's marker is not held to 5 s behind a backlog that a gap
        # between two relays left on its key (under CPU load, the rollback's gap, in which no
        # relay runs, left hundreds of keyed messages, drained one per key per cycle).
        earlier = {m for m, s in ledger.all().items() if s.phase != name}
        deadline = time.monotonic() + BACKLOG
        while time.monotonic() < deadline and not earlier <= deliveries.first().keys():
            time.sleep(0.02)
        stranded = earlier - deliveries.first().keys()
        if stranded:
            problems.append(
                f"phase {name!r}: {len(stranded)} messages of the phases before it still not "
                f"delivered {BACKLOG:g} s after it began"
            )
        sent: dict[str, Sent] = {}
        # Keyed markers: one on each key the producers use (behind whatever the versions before
        # left of it), and two on a new key (the second waits for the first).
        keys: list[str | None] = [None] * MARKERS + [*KEYS] + [f"marker-{n}"] * 2
        with psycopg.connect(producer) as conn:
            for key in keys:
                message_id = str(
                    relay.enqueue(
                        conn, broker.exchange, "marker", b"", ordering_key=key, schema=schema
                    )
                )
                conn.commit()
                at = ledger.committed([message_id], key, marker=True)
                sent[message_id] = Sent(name, key, at, marker=True)
        deadline = max(s.at for s in sent.values()) + LATENCY
        while time.monotonic() < deadline and not sent.keys() <= deliveries.first().keys():
            time.sleep(0.02)
        first = deliveries.first()
        summary = []
        for kind in ("unkeyed", "keyed"):
            mine = {m: s for m, s in sent.items() if s.kind == kind}
            took = [first[m] - s.at for m, s in mine.items() if m in first]
            on_time = sum(1 for t in took if t <= LATENCY)
            summary.append(
                f"{kind} {on_time}/{len(mine)} within {LATENCY:g} s"
                + (f" (slowest {max(took):.2f} s)" if took else "")
            )
            if on_time < len(mine):
                late = sorted(
                    {str(s.key) for m, s in mine.items() if first.get(m, math.inf) - s.at > LATENCY}
                )
                problems.append(
                    f"phase {name!r}: {on_time} of {len(mine)} {kind} markers delivered within "
                    f"{LATENCY:g} s of their commit"
                    + (f" (keys {late})" if kind == "keyed" else "")
                )
        marker_lines.append(f"  {name:<34} markers: {'; '.join(summary)}")

    def start(label: str, proc: RelayProcess) -> RelayProcess:
        relays.append((label, stack.enter_context(proc)))
        return proc

    def stopped(label: str, proc: RelayProcess) -> None:
        code = proc.stop()
        if code != 0:
            problems.append(f"{label} exited {code} on SIGTERM")

    deliveries = Deliveries(amqp_url, broker.queue)
    traffic = Traffic(producer, schema, broker.exchange, ledger)
    try:
        with contextlib.ExitStack() as stack:
            # 1. The old release, installed and relaying.
            old_relay = start(f"old relay ({old.rev})", old.relay(env))
            old_relay.wait_ready()
            phase(f"old {old.rev}")

            # 2. This checkout's migrate under the old relay, with messages waiting.
            with psycopg.connect(producer) as conn:
                burst = [
                    str(relay.enqueue(conn, broker.exchange, "k", b"", schema=schema))
                    for _ in range(200)
                ]
                conn.commit()
                ledger.committed(burst, None)
            before = waiting(owner, schema)
            result = await asyncio.to_thread(migrate.migrate, owner, schema)
            applied = [m.version for m in result.applied]
            assert applied == [m.version for m in migrate.discover() if m.version > old.migrations]
            print(f"migrate applied {applied[0]:04d}-{applied[-1]:04d}, {before} rows waiting")
            phase("migrated, old relay")

            # 3. A canary of the new version that cannot log in to the broker.
            canary_env = {**env, "OUTBOX_AMQP_URL": refused(amqp_url)}
            canary = stack.enter_context(RelayProcess(canary_env))
            others.append(("canary (broker login refused)", canary))
            code = canary.exited(60)
            assert code != 0, f"the canary, refused by the broker, exited {code}:\n{canary.output}"
            # It failed for the reason given (the broker's refusal), not for another one.
            assert "amqp" in canary.output.lower(), canary.output
            phase("after a failed canary, old relay")

            # 4. A new relay beside the old one; the old one stops; this checkout's roles.
            new_relay = start("new relay", RelayProcess(env))
            new_relay.wait_ready()
            phase("old and new relays")
            stopped(f"old relay ({old.rev})", old_relay)
            await asyncio.to_thread(roles.ensure, owner, schema)
            phase("new relay, its roles")

            # 5. Rollback: the new relay stops, the old release's roles, an old relay alone.
            stopped("new relay", new_relay)
            old.cli("roles", env=owner_env)
            rolled_back = start(f"old relay again ({old.rev})", old.relay(env))
            rolled_back.wait_ready()
            phase(f"rolled back to {old.rev}")

            # 6. Producers stop; everything drains, through the old relay.
            traffic.stop()
            ledger.phase = "drain"
            drain(set(ledger.all()), deliveries)
            stopped(f"old relay again ({old.rev})", rolled_back)
    except BaseException:
        for label, proc in relays + others:  # what each relay said, to see which one failed and why
            print(f"---- {label}:\n{proc.output[-6000:]}")
        raise
    finally:
        traffic.stop()
        deliveries.stop()
    assert traffic.failure is None, f"a producer failed: {traffic.failure!r}"
    assert deliveries.failure is None, f"the test's consumer failed: {deliveries.failure!r}"

    sent, first = ledger.all(), deliveries.first()
    lost = sent.keys() - first.keys()
    if lost:
        keys = collections.Counter(str(sent[m].key) for m in lost if sent[m].key)
        problems.append(
            f"{len(lost)} of {len(sent)} committed messages never delivered "
            f"({len(lost) - keys.total()} unkeyed, {keys.total()} keyed"
            + (f": {dict(sorted(keys.items()))})" if keys else ")")
        )
    ghosts = first.keys() & ledger.never_committed()
    if ghosts:
        problems.append(f"{len(ghosts)} messages of rolled-back transactions were delivered")
    strangers = first.keys() - sent.keys() - ghosts
    if strangers:
        problems.append(f"{len(strangers)} deliveries of message_ids nobody committed")

    firsts: dict[str, list[int]] = collections.defaultdict(list)
    highest: dict[str, int] = {}
    seen: set[str] = set()
    backwards: list[str] = []
    for arrival in deliveries.arrivals():
        key, seq = arrival.key, arrival.seq
        if key is None or seq is None:
            continue
        if seq < highest.get(key, 0):
            backwards.append(f"{key}#{seq} after #{highest[key]}")
        highest[key] = max(seq, highest.get(key, 0))
        if arrival.message_id not in seen:
            firsts[key].append(seq)
        seen.add(arrival.message_id)
    if backwards:
        problems.append(f"{len(backwards)} arrived after a successor (by key): {backwards[:5]}")
    for key, seqs in firsts.items():
        if seqs != list(range(1, len(seqs) + 1)):
            problems.append(f"{key}: first deliveries out of order, from {seqs[:20]}")

    for label, proc in relays:
        errors = error_lines(proc.output)
        if errors:
            problems.append(f"{label} logged {len(errors)} errors, the first: {errors[0]}")

    figures = "\n".join(
        [
            f"{old.rev} -> this checkout, {time.monotonic() - started:.1f} s "
            f"(venv set-up {old.seconds:.1f} s apart):",
            phase_table(phases, ledger, first),
            *marker_lines,
            f"  in all: delivered {len(sent.keys() & first.keys())}/{len(sent)}, "
            f"{len(deliveries.arrivals())} deliveries, "
            f"{len(ledger.never_committed())} rolled back",
        ]
    )
    print(figures)
    if problems:
        for label, proc in relays + others:
            print(f"---- {label}, its last lines:\n{proc.output[-3000:]}")
    assert not problems, "\n".join(["upgrades stranded messages:", *problems, figures])
