"""One migrate, one pruner, one pipeline run at a time per schema, through PgBouncer too."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from relay.core import errors
from relay.postgres import pg, sql

log = logging.getLogger("relay.locks")

#: How long a waiting `migrate` sleeps between tries at most (it backs off up to this).
MOST_BETWEEN_TRIES = 1.0
#: After this long waiting, a `migrate` says who holds the lock.
SAY_WHO_AFTER = 5.0


class Held:
    """The lock for one job, or not (`bool(held)`); `check()` before each step of the work."""

    def __init__(self, conn: psycopg.Connection[Any] | None, what: str, alive: Any = None) -> None:
        self._conn = conn
        self._what = what
        self._alive = alive  # the query that asks the holder's connection whether it still is

    def __bool__(self) -> bool:
        return self._conn is not None

    def check(self) -> None:
        """RelayError if the lock was lost (its connection ended: a killed session, a dropped
        connection, a pooler's timeout): the job must stop, or two could overlap."""
        if self._conn is None:
            raise errors.RelayError(f"the {self._what} lock is not held")
        try:
            self._conn.execute(self._alive).fetchone()
        except psycopg.Error:
            raise errors.RelayError(
                f"lost the {self._what} lock (its connection ended); stopped so that no other "
                f"{self._what} runs beside this one: run it again"
            ) from None


@contextlib.contextmanager
def exclusive(
    conninfo: str, schema: str, what: str, *, wait: bool, pooled: bool = False
) -> Iterator[Held]:
    """Hold the schema's lock for `what` (migrate, prune, pipeline) while the block runs: a
    transaction-scoped lock in a READ COMMITTED transaction left open on a connection of its own
    (queries/locks.sql), so it excludes through a transaction-mode pooler too, and holds back
    neither vacuum nor an export horizon. The block works on other connections and calls
    `check()` between steps. With `wait`, tries until it gets it (in short transactions, so
    that waiters hold no pooled connection), saying who holds it after SAY_WHO_AFTER; else yields
    a falsy Held at once if another run has it. DatabaseUnavailable if the database is down."""
    q = sql.load(schema)
    name = {"name": f"{pg.APPLICATION_NAME} {what} {schema}"}
    with pg.session(conninfo, schema, f"{what} lock", pooled=pooled) as conn:
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        started, pause, said = time.monotonic(), 0.05, False
        while True:
            with pg.translate_errors(schema), conn.transaction():
                if conn.info.server_version >= 170000:
                    conn.execute(q.lock_no_transaction_timeout)
                row = conn.execute(q.try_lock, name).fetchone()
                if row and row[0]:
                    # A statement with parameters leaves its portal, and the snapshot's xmin,
                    # until the next statement: one without, so the holder pins no vacuum horizon.
                    conn.execute(q.lock_alive)
                    yield Held(conn, what, q.lock_alive)
                    return
                if not wait:
                    yield Held(None, what)
                    return
                if not said and time.monotonic() - started > SAY_WHO_AFTER:
                    said = True
                    holder = conn.execute(q.lock_holder, name).fetchone()
                    log.warning(
                        "waiting for the %s lock, held by %s", what, holder[0] if holder else "?"
                    )
            time.sleep(pause)  # the try's transaction has ended: a waiter holds nothing
            pause = min(pause * 2, MOST_BETWEEN_TRIES)
