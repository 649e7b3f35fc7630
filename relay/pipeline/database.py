"""The pipeline's PostgreSQL side: one run at a time, the export horizon, verified deletes, and
replays' batches with their positions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg.errors
from psycopg.types.json import Jsonb

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


@dataclasses.dataclass(frozen=True)
class ReplayState:
    """A replay's row: the last lake id it is done with, the messages it enqueued, the rows it
    skipped (and the first 100 of them, with why), and what it selects."""

    position: int
    enqueued: int
    skipped: int
    skips: list[dict[str, Any]]
    selection: dict[str, Any]
    started_by: str
    started_at: datetime


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a replay: its lake rows (ids ascending, all past `after`) as messages."""

    after: int
    ids: list[int]
    exchanges: list[str]
    routing_keys: list[str]
    bodies: list[bytes]
    headers: list[str]  # JSON objects as the lake holds them
    provenance: list[Jsonb]  # merged over the headers (sql/0021_lake_replays.sql)
    properties: list[str]  # JSON objects as the lake holds them
    ordering_keys: list[str | None]
    message_ids: list[UUID]


class ReplayDatabase(pg.Session):
    """An autocommit session for replays from the lake. It takes no pipeline lock (a replay runs
    for as long as its rate makes it, beside exports and prunes); each replay's position fences
    its writes instead (sql/0021_lake_replays.sql)."""

    @classmethod
    @contextmanager
    def connect(
        cls, conninfo: str, schema: str, *, pooled: bool = False
    ) -> Iterator[ReplayDatabase]:
        with pg.session(conninfo, schema, "replay", pooled=pooled) as conn:
            yield cls(conn, schema, conninfo, pooled=pooled)

    def find(self, name: str) -> ReplayState | None:
        """The replay called `name`, if it was ever started."""
        return self._start(name, None, create=False)

    def start(self, name: str, selection: dict[str, Any]) -> ReplayState:
        """The replay called `name`, started with `selection` unless it exists already."""
        state = self._start(name, Jsonb(selection), create=True)
        assert state is not None  # start_replay returns the row it found or made
        return state

    def _start(self, name: str, selection: Jsonb | None, *, create: bool) -> ReplayState | None:
        params = {"name": name, "selection": selection, "create": create}
        with _replay_errors(self._schema):
            row = self._conn.execute(self._q.replay_start, params).fetchone()
        return None if row is None else ReplayState(*row)

    def enqueue(self, name: str, batch: Batch) -> int:
        """Enqueue `batch` and move the replay's position to its last id, in one transaction.
        RelayError if the position is no longer `batch.after` (another run of it is going);
        InvalidMessage if the outbox refuses a message of it (then nothing was enqueued)."""
        params = {"name": name, **dataclasses.asdict(batch)}
        with _replay_errors(self._schema):
            row = self._conn.execute(self._q.replay_batch, params).fetchone()
        assert row is not None
        return int(row[0])

    def skip(self, name: str, after: int, lake_id: int, message_id: str, reason: str) -> None:
        """Move the replay's position past lake row `lake_id`, which it does not send, and record
        why; RelayError as for `enqueue`."""
        params = {
            "name": name,
            "after": after,
            "id": lake_id,
            "message_id": message_id,
            "reason": reason,
        }
        with _replay_errors(self._schema):
            self._conn.execute(self._q.replay_skip, params)


@contextmanager
def _replay_errors(schema: str) -> Iterator[None]:
    with translate_errors(schema):
        try:
            yield
        except psycopg.errors.ObjectInUse as exc:
            raise errors.RelayError(
                f"{exc.diag.message_primary}; when it ends, run this replay again to continue"
            ) from None
        except psycopg.errors.InvalidParameterValue as exc:
            text = exc.diag.message_primary or str(exc)
            if text.startswith("enqueue"):  # the outbox's own check of a message
                raise errors.InvalidMessage(text) from None
            raise errors.InvalidArgument(text) from None
        except psycopg.errors.InsufficientPrivilege as exc:
            raise errors.RelayError(
                f"{exc.diag.message_primary} (a replay enqueues, so it runs as a producer login "
                "of the schema, the one that started it)"
            ) from None
        except psycopg.errors.UniqueViolation as exc:
            raise errors.RelayError(
                f"{exc.diag.message_primary}: a message of this replay is still waiting in the "
                "outbox although the replay's position is behind it"
            ) from None
