"""The operator's side of the outbox, as a Python API: blocked keys and key policies (the
`outbox-relay keys …` commands are a thin layer over it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

import psycopg

from relay import config, errors, sql
from relay.pg import translate_errors

OnDead = Literal["block", "skip"]


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


class Admin:
    """Operator operations on one outbox schema, over one autocommit connection. Every method
    raises DatabaseUnavailable or SchemaMissing on those failures, InvalidArgument on bad input."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self._conn = conn
        self._schema = schema
        self._q = sql.load(schema)

    @classmethod
    @contextmanager
    def connect(cls, conninfo: str, schema: str = "outbox") -> Iterator[Admin]:
        config.check_identifier(schema)
        with translate_errors(schema):
            conn = psycopg.connect(conninfo, autocommit=True, application_name="outbox-relay admin")
        with conn:
            yield cls(conn, schema)

    def _rows(self, query: Any, params: dict[str, Any] | None = None) -> list[Any]:
        with translate_errors(self._schema):
            cur = self._conn.execute(query, params or {})
            return cur.fetchall() if cur.description else []

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
