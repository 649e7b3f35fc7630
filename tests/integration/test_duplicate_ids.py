"""One message_id, one message: a second enqueue of an id that is waiting fails, however the two
transactions interleave, and the broker never gets two messages under one id.

The first transaction enqueues with a generated id (`relay.enqueue` returns it); the second
passes that id explicitly, through `relay.enqueue`, `relay.enqueue_many` or SQL `enqueue()`:

- `open`: the first is still open when the second enqueues (READ COMMITTED). The second may
  wait for the first (a producer waiting on a producer is fine); once the first commits, it fails.
- `open, RR`: the same with the second in REPEATABLE READ.
- `RR snapshot`: the second, in REPEATABLE READ, took its snapshot before the first committed and
  enqueues after that commit: its snapshot does not show the first message.
- `committed`: the first committed before the second began (the plain case).

The outcome is the same in every case, REPEATABLE READ included: `relay.errors.DuplicateMessage`
from the Python API, and for SQL callers SQLSTATE 23505 (unique_violation, which the Python API
translates) with a message (or its detail) naming the message_id or its constraint. Not 40001
(serialization_failure): a retry could not succeed while the first message waits, so "retry me"
would be the wrong thing to tell a caller. (Against a unique index, a plain INSERT gives 23505
under REPEATABLE READ too; INSERT … ON CONFLICT DO NOTHING gives 40001 there.) Then a relay
drains the outbox and the consumer must get each id with the first enqueue's body only.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
from psycopg import IsolationLevel

import relay
from relay import app
from relay.errors import DuplicateMessage
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for
from tests.support.wait import until

TIMINGS = ("open", "open, RR", "RR snapshot", "committed")
Second = Callable[[psycopg.Connection[Any], str, UUID, bytes], object]


def python_enqueue(conn: psycopg.Connection[Any], exchange: str, id_: UUID, body: bytes) -> object:
    return relay.enqueue(conn, exchange, "dup", body, message_id=id_)


def python_enqueue_many(
    conn: psycopg.Connection[Any], exchange: str, id_: UUID, body: bytes
) -> object:
    batch = [
        relay.Message(exchange, "dup", body + b" (other)"),  # must not outlive the batch
        relay.Message(exchange, "dup", body, message_id=id_),
    ]
    return relay.enqueue_many(conn, batch)


def sql_enqueue(conn: psycopg.Connection[Any], exchange: str, id_: UUID, body: bytes) -> object:
    return conn.execute(
        "SELECT outbox.enqueue(%s, 'dup', %s::bytea, message_id => %s::uuid)",
        [exchange, body, id_],
    ).fetchone()


CALLERS: dict[str, Second] = {
    "relay.enqueue": python_enqueue,
    "relay.enqueue_many": python_enqueue_many,
    "SQL enqueue()": sql_enqueue,
}


@dataclasses.dataclass
class Case:
    caller: str
    timing: str
    message_id: UUID | None = None
    outcome: str = "not run"
    refused: bool = False  # as promised: DuplicateMessage, or SQLSTATE 23505 naming the id

    @property
    def first(self) -> bytes:
        return f"first {self.caller} {self.timing}".encode()

    @property
    def second(self) -> bytes:
        return f"second {self.caller} {self.timing}".encode()


def judge(case: Case, exc: BaseException | None) -> None:
    assert case.message_id is not None
    if exc is None:
        case.outcome = "accepted"
    elif isinstance(exc, DuplicateMessage):
        case.outcome, case.refused = "DuplicateMessage", case.caller != "SQL enqueue()"
    elif isinstance(exc, psycopg.Error):
        diag = exc.diag
        text = f"{diag.message_primary} {diag.message_detail}"
        names = str(case.message_id) in text or bool(
            diag.constraint_name and diag.constraint_name in text
        )
        case.outcome = f"SQLSTATE {exc.sqlstate}: {diag.message_primary}"
        case.refused = case.caller == "SQL enqueue()" and exc.sqlstate == "23505" and names
    else:
        case.outcome = f"{type(exc).__name__}: {exc}"


def blocked_by(admin: psycopg.Connection[Any], waiter: int, holder: int) -> bool:
    row = admin.execute("SELECT %s = ANY(pg_blocking_pids(%s))", [holder, waiter]).fetchone()
    return bool(row and row[0])


def race(url: str, exchange: str, case: Case) -> None:
    """Run one case; the second transaction commits whatever it was allowed to write."""
    second = CALLERS[case.caller]
    with (
        psycopg.connect(url) as first,
        psycopg.connect(url) as other,
        psycopg.connect(url, autocommit=True) as admin,
    ):
        if case.timing != "open":
            other.isolation_level = IsolationLevel.REPEATABLE_READ
        if case.timing == "committed":
            other.isolation_level = IsolationLevel.READ_COMMITTED
        case.message_id = relay.enqueue(first, exchange, "dup", case.first)
        if case.timing == "committed":
            first.commit()
        if case.timing in ("open, RR", "RR snapshot"):
            other.execute("SELECT 1")  # the snapshot, taken while the first is open
        if case.timing == "RR snapshot":
            first.commit()
        failure: list[BaseException | None] = []

        def attempt() -> None:
            assert case.message_id is not None
            try:
                second(other, exchange, case.message_id, case.second)
            except Exception as exc:
                failure.append(exc)
            else:
                failure.append(None)

        worker = threading.Thread(target=attempt)
        worker.start()
        if case.timing.startswith("open"):
            pid, holder = other.info.backend_pid, first.info.backend_pid
            until(
                lambda: not worker.is_alive() or blocked_by(admin, pid, holder),
                timeout=10,
                message="the second enqueue to finish or to wait for the first transaction",
            )
            first.commit()
        worker.join(10)
        assert not worker.is_alive(), f"{case.caller}, {case.timing}: still waiting after 10s"
        judge(case, failure[0])
        if failure[0] is None:
            other.commit()
        else:
            other.rollback()


async def drain(database_url: str, amqp_url: str) -> None:
    """A relay publishes everything due, then stops."""
    async with app.components(settings_for(database_url, amqp_url)) as parts:
        await parts.relay.run_until_empty()


async def test_a_message_id_that_is_waiting_cannot_be_enqueued_again(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    # As in production, a relay has run against this database before producers write; none runs
    # while they race, so each first message is still waiting when its id is passed again (an
    # id may be used again once its message is published).
    await drain(database_url, amqp_url)
    cases = [Case(caller, timing) for timing in TIMINGS for caller in CALLERS]
    for case in cases:
        race(database_url, broker.exchange, case)
    await drain(database_url, amqp_url)
    got = await broker.collect(len(cases), distinct=True, settle=1.0)
    bodies: dict[str, set[bytes]] = collections.defaultdict(set)
    for message in got:
        bodies[message.message_id].add(message.body)
    for case in cases:
        print(f"{case.caller:20} {case.timing:12} {case.outcome}")
    wrong = [f"{c.caller}, {c.timing}: {c.outcome}" for c in cases if not c.refused]
    doubled = {m: sorted(b) for m, b in bodies.items() if len(b) > 1}
    ours = {str(c.message_id) for c in cases}
    strays = [b for m, b in bodies.items() if m not in ours]
    figures = (
        f"{len(cases) - len(wrong)} of {len(cases)} second enqueues refused as promised; "
        f"{len(doubled)} ids published as two messages; {len(strays)} of enqueue_many's "
        "other messages published"
    )
    print(figures)
    assert not wrong, f"{figures}; not refused: {wrong}"
    assert not doubled, f"{figures}: {doubled}"
    assert dict(bodies) == {str(c.message_id): {c.first} for c in cases}, figures
