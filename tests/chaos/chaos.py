"""The chaos suite: relays killed, the broker restarted, sessions terminated — and nothing lost.

    .venv/bin/python tests/chaos/chaos.py                          # short form (as CI runs it)
    .venv/bin/python tests/chaos/chaos.py --messages 100000 --kills 50 --rate 1000   # long form

Three `outbox-relay run` processes share one outbox while producers commit messages from
several connections in transactions of 1 to 50 rows, about one in ten rolled back; some write to
several ordering keys at once, and one producer runs at REPEATABLE READ (retrying on 40001). Every
`--kill-every` seconds a random relay is SIGKILLed and restarted; the broker is restarted at a
third of the run; every relay database session is terminated at two thirds. Then the queue is
drained and every figure printed. Duplicates are allowed only where a message's archive row
shows the sends that explain them (claims and ambiguous re-sends): a copy beyond that is a bug.
Over every copy that arrives (not only first arrivals): a message's `x-outbox-attempt` never goes
down from one copy to the next, and no keyed message arrives after its successor did.
Services come from OUTBOX_TEST_DATABASE_URL / OUTBOX_TEST_AMQP_URL (default: the local ones).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import relay
from relay.postgres import migrate
from tests.support import services
from tests.support.processes import RelayProcess, clean_env


@dataclasses.dataclass
class Plan:
    messages: int = 3000
    kills: int = 6
    kill_every: float = 2.0
    rate: float | None = None  # committed messages/s; default: spread over the kills
    producers: int = 4
    relays: int = 3

    @property
    def messages_per_second(self) -> float:
        """So that production lasts as long as the kills do, and every kill hits traffic."""
        return self.rate or self.messages / max(1.0, self.kills * self.kill_every)


@dataclasses.dataclass
class Report:
    committed: int = 0
    rolled_back: int = 0
    delivered: int = 0  # distinct committed message_ids that reached the queue
    copies: int = 0  # every message the consumer received
    lost: int = 0
    leaked: int = 0  # delivered although its transaction rolled back
    strangers: int = 0  # delivered but never enqueued by this run
    duplicates: int = 0
    unexplained: int = 0  # copies beyond what the archive row's sends explain
    keyed: int = 0  # distinct keyed messages delivered
    out_of_order: int = 0  # keys whose first arrivals were not numbered 1, 2, 3…
    overtaken: int = 0  # copies of a keyed message that arrived after its successor
    regressed: int = 0  # copies carrying a lower attempt number than an earlier copy
    multi_key: int = 0  # committed transactions that wrote to several keys
    rechecks: int = 0  # keyed rows whose commit raced their predecessor's settle (key_checks)
    serialization_retries: int = 0  # REPEATABLE READ transactions retried after a 40001
    left_waiting: int = 0
    archived: int = 0
    dead: int = 0
    kills: int = 0
    broker_restarts: int = 0
    sessions_terminated: int = 0
    relay_exit_codes: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.leaked == 0
            and self.strangers == 0
            and self.unexplained == 0
            and self.out_of_order == 0
            and self.overtaken == 0
            and self.regressed == 0
            and self.left_waiting == 0
            and self.archived == self.committed
            and self.dead == 0
            and all(code == 0 for code in self.relay_exit_codes)
        )

    def lines(self) -> list[str]:
        return [
            f"committed                  {self.committed}",
            f"rolled back                {self.rolled_back}",
            f"delivered (distinct ids)   {self.delivered}",
            f"lost                       {self.lost}  (must be 0)",
            f"from rolled-back txns      {self.leaked}  (must be 0)",
            f"never enqueued             {self.strangers}  (must be 0)",
            f"duplicates                 {self.duplicates}  of {self.copies} received",
            f"  unexplained by sends     {self.unexplained}  (must be 0)",
            f"keyed (50 keys)            {self.keyed}",
            f"  keys out of order        {self.out_of_order}  (must be 0)",
            f"  copies after a successor {self.overtaken}  (must be 0)",
            f"attempt lower than before  {self.regressed}  (must be 0)",
            f"multi-key transactions     {self.multi_key}",
            f"commits racing a settle    {self.rechecks}  (rechecks queued, never waited for)",
            f"40001 retries (REP. READ)  {self.serialization_retries}",
            f"rows left waiting          {self.left_waiting}  (must be 0)",
            f"archived                   {self.archived}  (must equal committed)",
            f"dead                       {self.dead}  (must be 0)",
            f"relay kills (SIGKILL)      {self.kills}",
            f"broker restarts            {self.broker_restarts}",
            f"relay sessions terminated  {self.sessions_terminated}",
            f"relay exit codes at stop   {self.relay_exit_codes}",
            f"wall time                  {self.seconds:.1f}s",
            "RESULT                     " + ("ok" if self.ok else "FAILED"),
        ]


class Producers:
    """Threads committing (or rolling back) transactions of 1–50 messages at a bounded rate."""

    def __init__(self, url: str, exchange: str, plan: Plan) -> None:
        self.committed: set[str] = set()
        self.rolled_back: set[str] = set()
        self.multi_key = 0
        self.retries = 0
        self.errors: list[Exception] = []
        self._lock = threading.Lock()
        self._url, self._exchange, self._plan = url, exchange, plan
        self._started = time.monotonic()
        self._threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True)
            for n in range(plan.producers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        if self.errors:
            raise RuntimeError(f"a producer failed: {self.errors[0]!r}") from self.errors[0]

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads) and not self.errors

    @property
    def progress(self) -> float:
        with self._lock:
            return len(self.committed) / self._plan.messages

    def _run(self, n: int) -> None:
        try:
            self._produce(n)
        except Exception as exc:  # surfaced by join(); the disruptor stops waiting on `alive`
            self.errors.append(exc)

    def _produce(self, n: int) -> None:
        rng = random.Random(n)
        with psycopg.connect(self._url) as conn:
            if n == 0:  # one producer at REPEATABLE READ: keyed enqueues may fail with 40001
                conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            while True:
                with self._lock:
                    if len(self.committed) >= self._plan.messages:
                        return
                    elapsed = time.monotonic() - self._started
                    ahead = len(self.committed) - self._plan.messages_per_second * elapsed
                if ahead > 0:
                    time.sleep(ahead / self._plan.messages_per_second)  # keep to the planned rate
                    continue
                self._transaction(conn, n, rng)

    def _transaction(self, conn: psycopg.Connection[Any], n: int, rng: random.Random) -> None:
        """One transaction of 1–50 messages: half of them to ordering keys (one key, or, one in
        four, several keys taken in sorted order), about one in ten rolled back."""
        size = rng.randint(1, 50)
        keys: Sequence[str | None] = [None]
        if rng.random() < 0.5:
            keys = sorted(f"chaos-{k}" for k in rng.sample(range(50), rng.choice([1, 1, 1, 2, 3])))
        try:
            ids = [
                str(
                    relay.enqueue(
                        conn,
                        self._exchange,
                        f"p{n}",
                        {"producer": n, "i": i},
                        ordering_key=keys[i * len(keys) // size],
                    )
                )
                for i in range(size)
            ]
            if rng.random() < 0.1:
                conn.rollback()
                with self._lock:
                    self.rolled_back.update(ids)
                return
            conn.commit()
        except psycopg.errors.SerializationFailure:
            conn.rollback()  # the application retries its transaction (never the outbox's fault
            with self._lock:  # at READ COMMITTED; docs/guides/ordering-keys.md, Isolation levels)
                self.retries += 1
            return
        with self._lock:
            self.committed.update(ids)
            self.multi_key += len(keys) > 1


class Relays:
    """N `outbox-relay run` processes, each restarted at once when the monkey kills it."""

    def __init__(self, env: dict[str, str], n: int) -> None:
        self._env = env
        self.procs = [RelayProcess(env) for _ in range(n)]
        for proc in self.procs:
            proc.wait_ready()

    def kill_one(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.procs))
        self.procs[i].kill()
        self.procs[i] = RelayProcess(self._env)

    def stop(self) -> list[int]:
        """SIGTERM each relay once it is ready (a process still importing Python cannot handle
        signals yet); their exit codes."""
        for proc in self.procs:
            proc.wait_ready(timeout=60)
        return [proc.stop(timeout=60) for proc in self.procs]

    def kill_all(self) -> None:
        for proc in self.procs:
            proc.__exit__(None)


def _scalar(url: str, sql: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql).fetchone()
        return int(row[0]) if row else 0


async def _declare(amqp_url: str, name: str) -> None:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(name, durable=True)
        await queue.bind(exchange, "#")


Arrival = tuple[str, str | None, int | None, int]  # message_id, ordering key, sequence, attempt


async def _drain(amqp_url: str, name: str, expected: set[str]) -> list[Arrival]:
    """Every message in the queue, in arrival order; stops once every expected id arrived and
    the queue has been quiet for a second."""
    received: list[Arrival] = []
    seen: set[str] = set()
    last = time.monotonic()
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2000)
        queue = await channel.declare_queue(name, durable=True, passive=True)
        deadline = time.monotonic() + 300
        # A consumer feeding a local queue, not queue.iterator(): aio-pika 10 closes an iterator
        # whose __anext__ is cancelled, so the first quiet second ended the drain early.
        inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        tag = await queue.consume(inbox.put)
        while time.monotonic() < deadline:
            try:
                message = await asyncio.wait_for(inbox.get(), 1.0)
            except TimeoutError:
                if expected <= seen or time.monotonic() - last > 30:
                    break
                continue
            await message.ack()
            key = message.headers.get("x-outbox-ordering-key")
            seq = message.headers.get("x-outbox-sequence")
            attempt = message.headers.get("x-outbox-attempt")
            received.append((str(message.message_id), key, seq, attempt))  # type: ignore[arg-type]
            seen.add(received[-1][0])
            last = time.monotonic()
        await queue.cancel(tag)
        await channel.queue_delete(name)
        await channel.exchange_delete(name)
    return received


@contextmanager
def _scratch_database(svc: services.Services) -> Iterator[str]:
    name = f"outbox_chaos_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(svc.database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield svc.with_database(name)
    finally:
        with psycopg.connect(svc.database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(svc: services.Services, plan: Plan, echo: Callable[[str], object] = print) -> Report:
    """One chaos run against `svc`; returns its figures (see Report.ok)."""
    report = Report()
    rng = random.Random(42)
    name = f"outbox-chaos.{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with _scratch_database(svc) as url:
        migrate.migrate(url, "outbox")
        asyncio.run(_declare(svc.amqp_url, name))
        env = clean_env(
            OUTBOX_DATABASE_URL=url,
            OUTBOX_AMQP_URL=svc.amqp_url,
            OUTBOX_LEASE="2",
            OUTBOX_POLL_INTERVAL="0.5",
            OUTBOX_BATCH_SIZE="200",
            OUTBOX_SHUTDOWN_TIMEOUT="10",
        )
        relays = Relays(env, plan.relays)
        producers = Producers(url, name, plan)
        monkey = threading.Thread(target=_monkey, args=(relays, plan, report, rng, echo))
        disruptor = threading.Thread(target=_disrupt, args=(svc, url, producers, report, echo))
        try:
            producers.start()
            monkey.start()
            disruptor.start()
            for thread in (monkey, disruptor):
                thread.join()
            producers.join()
            deadline = time.monotonic() + 300
            while (
                _scalar(url, "SELECT count(*) FROM outbox.messages") and time.monotonic() < deadline
            ):
                # Both lanes: `messages` alone can be empty while the ring still holds
                # rows that a killed relay's claim sends back to `messages` later.
                time.sleep(0.5)  # waiting for the relays to drain the rest
            report.relay_exit_codes = relays.stop()
        finally:
            relays.kill_all()
        report.seconds = time.monotonic() - started
        received = asyncio.run(_drain(svc.amqp_url, name, producers.committed))
        _tally(report, url, producers, received)
    return report


def _monkey(
    relays: Relays, plan: Plan, report: Report, rng: random.Random, echo: Callable[[str], object]
) -> None:
    """Kill a random relay every `kill_every` seconds (a supervisor restarts it at once)."""
    while report.kills < plan.kills:
        time.sleep(plan.kill_every)  # the monkey's rhythm
        relays.kill_one(rng)
        report.kills += 1
        echo(f"chaos: killed a relay ({report.kills}/{plan.kills})")


def _disrupt(
    svc: services.Services,
    url: str,
    producers: Producers,
    report: Report,
    echo: Callable[[str], object],
) -> None:
    """Restart the broker at a third of the traffic, terminate relay sessions at two thirds."""
    while producers.progress < 1 / 3 and producers.alive:
        time.sleep(0.05)  # polling the producers' progress
    echo("chaos: restarting the broker")
    svc.broker_ctl("stop_app")
    svc.broker_ctl("start_app")
    report.broker_restarts += 1
    while producers.progress < 2 / 3 and producers.alive:
        time.sleep(0.05)
    report.sessions_terminated = _scalar(
        url,
        "SELECT count(pg_terminate_backend(pid))"
        " FROM pg_stat_activity WHERE application_name ="
        " 'outbox-relay' AND datname = current_database()",
    )
    echo(f"chaos: terminated {report.sessions_terminated} relay database sessions")


def _tally(report: Report, url: str, producers: Producers, received: list[Arrival]) -> None:
    copies = collections.Counter(m for m, _, _, _ in received)
    report.keyed, report.out_of_order = _order(received)
    report.overtaken, report.regressed = _every_copy(received)
    report.multi_key = producers.multi_key
    report.serialization_retries = producers.retries
    committed = producers.committed
    report.committed = len(committed)
    report.rolled_back = len(producers.rolled_back)
    report.copies = len(received)
    report.delivered = len(set(copies) & committed)
    report.lost = len(committed - set(copies))
    report.leaked = len(set(copies) & producers.rolled_back)
    report.strangers = len(set(copies) - committed - producers.rolled_back)
    report.duplicates = report.copies - len(copies)
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT message_id::text, attempts + ambiguous FROM outbox.archive")
        sends: dict[str, int] = dict(rows.fetchall())
    report.unexplained = sum(max(0, n - sends.get(m, 0)) for m, n in copies.items())
    report.left_waiting = _scalar(url, "SELECT count(*) FROM outbox.messages")
    report.archived = _scalar(url, "SELECT count(*) FROM outbox.archive")
    report.dead = _scalar(url, "SELECT count(*) FROM outbox.dead")
    report.rechecks = _scalar(
        url,
        "SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables"
        " WHERE schemaname = 'outbox' AND relname = 'key_checks'",
    )


def _order(received: list[Arrival]) -> tuple[int, int]:
    """How many keyed messages arrived, and how many keys broke order: each key's messages, by
    first arrival (copies may repeat), must be numbered 1, 2, 3… with nothing skipped."""
    firsts: dict[str, list[int]] = collections.defaultdict(list)
    seen: set[str] = set()
    for message_id, key, seq, _ in received:
        if key is not None and seq is not None and message_id not in seen:
            firsts[key].append(seq)
        seen.add(message_id)
    broken = sum(seqs != list(range(1, len(seqs) + 1)) for seqs in firsts.values())
    return sum(len(seqs) for seqs in firsts.values()), broken


def _every_copy(received: list[Arrival]) -> tuple[int, int]:
    """Over every copy, in arrival order: how many keyed copies arrived after their successor
    had, and how many carried a lower attempt number than an earlier copy of the same message."""
    highest: dict[str, int] = {}
    attempts: dict[str, int] = {}
    overtaken = regressed = 0
    for message_id, key, seq, attempt in received:
        if key is not None and seq is not None:
            overtaken += seq < highest.get(key, 0)
            highest[key] = max(seq, highest.get(key, 0))
        regressed += attempt < attempts.get(message_id, 0)
        attempts[message_id] = max(attempt, attempts.get(message_id, 0))
    return overtaken, regressed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Plan()
    parser.add_argument("--messages", type=int, default=defaults.messages)
    parser.add_argument("--kills", type=int, default=defaults.kills)
    parser.add_argument("--kill-every", type=float, default=defaults.kill_every)
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="committed messages/s (default: spread over the kills)",
    )
    parser.add_argument("--producers", type=int, default=defaults.producers)
    args = parser.parse_args()
    plan = Plan(args.messages, args.kills, args.kill_every, args.rate, args.producers)
    with services.discover() as svc:
        report = run(svc, plan)
    print("\n".join(report.lines()))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
