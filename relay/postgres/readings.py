"""What the gauges, `stats` and `top` read of the outbox: one query each, never a table scan."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any

import psycopg

from relay.core import model
from relay.postgres import pg, sql


class Readings:
    """ports.Readings (and the store's `stats`) on PostgreSQL, for the store to inherit: it
    provides the schema, its statements and pooled connections."""

    _schema: str
    _q: sql.Queries
    #: Where the relay's claims start (store.PgStore's cursors: their times): the gauges count
    #: due rows from there. None: from the start.
    due_from: tuple[datetime, int] | None = None
    orphans_from: tuple[datetime, int] | None = None

    def _connection(self) -> AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]:
        raise NotImplementedError

    async def observe(self) -> model.Observation:
        """The gauges' snapshot: backlog by state and the database's health, in one query."""
        async with self._connection() as conn:
            params = {
                "messages": f'"{self._schema}".messages',
                "due_at": None if self.due_from is None else self.due_from[0],
                "orphan_at": None if self.orphans_from is None else self.orphans_from[0],
            }
            cur = await conn.execute(self._q.observe, params)
            row = await pg.one_row(cur)
        due, scheduled, gated, in_flight, oldest, dead, blocked, tuples, vacuumed, on, *xmin = row
        seconds, xids, pid, state = xmin
        return model.Observation(
            due,
            scheduled,
            gated,
            in_flight,
            _float(oldest),
            dead,
            blocked,
            int(tuples or 0),
            _float(vacuumed),
            on is not False,  # for the server and the messages table
            _float(seconds),
            xids,
            pid,
            state,
        )

    async def stats(self) -> model.Stats:
        async with self._connection() as conn:
            cur = await conn.execute(self._q.message_stats)
            pending, due, scheduled, gated, in_flight, oldest = await pg.one_row(cur)
            cur = await conn.execute(self._q.archive_count)
            (archived,) = await pg.one_row(cur)
            cur = await conn.execute(self._q.blocked_key_count)
            (blocked_keys,) = await pg.one_row(cur)
            cur = await conn.execute(self._q.dead_by_reason)
            by_reason = {str(reason): int(n) for reason, n in await cur.fetchall()}
        return model.Stats(
            pending=pending,
            due=due,
            scheduled=scheduled,
            gated=gated,
            in_flight=in_flight,
            oldest_pending_age_seconds=None if oldest is None else float(oldest),
            archived=archived,
            dead=sum(by_reason.values()),
            dead_by_reason=by_reason,
            blocked_keys=blocked_keys,
            observation=await self.observe(),
        )

    async def table_inserts(self) -> dict[str, int]:
        """Rows ever inserted into messages, archive and dead (PostgreSQL's statistics)."""
        async with self._connection() as conn:
            cur = await conn.execute(self._q.table_inserts, {"schema": self._schema})
            return {str(name): int(n) for name, n in await cur.fetchall()}

    async def dead_by_reason(self) -> dict[str, int]:
        async with self._connection() as conn:
            cur = await conn.execute(self._q.dead_by_reason)
            return {str(reason): int(n) for reason, n in await cur.fetchall()}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
