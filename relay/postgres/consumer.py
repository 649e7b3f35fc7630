"""Helpers for consumers of the relay's messages: an idempotent inbox, and a per-key order check.

Delivery is at least once, so a consumer sees a message twice after a relay crash, a lost
confirm or a replay. For consumers that keep their state in PostgreSQL, `Inbox.handle` records the
message_id in the consumer's own transaction: a duplicate is skipped exactly when the first copy's
effects committed (a concurrent copy waits for the first to commit or roll back).

    inbox = Inbox()                      # table public.outbox_inbox
    await inbox.create(conn)             # once, e.g. in the consumer's migrations
    async with conn.transaction(), inbox.handle(conn, message) as fresh:
        if fresh:
            await apply_effects(conn, message)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol
from uuid import UUID

import psycopg
from psycopg import sql

from relay.core import errors, model

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


class Delivered(Protocol):
    """What the helpers read of a message: aio-pika's IncomingMessage has both."""

    @property
    def message_id(self) -> str | None: ...

    @property
    def headers(self) -> Mapping[str, Any]: ...


class Inbox:
    """The message_ids a consumer has applied, in a table of its own database."""

    def __init__(self, table: str = "outbox_inbox", schema: str = "public") -> None:
        for name in (table, schema):
            if not _NAME.fullmatch(name):
                raise errors.ConfigError(f"invalid table or schema name {name!r}")
        self._table = sql.Identifier(schema, table)

    async def create(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Create the table if it is missing (in `conn`'s transaction)."""
        await conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (message_id uuid PRIMARY KEY,"
                " received_at timestamptz NOT NULL DEFAULT now())"
            ).format(self._table)
        )

    @contextlib.asynccontextmanager
    async def handle(
        self, conn: psycopg.AsyncConnection[Any], message: Delivered | UUID | str
    ) -> AsyncIterator[bool]:
        """Record `message` in `conn`'s current transaction and yield whether it is new. Apply its
        effects only if it is, in the same transaction, then commit; the caller owns the
        transaction (an exception inside rolls nothing back by itself). Raises InvalidMessage if
        the message has no valid message_id."""
        message_id = _message_id(message)
        cur = await conn.execute(
            sql.SQL("INSERT INTO {} (message_id) VALUES (%s) ON CONFLICT DO NOTHING").format(
                self._table
            ),
            [message_id],
        )
        yield cur.rowcount == 1

    async def forget_before(self, conn: psycopg.AsyncConnection[Any], days: float) -> int:
        """Delete entries older than `days` (keep them longer than any redelivery can come)."""
        cur = await conn.execute(
            sql.SQL("DELETE FROM {} WHERE received_at < now() - make_interval(days => %s)").format(
                self._table
            ),
            [days],
        )
        return cur.rowcount


def _message_id(message: Delivered | UUID | str) -> UUID:
    raw = message if isinstance(message, UUID | str) else message.message_id
    try:
        return raw if isinstance(raw, UUID) else UUID(str(raw))
    except ValueError:
        raise errors.InvalidMessage(f"message_id {raw!r} is not a UUID") from None


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """An ordering key's message that did not come next: a gap (some skipped), a reorder, or a
    restart (number 1 again: `outbox-relay keys forget` forgot the key while it was unused)."""

    key: str
    kind: str  # "gap", "reorder" or "restart"
    expected: int
    got: int

    def __str__(self) -> str:
        return f"key {self.key!r}: {self.kind}, expected sequence {self.expected}, got {self.got}"


class SequenceChecker:
    """Follows the `x-outbox-sequence` of each ordering key as messages arrive (in one process)
    and reports what did not come next. A repeat of the last sequence is a redelivery, not a
    problem; a lower one is a reorder; a higher one than next is a gap (a message still to come
    late, dead-lettered under the `skip` policy, or lost before it reached this queue). Number 1
    after a higher one is a restart: a key `outbox-relay keys forget` forgot while it was unused is
    numbered from 1 again; it is reported (kind "restart") and followed from there."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def observe(self, message: Delivered) -> Problem | None:
        headers = message.headers or {}
        key, seq = headers.get(model.ORDERING_KEY_HEADER), headers.get(model.SEQUENCE_HEADER)
        if key is None or seq is None:
            return None  # not a keyed message
        key = key.decode() if isinstance(key, bytes) else str(key)
        seq = int(seq)
        last = self._last.get(key)
        if last is None or seq == last + 1:
            self._last[key] = seq
            return None
        if seq == last:
            return None
        if seq == 1:
            self._last[key] = seq
            return Problem(key, "restart", last + 1, seq)
        if seq < last:
            return Problem(key, "reorder", last + 1, seq)
        self._last[key] = seq
        return Problem(key, "gap", last + 1, seq)
