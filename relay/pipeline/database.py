"""The pipeline's PostgreSQL side: one run at a time, the export horizon, and verified deletes."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from uuid import UUID

from relay.core import errors
from relay.pipeline.lake import Table
from relay.postgres import locks, pg
from relay.postgres.pg import translate_errors


class PipelineDatabase(pg.Session):
    """An autocommit session, open while the schema's pipeline lock is held (on a connection of
    its own)."""

    _held: locks.Held

    @classmethod
    @contextmanager
    def connect(
        cls, conninfo: str, schema: str, *, pooled: bool = False
    ) -> Iterator[PipelineDatabase]:
        """Take the pipeline lock and open a session; RelayError if another run holds the lock.
        `pooled`: `conninfo` goes through a transaction-mode pooler (PgBouncer)."""
        with locks.exclusive(conninfo, schema, "pipeline", wait=False, pooled=pooled) as held:
            if not held:
                raise errors.RelayError(
                    f'another pipeline run holds schema "{schema}"; try again when it ends'
                )
            with pg.session(conninfo, schema, "pipeline", pooled=pooled) as conn:
                db = cls(conn, schema, conninfo, pooled=pooled)
                db._held = held
                yield db

    def _one(self, query: Any, params: dict[str, Any]) -> tuple[Any, ...]:
        with translate_errors(self._schema):
            row = self._conn.execute(query, params).fetchone()
        assert row is not None
        return tuple(row)

    def horizon(self, table: Table, cutoff: datetime, wait: float = 300.0) -> int:
        """The highest id of `table` older than `cutoff` such that no row with a smaller id can
        still appear: it waits until every transaction that was in progress has ended."""
        self._held.check()  # each range begins here: never two runs at once
        query = (
            self._q.export_horizon_archive if table == "archive" else self._q.export_horizon_dead
        )
        snapshot, last = self._one(query, {"cutoff": cutoff})
        deadline = time.monotonic() + wait
        while not self._one(self._q.snapshot_settled, {"snapshot": snapshot})[0]:
            if time.monotonic() > deadline:
                raise errors.RelayError(
                    f"a transaction has been open for over {wait:g}s; the export waits for every "
                    "transaction that might still add rows below its horizon"
                )
            time.sleep(0.05)
        return int(last)

    def prune_batch(self, lo: int, hi: int, n: int, ids: int, hashes: int) -> tuple[int, int]:
        """Delete archive rows lo < id <= hi if they match the lake's figures; (there, deleted)."""
        self._held.check()
        params = {"lo": lo, "hi": hi, "n": n, "ids": ids, "hashes": hashes}
        there, deleted = self._one(self._q.pipeline_prune_batch, params)
        return int(there), int(deleted)

    def prune_rows(self, ids: Sequence[int], message_ids: Sequence[UUID | str]) -> int:
        """Delete exactly these (id, message_id) rows from the archive; how many."""
        params = {"ids": list(ids), "message_ids": [str(m) for m in message_ids]}
        with translate_errors(self._schema):
            return self._conn.execute(self._q.pipeline_prune_rows, params).rowcount
