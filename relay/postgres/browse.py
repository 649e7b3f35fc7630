"""What the web console reads: the overview, pages of dead letters (keyset, newest first), one
dead letter, gated keys, and what its login may do. Each read runs in a transaction of its own
on a pooled connection, with a statement timeout (queries/console.sql's console_read_bound)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any, LiteralString
from uuid import UUID

import psycopg
import psycopg_pool
from psycopg import sql as pgsql
from psycopg.rows import class_row

from relay.core import errors, filters, model
from relay.core.filters import DeadFilter, DeadSearch
from relay.postgres import admin, pg, sql

#: Rows a page may show, at most; the overview counts each reason's dead letters up to this.
PAGE_MAX = 500
COUNT_CAP = 100_000


@dataclasses.dataclass(frozen=True, slots=True)
class Rights:
    """What the console's login may do, as PostgreSQL's grants say."""

    replay: bool
    purge: bool
    release: bool
    record: bool  # may write console_actions

    @property
    def writes(self) -> bool:
        return self.replay and self.purge and self.release and self.record


@dataclasses.dataclass(frozen=True, slots=True)
class Backlog:
    exchange: str
    due: int
    later: int
    gated: int
    leased: int
    oldest: float | None  # seconds since the oldest was written


@dataclasses.dataclass(frozen=True, slots=True)
class Relay:
    name: str
    sessions: int | None  # None: leases but no session (it died; they come back after the lease)
    since: datetime | None
    last_seen: datetime | None
    hosts: str | None
    leased: int
    lease_end: datetime | None
    last_claim: datetime | None


@dataclasses.dataclass(frozen=True, slots=True)
class Horizon:
    dead_tuples: int | None
    seconds: float | None  # the oldest snapshot's age
    xids: int | None
    pid: int | None
    state: str | None
    application_name: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class DeadCount:
    reason: str
    count: int  # up to COUNT_CAP
    last: datetime | None

    @property
    def capped(self) -> bool:
        return self.count >= COUNT_CAP


@dataclasses.dataclass(frozen=True, slots=True)
class Overview:
    backlog: list[Backlog]
    rates: list[tuple[datetime, int, int]]  # minute, published, dead-lettered
    relays: list[Relay]
    horizon: Horizon
    dead: list[DeadCount]  # reasons with dead letters
    blocked_keys: int


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLine(admin.DeadRow):
    """One row of a dead-letter page: a dead letter as `dead list` shows it, with its row id
    (for its own page and the page's position) and its body's size."""

    id: int
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    rows: list[DeadLine]
    next: tuple[datetime, int] | None  # where the next page starts (None: this is the last)
    #: A text search that read its whole window without filling the page: where to search on.
    search_on: tuple[datetime, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GatedKey:
    ordering_key: str
    held: int
    first_seq: int
    oldest: datetime


class Browser:
    """Reads for the console over a small pool of autocommit connections to one schema."""

    def __init__(self, conninfo: str, schema: str = "outbox", *, pooled: bool = False) -> None:
        self._schema = schema
        self._q = sql.load(schema)
        self._conninfo = conninfo
        self._pooled = pooled
        self._pool = psycopg_pool.ConnectionPool(
            conninfo,
            min_size=1,
            max_size=4,
            open=False,
            # Never a prepared statement: each page's plan is made for its own filter's values
            # (a LIKE prefix, a rare reason), never a generic one.
            kwargs={
                "autocommit": True,
                "application_name": f"{pg.APPLICATION_NAME} console",
                "prepare_threshold": None,
            },
            timeout=5,
        )

    def open(self) -> None:
        with pg.translate_errors(self._schema):
            self._pool.open(wait=True, timeout=10)

    def close(self) -> None:
        self._pool.close()

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection in a transaction of its own, its statements bounded in time. What the
        input can cause becomes InvalidArgument: a value PostgreSQL cannot take (a NUL byte), or
        a filter too slow for the bound."""
        too_long = "the database took too long (over 5 s) for this; narrow the filter"
        try:
            with (
                pg.translate_errors(self._schema),
                self._pool.connection() as conn,
                conn.transaction(),
            ):
                conn.execute(self._q.console_read_bound)
                yield conn
        except psycopg.errors.QueryCanceled as exc:
            raise errors.InvalidArgument(too_long) from exc
        except psycopg.DataError as exc:
            raise errors.InvalidArgument(
                f"PostgreSQL cannot take that: {pg.first_line(exc)}"
            ) from exc
        except errors.DatabaseUnavailable as exc:
            if isinstance(exc.__cause__, psycopg.errors.QueryCanceled):  # through Admin
                raise errors.InvalidArgument(too_long) from exc
            raise

    @contextmanager
    def operator(self) -> Iterator[admin.Admin]:
        """The operator API on one of the pool's connections (for reads it shares with the CLI)."""
        with self.connection() as conn:
            yield admin.Admin(conn, self._schema, self._conninfo, pooled=self._pooled)

    def _all(self, query: Any, params: Mapping[str, Any] | None = None) -> list[Any]:
        with self.connection() as conn:
            return conn.execute(query, dict(params or {})).fetchall()

    def rights(self) -> Rights:
        ((replay, purge, release, record),) = self._all(
            self._q.console_rights, {"schema": self._schema}
        )
        return Rights(bool(replay), bool(purge), bool(release), bool(record))

    def overview(self) -> Overview:
        backlog = [Backlog(*row) for row in self._all(self._q.console_backlog)]
        rates = [(m, int(p), int(d)) for m, p, d in self._all(self._q.console_rates)]
        relays = [Relay(*row) for row in self._all(self._q.console_relays)]
        (horizon,) = self._all(self._q.console_horizon, {"schema": self._schema})
        reasons = {"reasons": [r.value for r in model.DeadReason], "cap": COUNT_CAP}
        dead = [
            DeadCount(str(reason), int(n), last)
            for reason, n, last in self._all(self._q.console_dead_by_reason, reasons)
            if n
        ]
        with self.operator() as ops:
            blocked = len(ops.blocked_keys())
        return Overview(backlog, rates, relays, Horizon(*horizon), dead, blocked)

    def dead_page(
        self, search: DeadSearch, *, before: tuple[datetime, int] | None = None, limit: int = 50
    ) -> Page:
        """The dead letters that match, newest failure first, from `before` (a page's `next`)."""
        if not 1 <= limit <= PAGE_MAX:
            raise errors.InvalidArgument(f"a page shows 1 to {PAGE_MAX} rows")
        query, params = self._page_query(search, before, limit + 1)
        with self.connection() as conn:
            cur = conn.cursor(row_factory=class_row(DeadLine))
            rows = cur.execute(query, params).fetchall()
            more = len(rows) > limit
            rows = rows[:limit]
            search_on = None
            if search.text is not None and not more:
                search_on = self._window_end(conn, search, before)
        return Page(rows, (rows[-1].failed_at, rows[-1].id) if more else None, search_on)

    def _window_end(
        self,
        conn: psycopg.Connection[Any],
        search: DeadSearch,
        before: tuple[datetime, int] | None,
    ) -> tuple[datetime, int] | None:
        """The last row a text search's window read, if the window was full: older rows are
        still to be searched."""
        parts, params = self._conditions(search, before)
        params["scan"] = filters.SEARCH_SCAN
        texts = [self._q.dead_window_head, *parts, self._q.dead_page_window_end]
        row = conn.execute(pgsql.SQL("\n").join(pgsql.SQL(t) for t in texts), params).fetchone()
        return None if row is None else (row[0], int(row[1]))

    def last_dead(self) -> int:
        """The newest dead row's id: a bulk action acts on rows up to it (what was counted)."""
        ((last,),) = self._all(self._q.console_last_dead)
        return int(last)

    def count(self, where: DeadFilter, upto: int) -> int:
        """How many dead letters up to id `upto` match (what a bulk action would act on)."""
        parts, params = self._conditions(DeadSearch(where), None)
        params["upto"] = upto
        texts = [self._q.dead_count_head, *parts, self._q.dead_page_upto]
        ((n,),) = self._all(pgsql.SQL("\n").join(pgsql.SQL(t) for t in texts), params)
        return int(n)

    def _page_query(
        self, search: DeadSearch, before: tuple[datetime, int] | None, limit: int
    ) -> tuple[pgsql.Composed, dict[str, Any]]:
        q = self._q
        parts, params = self._conditions(search, before)
        params["limit"] = limit
        if search.text is None:
            texts = [q.dead_page_head, *parts, q.dead_page_tail]
        else:
            params["scan"] = filters.SEARCH_SCAN
            params["text_like"] = "%" + _like_literal(search.text) + "%"
            params["text_bytes"] = search.text.encode()
            texts = [
                q.dead_page_searched_head,
                *parts,
                q.dead_page_searched_tail,
                q.dead_page_tail,
            ]
        return pgsql.SQL("\n").join(pgsql.SQL(t) for t in texts), params

    def _conditions(
        self, search: DeadSearch, before: tuple[datetime, int] | None
    ) -> tuple[list[LiteralString], dict[str, Any]]:
        """The fragments of the filters given, and their parameters."""
        q = self._q
        params: dict[str, Any] = search.where.params()
        parts: list[LiteralString] = []
        for name, fragment in (
            ("reasons", q.dead_page_reasons),
            ("exchange", q.dead_page_exchange),
            ("routing_key", q.dead_page_routing_key),
            ("key", q.dead_page_key),
            ("since", q.dead_page_since),
            ("until", q.dead_page_until),
            ("ids", q.dead_page_ids),
        ):
            if params[name] is not None:
                parts.append(fragment)
        if search.id_start is not None:
            params["id_from"], params["id_to"] = filters.id_range(search.id_start)
            parts.append(q.dead_page_id_range)
        if before is not None:
            params["before_at"], params["before_id"] = before
            parts.append(q.dead_page_before)
        return parts, params

    def dead_row(self, dead_id: int) -> admin.DeadMessage | None:
        with self.connection() as conn:
            cur = conn.cursor(row_factory=class_row(admin.DeadMessage))
            return cur.execute(self._q.dead_by_id, {"id": dead_id}).fetchone()

    def whereabouts(self, message_id: UUID) -> list[tuple[str, datetime, int]]:
        """Where a message id is if it is not dead: waiting, or published (the latest)."""
        return [
            (str(place), at, int(replays))
            for place, at, replays in self._all(
                self._q.message_whereabouts, {"message_id": message_id}
            )
        ]

    def gated_keys(self) -> list[GatedKey]:
        return [GatedKey(*row) for row in self._all(self._q.gated_keys)]

    def blocked_keys(self) -> list[admin.BlockedKey]:
        with self.operator() as ops:
            return ops.blocked_keys()


def _like_literal(text: str) -> str:
    """`text` as the inside of a LIKE pattern that matches it literally (backslash escapes)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
