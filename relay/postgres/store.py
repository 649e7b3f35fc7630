"""The PostgreSQL adapter: claims and settles outbox rows through a psycopg connection pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, LiteralString
from uuid import UUID

import psycopg
import psycopg_pool
from psycopg.rows import namedtuple_row

from relay.core import errors, model, values
from relay.postgres import pg, sql
from relay.postgres.pg import translate_errors
from relay.postgres.readings import Readings
from relay.postgres.rows import settle_params, to_message
from relay.postgres.window import Window

log = logging.getLogger("relay.store")

#: How long an operation waits for a pooled connection before the database counts as unavailable.
POOL_WAIT = 3.0
#: A claimed batch's bodies, headers and properties stop growing past this (the first row is
#: always taken). The relay holds at most two batches: one publishing, one claimed ahead (or,
#: while a keyed batch runs as chains, one per chain: docs/decisions/0009).
BATCH_MAX_BYTES = 64 * 1024 * 1024
#: Rows one bury, one recheck or one page of forgetting keys handles per transaction.
CHUNK = 1000
#: Segments in the ready lane's ring (migration 0015).
SEGMENTS = 4


#: The ready lane's orphans are looked for among leases that ran out since the last look; at
#: least this often (seconds), among all of them (a row skipped while another session held it),
#: by a chore beside the loop: that look reads every claim of the ring (0.6-0.7 s at 400,000),
#: and made in the loop's own cycle it stopped the loop for as long (docs/decisions/0004).
FULL_ORPHAN_PASS_EVERY = 300.0
#: Each look for orphans starts this far (seconds) before where the last one ended, for claims
#: that committed after it although their lease had already run out (a lease runs from its
#: claim's start). A claim that took longer than its lease and this to commit is found by the
#: full pass. Going back a whole lease, as the first version did, looked at every claim three
#: times (a look every half lease) and held the loop 50 ms every 5 s at 2,000 messages/s.
LATE_COMMIT = 2.0


class PgStore(Readings):
    """ports.Store on PostgreSQL. Every method raises errors.DatabaseUnavailable on an outage."""

    def __init__(
        self,
        pool: psycopg_pool.AsyncConnectionPool,
        schema: str,
        relay_name: str,
        batch_max_bytes: int = BATCH_MAX_BYTES,
        synchronous_commit: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._schema = schema
        self._q = sql.load(schema)
        self._relay_name = relay_name
        self._batch_max_bytes = batch_max_bytes
        self._synchronous_commit = synchronous_commit
        self._clock = clock  # the window's and the orphan sweep's timers (tests pass their own)
        self._window = Window(clock=clock)
        self._claiming = asyncio.Lock()  # the window moves one claim at a time
        self._orphans_after: datetime | None = None  # where the next look for orphans starts

    @classmethod
    async def open(
        cls,
        conninfo: str,
        schema: str,
        relay_name: str,
        *,
        connect_timeout: float = 10.0,
        max_size: int = 3,
        synchronous_commit: bool = True,
        batch_max_bytes: int = BATCH_MAX_BYTES,
        pooled: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> PgStore:
        """Open a pool and check the schema exists. Raises DatabaseUnavailable or SchemaMissing.
        Claims are always durable before they return; without `synchronous_commit`, settles do
        not wait for the WAL flush (unless they record a re-send). `pooled`: `conninfo` goes
        through a transaction-mode pooler, so no prepared statements, and the session settings
        the relay needs must be the role's (ConfigError if they are not)."""
        values.check_identifier(schema)
        q = sql.load(schema)
        with translate_errors(schema):
            # One direct connection first: a pool only says "timed out", libpq says why.
            probe = await psycopg.AsyncConnection.connect(
                conninfo,
                autocommit=True,
                connect_timeout=max(1, round(connect_timeout)),
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
            # back-off (and /readyz): fail fast. And give up the pool's own reconnect back-off
            # (1 s doubling, for minutes) quickly: the next demand starts again at once, so the
            # relay's retries, not the pool's, decide how soon it is back after an outage.
            timeout=POOL_WAIT,
            reconnect_timeout=POOL_WAIT,
            kwargs={
                "autocommit": True,
                "application_name": pg.APPLICATION_NAME,
                **pg.options(pooled),
            },
            # Through a transaction pooler a session setting would stay on a server connection
            # that other clients then get, and not follow this one: the role's are checked above.
            configure=None if pooled else _session(q.relay_session),
            name="outbox-relay",
        )
        try:
            with translate_errors(schema):
                await pool.open(wait=True, timeout=connect_timeout)
            store = cls(pool, schema, relay_name, batch_max_bytes, synchronous_commit, clock)
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

    async def use_fast_lane(self) -> None:
        """Let producers use the ready lane: a relay that knows it is running."""
        async with self._connection() as conn:
            await conn.execute(self._q.use_fast_lane)

    async def claim(self, limit: int, lease: float) -> model.Claim:
        async with self._claiming:
            params = self._claim_params(limit, lease)
            rows = await self._claim_window(self._q.claim_batch, params)
            trailer = rows.pop()
            self._window.moved(trailer)
        return self._claimed(params["claim_id"], rows, trailer)

    async def _claim_window(self, query: LiteralString, params: dict[str, Any]) -> list[Any]:
        """Run a claim of the ready lane's window: the window's state goes into `params`. A
        window that must first ask where it starts (lane_start) asks on the same connection."""
        try:
            async with self._connection() as conn:
                if self._window.needs_start:
                    cur = await conn.execute(self._q.lane_start)
                    self._window.start(*await pg.one_row(cur))
                params.update(self._window.params())
                cursor = conn.cursor(row_factory=namedtuple_row)
                await cursor.execute(query, params)
                return await cursor.fetchall()
        except errors.DatabaseUnavailable:
            self._window.forget()
            raise

    async def sweep_stragglers(self) -> int:
        """Move the ready rows this relay's windows passed a while ago (window.SWEEP_AFTER) and
        that still have no claim — each skipped while another claim held it, which then rolled
        back — to messages, where every relay's claim finds them; how many (migration 0022)."""
        passed = self._window.passed()
        moved = 0
        while passed is not None:
            try:
                async with self._connection() as conn:
                    params = {"passed": passed, "limit": CHUNK}
                    cur = await conn.execute(self._q.sweep_stragglers, params)
                    looked, n = await pg.one_row(cur)
            except psycopg.errors.InvalidParameterValue as exc:
                # Ahead of the server: its transaction ids went backwards (a failover). What
                # the windows passed is of the other timeline; the loop's next claim finds out
                # too, and starts its windows again.
                log.warning("straggler sweep: %s; it starts over", pg.first_line(exc))
                self._window.forget_passed()
                break
            moved += int(n)
            if looked < CHUNK:
                break
        return moved

    @staticmethod
    def _claimed(claim_id: UUID, rows: list[Any], trailer: Any) -> model.Claim:
        slow = [row for row in rows if row.lane == "messages"]
        ready = sum(row.lane == "ready" for row in rows)
        cut_short = (bool(slow) and slow[0].locked > len(slow)) or trailer.locked > ready
        return model.Claim(claim_id, tuple(to_message(row) for row in rows), cut_short)

    async def claim_orphans(self, limit: int, lease: float, max_attempts: int) -> model.Claim:
        params = {**self._claim_params(limit, lease), "max_attempts": max_attempts}
        rows = await self._fetch(self._q.claim_orphans, params)
        return model.Claim(params["claim_id"], tuple(to_message(row) for row in rows))

    def _claim_params(self, limit: int, lease: float) -> dict[str, Any]:
        return {
            "limit": limit,
            "max_bytes": self._batch_max_bytes,
            "lease": lease,
            "claim_id": uuid.uuid4(),
            "claimed_by": self._relay_name,
        }

    async def _fetch(self, query: LiteralString, params: dict[str, Any]) -> list[Any]:
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=namedtuple_row)
            await cur.execute(query, params)
            return await cur.fetchall()

    async def release_orphans(self, lease: float) -> int:
        """Move the ready lane's orphans (claims whose lease ran out unsettled) into messages,
        where claim_orphans and bury_exhausted find them; how many. Looks at the leases that ran
        out since the last look (less LATE_COMMIT, for claims that committed late)."""
        moved = 0
        first_checked: datetime | None = None
        while True:
            looked, n, last_until, checked_at = await self._release_orphans(self._orphans_after)
            moved += n
            first_checked = first_checked or checked_at
            if looked < CHUNK:
                # From the first page's time: a claim committed after it, with its lease ended
                # before it, is behind the later pages' cursor, and within LATE_COMMIT of this.
                margin = timedelta(seconds=min(lease, LATE_COMMIT))
                self._orphans_after = first_checked - margin
                return moved
            self._orphans_after = last_until

    async def release_all_orphans(self) -> int:
        """As release_orphans, but among every lease that ran out, wherever the last look ended:
        a claim that committed more than LATE_COMMIT after its lease ran out, or one another
        session held during the looks. A chore, every FULL_ORPHAN_PASS_EVERY; how many."""
        moved, after = 0, None
        while True:
            looked, n, last_until, _ = await self._release_orphans(after)
            moved += n
            if looked < CHUNK:
                return moved
            after = last_until

    async def _release_orphans(self, after: datetime | None) -> tuple[int, int, Any, Any]:
        async with self._connection() as conn:
            cur = await conn.execute(self._q.release_orphans, {"after": after, "limit": CHUNK})
            looked, n, last_until, checked_at = await pg.one_row(cur)
        return int(looked), int(n), last_until, checked_at

    def shift_orphan_cursor(self, seconds: float) -> None:
        """Move where the next look for orphans starts back by `seconds` (the interleaving
        tests move stored times back to make time pass)."""
        if self._orphans_after is not None:
            self._orphans_after -= timedelta(seconds=seconds)

    async def reclaim(self) -> int:
        """TRUNCATE the ready lane's segments whose rows are all done; how many."""
        reclaimed = 0
        for seg in range(SEGMENTS):
            async with self._connection() as conn:
                cur = await conn.execute(self._q.reclaim_segment, {"seg": seg})
                (done,) = await pg.one_row(cur)
            reclaimed += bool(done)
        return reclaimed

    async def bury_exhausted(self, max_attempts: int) -> list[tuple[UUID, int]]:
        buried: list[tuple[UUID, int]] = []
        while True:  # in chunks, each its own transaction
            async with self._connection() as conn:
                cur = await conn.execute(
                    self._q.bury_exhausted, {"max_attempts": max_attempts, "limit": CHUNK}
                )
                rows = await cur.fetchall()
            buried.extend((UUID(str(m)), int(n)) for m, n in rows)
            if len(rows) < CHUNK:
                return buried

    async def extend(self, claim_id: UUID, ids: Sequence[int], lease: float) -> frozenset[int]:
        params = {"claim_id": claim_id, "ids": list(ids), "lease": lease}
        async with self._connection() as conn:
            cur = await conn.execute(self._q.extend_leases, params)
            return frozenset(int(i) for (i,) in await cur.fetchall())

    async def settle(self, claim_id: UUID, settlement: model.Settlement) -> model.SettleCounts:
        # A settle that records a re-send waits for the flush whatever the setting: losing it in
        # a crash would lose a send from `attempts + ambiguous`, the bound on the sends.
        durable = self._synchronous_commit or bool(settlement.resent)
        async with self._connection() as conn:
            cur = await conn.execute(self._q.settle, settle_params(claim_id, settlement, durable))
            archived, dead, retried, released, blocked = await pg.one_row(cur)
        fenced = settlement.size - archived - dead - retried
        return model.SettleCounts(archived, dead, retried, fenced, released, blocked)

    async def settle_then_claim(
        self, claim_id: UUID, settlement: model.Settlement, limit: int, lease: float
    ) -> tuple[model.SettleCounts, model.Claim]:
        durable = self._synchronous_commit or bool(settlement.resent)
        async with self._claiming:
            params = {
                **settle_params(claim_id, settlement, durable),
                **self._claim_params(limit, lease),
            }
            params["next_id"] = params.pop("claim_id")
            params["claim_id"] = claim_id
            rows = await self._claim_window(self._q.settle_then_claim, params)
            settled = rows.pop()
            trailer = rows.pop()
            self._window.moved(trailer)
        fenced = settlement.size - settled.archived - settled.dead - settled.retried
        counts = model.SettleCounts(
            settled.archived,
            settled.dead,
            settled.retried,
            fenced,
            settled.released,
            settled.blocked,
        )
        return counts, self._claimed(params["next_id"], rows, trailer)

    async def release_stranded(self) -> int:
        released = 0
        while True:
            async with self._connection() as conn:
                cur = await conn.execute(self._q.release_stranded, {"limit": CHUNK})
                looked, n = await pg.one_row(cur)
            released += int(n)
            if looked < CHUNK:
                return released

    async def forget_idle_keys(self, idle_for: float) -> int:
        """Forget keys nobody has used for `idle_for` seconds (no message waiting, no block):
        one pass over `keys`, in pages of their own transactions; how many."""
        forgotten, after = 0, ""
        while True:
            async with self._connection() as conn:
                cur = await conn.execute(
                    self._q.forget_idle_keys, {"idle": idle_for, "after": after, "limit": CHUNK}
                )
                n, last = await pg.one_row(cur)
            forgotten += int(n)
            if last is None:
                return forgotten
            after = str(last)

    async def blocked_key_count(self) -> int:
        async with self._connection() as conn:
            cur = await conn.execute(self._q.blocked_key_count)
            (count,) = await pg.one_row(cur)
        return int(count)


async def _check_role_settings(conn: psycopg.AsyncConnection[Any], q: sql.Queries) -> None:
    """What relay_session would set, as the role's own settings (ALTER ROLE … SET)."""
    cur = await conn.execute(q.relay_settings)
    durable, isolation, role = await pg.one_row(cur)
    wrong = []
    if durable == "off":
        wrong.append("synchronous_commit = on")  # claims must be durable before a publish
    if isolation != "read committed":
        wrong.append("default_transaction_isolation = 'read committed'")
    if wrong:
        raise errors.ConfigError(
            "behind a transaction pooler the relay cannot change its sessions' settings; "
            f"set them for its role: {'; '.join(f'ALTER ROLE {role} SET {w}' for w in wrong)}"
        )


def _session(query: LiteralString) -> Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]:
    """The pool's set-up of each new connection."""

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute(query)

    return configure
