"""The PostgreSQL adapter: claims, fetches and settles outbox rows through a psycopg pool."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, LiteralString, NamedTuple
from uuid import UUID

import psycopg
import psycopg_pool
from psycopg.rows import namedtuple_row

from relay.core import errors, model, values
from relay.postgres import pg, sql
from relay.postgres.pg import translate_errors
from relay.postgres.readings import Readings
from relay.postgres.rows import settle_params, to_message

log = logging.getLogger("relay.store")

#: A claimed batch's bodies, headers and properties stop growing past this (the first row is
#: always taken). The relay holds at most two batches: one publishing, one claimed ahead.
BATCH_MAX_BYTES = 64 * 1024 * 1024
#: Claimed rows are fetched in pages of about this many bytes: a page that fits in the sockets'
#: buffers is sent whole even to a relay that stopped reading, so its statement ends and holds
#: no snapshot (a batch of 500 rows of 4 KiB is 2 MiB, past what a frozen reader's buffers take).
FETCH_PAGE_BYTES = 256 * 1024


class Cursor(NamedTuple):
    """Where a claim starts: a position in due order."""

    at: datetime
    id: int


class Behind(NamedTuple):
    """What the rescue found behind the two cursors (None: nothing)."""

    due: Cursor | None
    orphans: Cursor | None


def _earlier(cursor: Cursor | None, found: Cursor | None) -> Cursor | None:
    """Where a claim starts: `cursor`, or `found` if that is earlier (None is the start)."""
    if cursor is None or found is None:
        return cursor
    return min(cursor, found)


class PgStore(Readings):
    """ports.Store on PostgreSQL. Every method raises errors.DatabaseUnavailable on an outage and
    errors.LockTimeout when a lock was not granted within the session's lock_timeout.

    It keeps the relay's two cursors: where its next claim starts in the due rows and in the
    expired leases (docs/decisions/0004). They only save work: a claim looks back a second behind
    them, and after `rescue` the next claim starts from any row left behind."""

    def __init__(
        self,
        pool: psycopg_pool.AsyncConnectionPool,
        schema: str,
        relay_name: str,
        batch_max_bytes: int = BATCH_MAX_BYTES,
        synchronous_commit: bool = True,
    ) -> None:
        self._pool = pool
        self._schema = schema
        self._q = sql.load(schema)
        self._relay_name = relay_name
        self._batch_max_bytes = batch_max_bytes
        self._synchronous_commit = synchronous_commit
        #: Where the next claim starts, (available_at, id) in the due rows and in the expired
        #: leases (None: from the start, as after a restart).
        self.due_from: Cursor | None = None
        self.orphans_from: Cursor | None = None
        #: What the rescue found behind the cursors, kept until a claim that started from it
        #: ends: a claim already in flight when the rescue looked moves the cursors on from
        #: where it began, and would otherwise undo the rescue's find.
        self._behind = Behind(None, None)

    @classmethod
    async def open(
        cls,
        conninfo: str,
        schema: str,
        relay_name: str,
        *,
        lock_timeout: float = 5.0,
        max_size: int = 3,
        synchronous_commit: bool = True,
        batch_max_bytes: int = BATCH_MAX_BYTES,
        pooled: bool = False,
    ) -> PgStore:
        """Open a pool and check the schema exists. Raises DatabaseUnavailable or SchemaMissing.
        Claims are always durable before they return; without `synchronous_commit`, settles do
        not wait for the WAL flush (unless they record a re-send). No statement waits for a lock,
        or holds a transaction open while the relay does not answer, longer than `lock_timeout`
        seconds; connecting waits as long. `pooled`: `conninfo` goes through a transaction-mode
        pooler, so no prepared statements, and the session settings the relay needs must be the
        role's (ConfigError if they are not)."""
        values.check_identifier(schema)
        q = sql.load(schema)
        with translate_errors(schema):
            # One direct connection first: a pool only says "timed out", libpq says why.
            probe = await psycopg.AsyncConnection.connect(
                conninfo,
                autocommit=True,
                connect_timeout=max(1, round(lock_timeout)),
                **pg.options(pooled),
            )
            try:
                if pooled:
                    await _check_role_settings(probe, q)
            finally:
                await probe.close()
        pool = psycopg_pool.AsyncConnectionPool(
            conninfo,
            min_size=1,
            max_size=max_size,
            open=False,
            # Waiting for a connection while the database is down only delays the relay's own
            # back-off (and /readyz): no longer than for a lock. And give up the pool's own
            # reconnect back-off (1 s doubling, for minutes) as soon: the next demand starts again
            # at once, so the relay's retries, not the pool's, decide how soon it is back.
            timeout=lock_timeout,
            reconnect_timeout=lock_timeout,
            kwargs={
                "autocommit": True,
                "application_name": f"{pg.APPLICATION_NAME} {relay_name}"[:63],
                **pg.options(pooled),
            },
            # Through a transaction pooler a session setting would stay on a server connection
            # that other clients then get, and not follow this one: the role's are checked above.
            configure=None if pooled else session(q, lock_timeout),
            name="outbox-relay",
        )
        try:
            with translate_errors(schema):
                await pool.open(wait=True, timeout=lock_timeout)
            store = cls(pool, schema, relay_name, batch_max_bytes, synchronous_commit)
            await store.schema_version()
        except BaseException:
            await pool.close()
            raise
        return store

    async def close(self) -> None:
        await self._pool.close()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        with translate_errors(self._schema):
            async with self._pool.connection() as conn:
                yield conn

    async def schema_version(self) -> int:
        """The newest migration applied. Raises SchemaMissing before the first `migrate`."""
        async with self._connection() as conn:
            cur = await conn.execute(self._q.schema_version)
            row = await cur.fetchone()
        version = int(row[0]) if row else 0
        if version == 0:
            raise errors.SchemaMissing(
                f'the outbox schema "{self._schema}" has no migrations; run `outbox-relay migrate`'
            )
        return version

    async def claim(self, ask: model.Ask) -> model.Claim:
        claim_id = uuid.uuid4()
        behind = self._behind
        row = await self._one(self._q.claim, {"request": self._request(claim_id, ask)})
        return await self._claimed(claim_id, row, behind)

    async def settle(
        self, claim_id: UUID, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        # A settle that records a re-send waits for the flush whatever the setting: losing it in
        # a crash would lose a send from `attempts + ambiguous`, the bound on the sends. One that
        # claims too waits for it: claims are always durable before anything is published.
        durable = self._synchronous_commit or bool(settlement.resent) or then is not None
        next_id = uuid.uuid4()
        behind = self._behind
        params = {
            **settle_params(claim_id, settlement, durable),
            "request": None if then is None else self._request(next_id, then),
        }
        row = await self._one(self._q.settle, params)
        fenced = settlement.size - row.archived - row.dead - row.retried
        counts = model.SettleCounts(
            row.archived, row.dead, row.retried, fenced, row.released, row.blocked
        )
        if then is None:
            return counts, model.Claim(next_id, ())
        return counts, await self._claimed(next_id, row, behind)

    def _request(self, claim_id: UUID, ask: model.Ask) -> tuple[Any, ...]:
        """The claim_request composite (migration 0026), field by field: from the cursors, or
        from what the rescue found behind them."""
        return (
            claim_id,
            self._relay_name,
            ask.lease,
            ask.limit,
            self._batch_max_bytes,
            ask.max_attempts,
            *(_earlier(self.due_from, self._behind.due) or (None, None)),
            *(_earlier(self.orphans_from, self._behind.orphans) or (None, None)),
        )

    async def _claimed(self, claim_id: UUID, row: Any, behind: Behind) -> model.Claim:
        """Move the cursors on as the claim says (which started from `behind`), and fetch what
        it claimed."""
        self.due_from = None if row.due_at is None else Cursor(row.due_at, row.due_id)
        self.orphans_from = None if row.orphan_at is None else Cursor(row.orphan_at, row.orphan_id)
        if self._behind is behind:  # else the rescue found more meanwhile: the next claim uses it
            self._behind = Behind(None, None)
        buried = tuple(
            (UUID(str(m)), int(n)) for m, n in zip(row.buried, row.buried_attempts, strict=True)
        )
        rows = await self._fetch(claim_id, row.ids, row.sizes) if row.ids else []
        messages = tuple(to_message(r) for r in rows)
        return model.Claim(claim_id, messages, row.more, buried, row.alone)

    async def _fetch(self, claim_id: UUID, ids: list[int], sizes: list[int]) -> list[Any]:
        """The claimed rows, in pages of about FETCH_PAGE_BYTES (one row at least), in claim
        order. A row missing from a page was taken over meanwhile: it is not published."""
        rows: list[Any] = []
        for page in _pages(ids, sizes, FETCH_PAGE_BYTES):
            async with self._connection() as conn:
                cur = conn.cursor(row_factory=namedtuple_row)
                await cur.execute(self._q.fetch, {"ids": page, "claim_id": claim_id})
                rows.extend(await cur.fetchall())
        order = {i: n for n, i in enumerate(ids)}
        return sorted(rows, key=lambda r: order[r.id])

    async def _one(self, query: LiteralString, params: dict[str, Any]) -> Any:
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=namedtuple_row)
            await cur.execute(query, params)
            return await pg.one_row(cur)

    async def extend(self, claim_id: UUID, ids: Sequence[int], lease: float) -> frozenset[int]:
        params = {"claim_id": claim_id, "ids": list(ids), "lease": lease}
        async with self._connection() as conn:
            cur = await conn.execute(self._q.extend_leases, params)
            return frozenset(int(i) for (i,) in await cur.fetchall())

    async def rescue(self) -> int:
        """Look for the oldest due row and expired lease behind the cursors (a commit long after
        its insert, a claim that rolled back); the next claim starts from what it finds. How
        many of the two it found."""
        due_from, orphans_from = self.due_from, self.orphans_from
        if due_from is None or orphans_from is None:
            return 0  # the next claim starts from the start anyway
        params = {
            "due_at": due_from.at,
            "due_id": due_from.id,
            "orphan_at": orphans_from.at,
            "orphan_id": orphans_from.id,
        }
        row = await self._one(self._q.behind, params)
        due = None if row.due_at is None else Cursor(row.due_at, row.due_id)
        orphans = None if row.orphan_at is None else Cursor(row.orphan_at, row.orphan_id)
        if due is None and orphans is None:
            return 0
        self._behind = Behind(
            _earlier(self._behind.due, due) or due,
            _earlier(self._behind.orphans, orphans) or orphans,
        )
        return (due is not None) + (orphans is not None)

    def shift_cursors(self, seconds: float) -> None:
        """Move the cursors back by `seconds` (the interleaving tests move every stored time back
        to make time pass)."""
        back = timedelta(seconds=seconds)
        self._behind = Behind(
            *(None if c is None else Cursor(c.at - back, c.id) for c in self._behind)
        )
        if self.due_from is not None:
            self.due_from = Cursor(self.due_from.at - back, self.due_from.id)
        if self.orphans_from is not None:
            self.orphans_from = Cursor(self.orphans_from.at - back, self.orphans_from.id)

    async def blocked_key_count(self) -> int:
        async with self._connection() as conn:
            cur = await conn.execute(self._q.blocked_key_count)
            (count,) = await pg.one_row(cur)
        return int(count)


def _pages(ids: list[int], sizes: list[int], most: int) -> list[list[int]]:
    """`ids` cut into runs of at most `most` bytes by `sizes` (a longer row alone)."""
    pages: list[list[int]] = []
    page: list[int] = []
    used = 0
    for i, size in zip(ids, sizes, strict=True):
        if page and used + size > most:
            pages.append(page)
            page, used = [], 0
        page.append(i)
        used += size
    if page:
        pages.append(page)
    return pages


async def _check_role_settings(conn: psycopg.AsyncConnection[Any], q: sql.Queries) -> None:
    """What relay_session would set, as the role's own settings (ALTER ROLE … SET)."""
    cur = await conn.execute(q.relay_settings)
    durable, isolation, lock_timeout, idle, role = await pg.one_row(cur)
    wrong = []
    if durable == "off":
        wrong.append("synchronous_commit = on")  # claims must be durable before a publish
    if isolation != "read committed":
        wrong.append("default_transaction_isolation = 'read committed'")
    unbounded = [
        f"ALTER ROLE {role} SET {name} = '5s'"
        for name, value in (
            ("lock_timeout", lock_timeout),
            ("idle_in_transaction_session_timeout", idle),
        )
        if value == "0"
    ]
    if unbounded:
        log.warning(
            "behind a transaction pooler the relay's lock waits are bounded only by its role's "
            "settings (OUTBOX_LOCK_TIMEOUT cannot reach its sessions): %s",
            "; ".join(unbounded),
        )
    if wrong:
        raise errors.ConfigError(
            "behind a transaction pooler the relay cannot change its sessions' settings; "
            f"set them for its role: {'; '.join(f'ALTER ROLE {role} SET {w}' for w in wrong)}"
        )


def session(
    q: sql.Queries, lock_timeout: float
) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
    """The set-up of each of a relay's pooled connections (queries/relay.sql's relay_session)."""
    millis = str(max(1, round(lock_timeout * 1000)))

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(q.relay_session, {"lock_timeout": millis})

    return configure
