"""The web console's bulk actions on dead letters: replay or purge every row a filter matches,
recorded in console_actions (who, when, the filter, the count, the outcome), run in batches by
Admin (the CLI's own replay and purge), one action per selection at a time.

Why it cannot replay a row twice: each batch moves a row from `dead` in the transaction that
locks it (FOR UPDATE SKIP LOCKED), so two actions, or an action and the CLI, split the rows
between them. Why a second operator is told what happened rather than starting again: the unique
index over running selections refuses the second start, and a start that finds nothing left
names the action that took it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import zlib
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

import psycopg
import psycopg.errors
from psycopg.types.json import Jsonb

from relay.core import errors
from relay.core.filters import DeadFilter
from relay.postgres import admin, pg, sql

log = logging.getLogger("relay.console")

Kind = Literal["replay", "purge"]
#: An action is taken for dead when no session holds its advisory lock (its runner's session
#: takes it as it records the action) and it has not moved for this long: the next start of its
#: selection marks it interrupted. Behind a transaction pooler there is no session lock, and
#: this alone decides. An action's statements wait for a lock at most LOCK_WAIT.
STALE_AFTER = 60.0
LOCK_WAIT = "10s"
#: Counts the rows a filter matches up to a dead id (browse.Browser.count).
Counter = Callable[[DeadFilter, int], int]


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    id: int
    kind: str
    who: str
    db_user: str
    filter: dict[str, Any]
    matched: int
    done: int
    state: str  # running, finished, failed, interrupted
    detail: str
    started_at: datetime
    beat_at: datetime
    finished_at: datetime | None


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    action: Action


@dataclasses.dataclass(frozen=True, slots=True)
class Already:
    """The same selection is being acted on (running), or nothing matches any more and this is
    the action that last acted on it (None: none did)."""

    action: Action | None
    running: bool


def selection(kind: Kind, where: DeadFilter) -> str:
    """What makes two actions the same: their kind and their filter, canonically, with its times
    to the minute (two operators who both asked for "since 2h" a few seconds apart asked for
    the same thing)."""
    described = describe(where)
    for name in ("since", "until"):
        when = getattr(where, name)
        if when is not None:
            described[name] = when.replace(second=0, microsecond=0).isoformat()
    text = json.dumps({"kind": kind, "filter": described}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def describe(where: DeadFilter) -> dict[str, Any]:
    """The filter as the record keeps it (JSON: times in ISO 8601, ids as text)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(where):
        value = getattr(where, field.name)
        if value is None:
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = [str(v) for v in value]
        out[field.name] = value
    return out


class Actions:
    """Starts and runs bulk actions against one schema, each on a connection of its own."""

    def __init__(
        self, conninfo: str, count: Counter, schema: str = "outbox", *, pooled: bool = False
    ) -> None:
        self._conninfo = conninfo
        self._count = count
        self._schema = schema
        self._pooled = pooled
        self._q = sql.load(schema)
        #: The advisory lock class of this schema's actions (the second key is the action's id).
        self._lock_class = zlib.crc32(f"outbox-relay console {schema}".encode()) & 0x7FFFFFFF
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(
        self,
        kind: Kind,
        who: str,
        where: DeadFilter,
        upto: int,
        *,
        batch: int = 500,
        on_end: Callable[[Action], object] | None = None,
    ) -> Started | Already:
        """Record the action and start it in the background, on the dead rows up to id `upto`
        (what its confirm page counted); or say who is already at it, or who took the rows."""
        chosen = selection(kind, where)
        lock = {"lock_class": self._lock_class}
        ops = admin.Admin(self._connect(), self._schema, self._conninfo, pooled=self._pooled)
        conn = ops._conn
        try:
            with pg.translate_errors(self._schema):
                conn.execute(
                    self._q.action_interrupt_stale,
                    {"selection": chosen, "stale": STALE_AFTER} | lock,
                )
                matched = self._count(where, upto)
                if matched == 0:
                    latest = self._latest(conn, chosen)
                    conn.close()
                    return Already(latest, running=False)
                try:
                    row = conn.execute(
                        self._q.action_start,
                        {
                            "kind": kind,
                            "who": who,
                            "filter": Jsonb(describe(where)),
                            "selection": chosen,
                            "upto": upto,
                            "matched": matched,
                            "lock": not self._pooled,
                        }
                        | lock,
                    ).fetchone()
                except psycopg.errors.UniqueViolation:
                    latest = self._latest(conn, chosen)
                    conn.close()
                    return Already(latest, running=True)
                assert row is not None
                action_id = int(row[0])
                if self._count(where, upto) == 0:
                    # An action of this selection that ended between the count and the record
                    # took the rows: say which, and record this one as having found nothing.
                    self._end(conn, action_id, "finished", "nothing left to act on", None)
                    latest = self._latest(conn, chosen, exclude=action_id)
                    conn.close()
                    return Already(latest, running=False)
                action = self._get(conn, action_id)
                assert action is not None  # written just now, in this session
        except BaseException:
            conn.close()
            raise
        log.info(
            "console action %d: %s of %d dead letters by %s, filter %s",
            action.id,
            kind,
            matched,
            who,
            json.dumps(action.filter, sort_keys=True),
        )
        thread = threading.Thread(
            target=self._run,
            args=(ops, action.id, kind, where, upto, batch, on_end),
            name=f"console action {action.id}",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()
        return Started(action)

    def _connect(self) -> psycopg.Connection[Any]:
        """The session an action is recorded and run in (its advisory lock lives with it)."""
        with pg.translate_errors(self._schema):
            conn = psycopg.connect(
                self._conninfo,
                autocommit=True,
                application_name=f"{pg.APPLICATION_NAME} console",
                **pg.options(self._pooled),
            )
            if not self._pooled:
                conn.execute(self._q.action_lock_wait, {"wait": LOCK_WAIT})
        return conn

    def get(self, action_id: int) -> Action | None:
        with pg.session(self._conninfo, self._schema, "console", pooled=self._pooled) as conn:
            return self._get(conn, action_id)

    def recent(self, limit: int = 50) -> list[Action]:
        with pg.session(self._conninfo, self._schema, "console", pooled=self._pooled) as conn:
            with pg.translate_errors(self._schema):
                rows = conn.execute(self._q.action_list, {"limit": limit}).fetchall()
            return [Action(*row) for row in rows]

    def join(self, timeout: float | None = None) -> None:
        """Waits for the actions started so far to end."""
        for thread in self._threads:
            thread.join(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the running actions after their current batch (recorded as interrupted)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def _get(self, conn: psycopg.Connection[Any], action_id: int) -> Action | None:
        with pg.translate_errors(self._schema):
            row = conn.execute(self._q.action_get, {"id": action_id}).fetchone()
        return None if row is None else Action(*row)

    def _latest(
        self, conn: psycopg.Connection[Any], chosen: str, exclude: int = 0
    ) -> Action | None:
        with pg.translate_errors(self._schema):
            params = {"selection": chosen, "exclude": exclude}
            row = conn.execute(self._q.action_latest, params).fetchone()
        return None if row is None else Action(*row)

    def _run(
        self,
        ops: admin.Admin,
        action_id: int,
        kind: Kind,
        where: DeadFilter,
        upto: int,
        batch: int,
        on_end: Callable[[Action], object] | None,
    ) -> None:
        state, detail = "finished", ""
        conn = ops._conn
        try:
            with conn:
                beat = self._q.action_progress

                def progress(done: int) -> None:
                    moved = conn.execute(beat, {"id": action_id, "done": done}).rowcount
                    if moved == 0:
                        raise _Stopped("another start took it over as stale")
                    if self._stop.is_set():
                        raise _Stopped("the console stopped; start it again to go on")

                try:
                    if kind == "replay":
                        ops.dead_replay(where, batch=batch, progress=progress, upto=upto)
                    else:
                        ops.dead_purge(where, batch=batch, progress=progress, upto=upto)
                    left = self._count(where, upto)
                    if left:
                        detail = (
                            f"{left} still match: their message id is already waiting"
                            if kind == "replay"
                            else f"{left} still match: another action held them"
                        )
                except _Stopped as stopped:
                    state, detail = "interrupted", str(stopped)
                self._end(conn, action_id, state, detail, on_end)
        except (errors.RelayError, psycopg.Error) as exc:
            self._fail(action_id, pg.first_line(exc), on_end)

    def _end(
        self,
        conn: psycopg.Connection[Any],
        action_id: int,
        state: str,
        detail: str,
        on_end: Callable[[Action], object] | None,
    ) -> None:
        conn.execute(self._q.action_end, {"id": action_id, "state": state, "detail": detail})
        action = self._get(conn, action_id)
        if action is not None:
            log.info(
                "console action %d %s: %d of %d%s",
                action_id,
                action.state,
                action.done,
                action.matched,
                f" ({action.detail})" if action.detail else "",
            )
        if on_end is not None and action is not None:
            on_end(action)

    def _fail(self, action_id: int, detail: str, on_end: Callable[[Action], object] | None) -> None:
        """Record a failure on a new connection (the action's own may be what failed)."""
        try:
            with pg.session(self._conninfo, self._schema, "console", pooled=self._pooled) as conn:
                self._end(conn, action_id, "failed", detail, on_end)
        except (errors.RelayError, psycopg.Error):
            pass  # the record stays running and goes stale: the next start marks it interrupted


class _Stopped(Exception):
    """Raised between batches to end an action when the console stops."""
