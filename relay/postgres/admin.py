"""The operator's side of the outbox, as a Python API: dead letters (list, inspect, replay,
purge), archive retention, blocked keys, key policies and forgetting idle keys. The
`outbox-relay dead|archive|keys` commands are a thin layer over it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar
from uuid import UUID

import psycopg
import psycopg.errors
from psycopg.rows import class_row

from relay.core import errors, filters
from relay.core.filters import DeadFilter
from relay.postgres import locks, pg
from relay.postgres.pg import translate_errors

OnDead = Literal["block", "skip"]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class BlockedKey:
    """A key held because one of its messages was dead-lettered under the 'block' policy."""

    ordering_key: str
    message_id: UUID  # the dead message (in outbox.dead)
    seq: int
    reason: str
    blocked_at: datetime
    waiting: int  # messages of this key held behind it


@dataclasses.dataclass(frozen=True, slots=True)
class KeyPolicy:
    """How keys starting with `prefix` behave ('' is the default for all keys)."""

    prefix: str
    on_dead: OnDead
    concurrency: int
    min_interval: float  # seconds between releases of a key's messages


@dataclasses.dataclass(frozen=True, slots=True)
class DeadRow:
    """A dead letter as `dead list` shows it."""

    message_id: UUID
    failed_at: datetime
    reason: str
    detail: str
    exchange: str
    routing_key: str
    ordering_key: str | None
    seq: int | None
    attempts: int
    replays: int


@dataclasses.dataclass(frozen=True, slots=True)
class DeadMessage(DeadRow):
    """A dead letter in full, as `dead show` shows it."""

    created_at: datetime
    ambiguous: int
    replayed_at: datetime | None
    replayed_from: str | None
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    body: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class DeadGroup:
    """Dead letters of one reason and exchange, as `dead stats` shows them."""

    reason: str
    exchange: str
    count: int
    first: datetime
    last: datetime


@dataclasses.dataclass(frozen=True, slots=True)
class ArchiveStats:
    estimated_rows: int  # PostgreSQL's estimate (exact_rows when asked for)
    bytes: int  # on disk, with indexes and TOAST
    oldest: datetime | None
    newest: datetime | None
    exact_rows: int | None = None


#: Called after each batch of a long operation with the number of rows it moved.
Progress = Callable[[int], object]


class Admin(pg.Session):
    """Operator operations on one outbox schema, over one autocommit connection. Every method
    raises DatabaseUnavailable or SchemaMissing on those failures, InvalidArgument on bad input."""

    @classmethod
    @contextmanager
    def connect(
        cls, conninfo: str, schema: str = "outbox", *, pooled: bool = False
    ) -> Iterator[Admin]:
        """`pooled`: `conninfo` goes through a transaction-mode pooler (PgBouncer)."""
        with pg.session(conninfo, schema, "admin", pooled=pooled) as conn:
            yield cls(conn, schema, conninfo, pooled=pooled)

    def _rows(self, query: Any, params: dict[str, Any] | None = None) -> list[Any]:
        with self._errors():
            cur = self._conn.execute(query, params or {})
            return cur.fetchall() if cur.description else []

    def _objects(self, cls: type[T], query: Any, params: dict[str, Any]) -> list[T]:
        """Rows as instances of a dataclass whose fields are named like the query's columns."""
        with self._errors():
            cur = self._conn.cursor(row_factory=class_row(cls))
            return cur.execute(query, params).fetchall()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The database's own argument checks (in the SQL functions) become InvalidArgument."""
        with translate_errors(self._schema):
            try:
                yield
            except psycopg.errors.InvalidParameterValue as exc:
                raise errors.InvalidArgument(exc.diag.message_primary or str(exc)) from None

    def blocked_keys(self) -> list[BlockedKey]:
        """Keys held by the 'block' policy, oldest first."""
        return [BlockedKey(*row) for row in self._rows(self._q.blocked_keys)]

    def release_key(self, ordering_key: str, *, replay: bool = False) -> bool:
        """Let a blocked key go on. With `replay`, its dead message is put back in its place (sent
        first, with its own sequence number); otherwise the key skips it. False if not blocked."""
        (row,) = self._rows(self._q.release_key, {"key": ordering_key, "replay": replay})
        return bool(row[0])

    def policies(self) -> list[KeyPolicy]:
        return [KeyPolicy(*row) for row in self._rows(self._q.key_policies)]

    def set_policy(
        self,
        prefix: str,
        *,
        on_dead: OnDead | None = None,
        concurrency: int | None = None,
        min_interval: float | None = None,
    ) -> KeyPolicy:
        """Create or change the policy of keys starting with `prefix`; unset fields keep their
        value (or the defaults: block, 1, 0). It applies to a key once its backlog drains."""
        if on_dead not in (None, "block", "skip"):
            raise errors.InvalidArgument("on_dead must be 'block' or 'skip'")
        if concurrency is not None and not 1 <= concurrency <= 1000:
            raise errors.InvalidArgument("concurrency must be from 1 to 1000")
        if min_interval is not None and min_interval < 0:
            raise errors.InvalidArgument("min_interval must not be negative")
        params = {
            "prefix": prefix,
            "on_dead": on_dead,
            "concurrency": concurrency,
            "min_interval": min_interval,
        }
        (row,) = self._rows(self._q.set_key_policy, params)
        return KeyPolicy(*row)

    def delete_policy(self, prefix: str) -> bool:
        """Remove a prefix's policy (the default, '', stays); False if there was none."""
        with translate_errors(self._schema):
            return self._conn.execute(self._q.delete_key_policy, {"prefix": prefix}).rowcount > 0

    # Dead letters -------------------------------------------------------------------------------

    def dead_list(self, where: DeadFilter = DeadFilter(), limit: int = 100) -> list[DeadRow]:  # noqa: B008
        """Dead letters matching `where`, oldest failure first."""
        if limit < 1:
            raise errors.InvalidArgument("limit must be at least 1")
        return self._objects(DeadRow, self._q.dead_list, where.params() | {"limit": limit})

    def dead_count(self, where: DeadFilter = DeadFilter()) -> int:  # noqa: B008
        (row,) = self._rows(self._q.dead_count, where.params())
        return int(row[0])

    def dead_get(self, message_id: UUID) -> DeadMessage | None:
        """The dead letter with this message_id (the latest, if it died more than once)."""
        rows = self._objects(DeadMessage, self._q.dead_get, {"message_id": message_id})
        return rows[0] if rows else None

    def dead_ids_starting(self, start: str) -> list[UUID]:
        """The dead letters' message ids that begin with `start` (a whole id, or its first 4 or
        more hex digits, dashes optional), at most two: one means `start` names one.
        InvalidArgument if `start` is not the start of an id."""
        pattern = filters.id_prefix(start) + "%"
        return [row[0] for row in self._rows(self._q.dead_ids_starting, {"pattern": pattern})]

    def dead_stats(self) -> list[DeadGroup]:
        """Dead letters grouped by reason and exchange, biggest group first."""
        return self._objects(DeadGroup, self._q.dead_stats, {})

    def dead_replay(
        self,
        where: DeadFilter,
        *,
        to_exchange: str | None = None,
        to_routing_key: str | None = None,
        batch: int = 500,
        progress: Progress | None = None,
        upto: int | None = None,
    ) -> int:
        """Move the matching dead letters back to messages, `batch` rows per transaction: each row
        leaves dead in the transaction it enters messages, keeping its message_id, with attempts
        reset and its provenance recorded (published as x-outbox-replay* headers). Safe to
        interrupt and run again: a row is moved once, or not at all. Rows whose message_id is
        already waiting in messages are left in dead. Returns how many moved. `upto`: act on rows
        up to this dead id (default: the last one now; rows that die later are left)."""
        for name, value in (("exchange", to_exchange), ("routing key", to_routing_key)):
            if value is not None and len(value.encode()) > 255:
                raise errors.InvalidArgument(f"the new {name} is longer than AMQP's 255 bytes")
        params = where.params() | {
            "batch": _batch(batch),
            "to_exchange": to_exchange,
            "to_routing_key": to_routing_key,
        }
        return self._batches(self._q.dead_replay_batch, params, progress, upto)

    def dead_purge(
        self,
        where: DeadFilter,
        *,
        batch: int = 1000,
        progress: Progress | None = None,
        upto: int | None = None,
    ) -> int:
        """Delete the matching dead letters for good, `batch` rows per transaction; how many.
        A purged message that was blocking its key leaves the key blocked: release it."""
        params = where.params() | {"batch": _batch(batch)}
        return self._batches(self._q.dead_purge_batch, params, progress, upto)

    def _batches(
        self, query: Any, params: dict[str, Any], progress: Progress | None, upto: int | None
    ) -> int:
        """Run a batch query over the dead rows that exist now (or up to id `upto`), in id
        order, until none is left; how many rows it acted on. Each batch returns its last id
        and its count."""
        params = params | {"upto": self._dead_last_id() if upto is None else upto, "after": 0}
        done = 0
        while True:
            ((last, count),) = self._rows(query, params)
            if last is None:
                return done
            params["after"] = last
            done += count
            if progress is not None and count:
                progress(count)

    def _dead_last_id(self) -> int:
        (row,) = self._rows(self._q.dead_last_id)
        return int(row[0])

    # Idle keys ----------------------------------------------------------------------------------

    def keys_forget(self, idle_for: timedelta, *, progress: Progress | None = None) -> int:
        """Forget every ordering key nobody has used for `idle_for` (an hour or more), with no
        message waiting or dead and no block: its numbering starts again at 1 if it is used
        again. One page of keys per transaction; how many were forgotten. It deletes keys, which
        a producer of that key would wait for: an operator's job, never the relay's."""
        if idle_for < timedelta(hours=1):
            raise errors.InvalidArgument("idle_for must be an hour or more")
        forgotten, after = 0, ""
        while True:
            ((n, last),) = self._rows(
                self._q.forget_idle_keys,
                {"idle": idle_for.total_seconds(), "after": after, "limit": 1000},
            )
            forgotten += int(n)
            if progress is not None and n:
                progress(int(n))
            if last is None:
                return forgotten
            after = str(last)

    # The archive --------------------------------------------------------------------------------

    def archive_stats(self, *, exact: bool = False) -> ArchiveStats:
        (row,) = self._rows(self._q.archive_stats, {"archive": f'"{self._schema}".archive'})
        exact_rows = None
        if exact:
            (count,) = self._rows(self._q.archive_exact_count)
            exact_rows = int(count[0])
        return ArchiveStats(max(int(row[0]), 0), int(row[1]), row[2], row[3], exact_rows)

    def archive_count_older(self, older_than: timedelta) -> int:
        """How many archived rows were published more than `older_than` ago (what a prune with
        that age would delete now)."""
        cutoff = datetime.now(UTC) - older_than
        (row,) = self._rows(self._q.archive_count_older, {"cutoff": cutoff})
        return int(row[0])

    def archive_prune(
        self,
        older_than: timedelta,
        *,
        batch: int = 1000,
        pause: float = 0.05,
        progress: Progress | None = None,
        stop: threading.Event | None = None,
    ) -> int | None:
        """Delete archived rows published more than `older_than` ago, oldest first, `batch` rows
        per short transaction with `pause` seconds between batches, so the live queue never
        waits on a lock and vacuum keeps up. Only one pruner runs at a time per schema: returns
        None (doing nothing) if another holds the lock, else how many rows were deleted. Setting
        `stop` ends it after the current batch."""
        if older_than <= timedelta(0):
            raise errors.InvalidArgument("older_than must be positive")
        cutoff = datetime.now(UTC) - older_than
        stop = stop or threading.Event()
        _batch(batch)
        with locks.exclusive(
            self._conninfo, self._schema, "prune", wait=False, pooled=self._pooled
        ) as held:
            return self._prune(held, cutoff, batch, pause, progress, stop) if held else None

    def _prune(
        self,
        held: locks.Held,
        cutoff: datetime,
        batch: int,
        pause: float,
        progress: Progress | None,
        stop: threading.Event,
    ) -> int:
        deleted = 0
        while True:
            held.check()
            ((gone, younger),) = self._rows(
                self._q.archive_prune_batch, {"batch": _batch(batch), "cutoff": cutoff}
            )
            deleted += int(gone)
            if progress is not None and gone:
                progress(gone)
            if younger or not gone:
                return deleted
            # Spread the deletes out: vacuum and the live queue come first.
            if stop.wait(pause):
                return deleted


def _batch(size: int) -> int:
    if not 1 <= size <= 100_000:
        raise errors.InvalidArgument("batch must be from 1 to 100000")
    return size
