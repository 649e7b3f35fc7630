"""In-memory stand-ins for the loop's ports: a store with a settable clock and a scripted publisher.

The store must behave like PgStore; tests/integration/test_store_contract.py runs the same
contract against both, so the unit tests of the loop can trust it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from relay.core import errors, model


@dataclasses.dataclass
class Row:
    id: int
    message_id: UUID
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    properties: dict[str, Any]
    ordering_key: str | None
    created_at: datetime
    available_at: datetime
    attempts: int = 0
    ambiguous: int = 0
    claim_id: UUID | None = None
    last_error: str | None = None


@dataclasses.dataclass
class Settled:
    row: Row
    reason: str | None = None  # None for archived rows
    detail: str = ""


class MemoryStore:
    """ports.Store in a dict. `now` is a settable clock; `fail_next` makes calls raise outages."""

    def __init__(self, now: datetime | None = None, batch_max_bytes: int | None = None) -> None:
        self.now = now or datetime(2026, 1, 1, tzinfo=UTC)
        self.batch_max_bytes = batch_max_bytes  # None: no byte budget
        self.rows: dict[int, Row] = {}
        self.archive: list[Settled] = []
        self.dead: list[Settled] = []
        self.fail_next: dict[str, int] = {}  # method name -> how many more calls raise
        self.calls: list[str] = []
        self._ids = 0

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def add(
        self,
        exchange: str = "x",
        routing_key: str = "rk",
        body: bytes = b"{}",
        *,
        available_at: datetime | None = None,
        headers: dict[str, Any] | None = None,
        ordering_key: str | None = None,
    ) -> Row:
        self._ids += 1
        row = Row(
            self._ids,
            uuid.uuid4(),
            exchange,
            routing_key,
            body,
            headers or {},
            {"content_type": "application/octet-stream"},
            ordering_key,
            self.now,
            available_at or self.now,
        )
        self.rows[row.id] = row
        return row

    def _enter(self, method: str) -> None:
        self.calls.append(method)
        if self.fail_next.get(method, 0) > 0:
            self.fail_next[method] -= 1
            raise errors.DatabaseUnavailable(f"{method}: simulated outage")

    async def claim(self, ask: model.Ask) -> model.Claim:
        self._enter("claim")
        return self._claim(ask)

    def _claim(self, ask: model.Ask) -> model.Claim:
        """As migration 0026's claim: expired leases first (one lost more than once goes alone),
        then due rows; a row whose attempts are used up goes to dead unread instead."""
        leased = (r for r in self.rows.values() if r.claim_id is not None)
        expired = sorted(
            (r for r in leased if r.available_at <= self.now), key=lambda r: (r.available_at, r.id)
        )[: ask.limit]
        spent = [r for r in expired if r.attempts >= ask.max_attempts]
        taken: list[Row] = []
        left = alone = False  # expired leases left for the next claim; one taken alone
        for row in (r for r in expired if r.attempts < ask.max_attempts):
            if row.attempts >= 2:
                left = True  # alone: as a batch of its own, or after this batch
                alone = not taken
                taken = taken or [row]
                break
            taken.append(row)
        more = left or len(expired) >= ask.limit
        if not more:
            due, more = self._due(ask.limit - len(taken), bool(taken))
            spent += [r for r in due if r.attempts >= ask.max_attempts]
            taken += [r for r in due if r.attempts < ask.max_attempts]
        for row in spent:
            self.dead.append(Settled(self.rows.pop(row.id), "max_attempts", "attempts used up"))
        claim_id = uuid.uuid4()
        for row in taken:
            row.attempts += 1
            row.claim_id = claim_id
            row.available_at = self.now + timedelta(seconds=ask.lease)
        return model.Claim(
            claim_id,
            tuple(_message(r) for r in taken),
            more,
            tuple((r.message_id, r.attempts) for r in spent),
            alone,
        )

    def _due(self, room: int, some: bool) -> tuple[list[Row], bool]:
        """Up to `room` due unclaimed rows (the key gate: only a key's oldest row still here),
        within the byte budget (at least one row unless `some` were taken already); and whether
        due rows were left behind."""
        heads: dict[str, int] = {}
        for row in sorted(self.rows.values(), key=lambda r: r.id):
            if row.ordering_key is not None:
                heads.setdefault(row.ordering_key, row.id)
        due = sorted(
            (
                r
                for r in self.rows.values()
                if r.claim_id is None
                and r.available_at <= self.now
                and (r.ordering_key is None or heads[r.ordering_key] == r.id)
            ),
            key=lambda r: (r.available_at, r.id),
        )[:room]
        locked = len(due)
        if self.batch_max_bytes is not None:
            running, taken = 0, list[Row]()
            for row in due:
                running += (
                    len(row.body) + len(json.dumps(row.headers)) + len(json.dumps(row.properties))
                )
                if (taken or some) and running > self.batch_max_bytes:
                    break
                taken.append(row)
            due = taken
        return due, len(due) < locked or (room > 0 and locked >= room)

    async def extend(self, claim_id: UUID, ids: Sequence[int], lease: float) -> frozenset[int]:
        self._enter("extend")
        rows = [self.rows[i] for i in ids if i in self.rows and self.rows[i].claim_id == claim_id]
        for row in rows:
            row.available_at = self.now + timedelta(seconds=lease)
        return frozenset(row.id for row in rows)

    async def settle(
        self, claim_id: UUID, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        self._enter("settle")  # one transaction: both or neither
        counts = self._settle(claim_id, settlement)
        if then is None:
            return counts, model.Claim(uuid.uuid4(), ())
        return counts, self._claim(then)

    def _settle(self, claim_id: UUID, settlement: model.Settlement) -> model.SettleCounts:
        owned = {i for i, r in self.rows.items() if r.claim_id == claim_id}
        for i in settlement.resent:
            if i in owned:
                self.rows[i].ambiguous += 1
        archived = [i for i in settlement.archive if i in owned]
        dead = [d for d in settlement.dead if d.id in owned]
        retried = [r for r in settlement.retry if r.id in owned]
        for i in archived:
            self.archive.append(Settled(self.rows.pop(i)))
        for d in dead:
            self.dead.append(Settled(self.rows.pop(d.id), d.reason.value, d.detail))
        for r in retried:
            row = self.rows[r.id]
            row.available_at = self.now + timedelta(seconds=r.delay)
            row.attempts -= int(r.refund)
            row.ambiguous += int(r.ambiguous)
            row.claim_id = None
            row.last_error = r.error
        fenced = settlement.size - len(archived) - len(dead) - len(retried)
        return model.SettleCounts(len(archived), len(dead), len(retried), fenced)

    async def stats(self) -> model.Stats:
        self._enter("stats")
        leased = {
            i for i, r in self.rows.items() if r.claim_id is not None and r.available_at > self.now
        }
        pending = [r for i, r in self.rows.items() if i not in leased]
        due = [r for r in pending if r.available_at <= self.now]
        oldest = min((r.created_at for r in due), default=None)
        by_reason: dict[str, int] = {}
        for d in self.dead:
            assert d.reason is not None
            by_reason[d.reason] = by_reason.get(d.reason, 0) + 1
        return model.Stats(
            pending=len(pending),
            due=len(due),
            scheduled=len(pending) - len(due),
            in_flight=len(leased),
            oldest_pending_age_seconds=None
            if oldest is None
            else (self.now - oldest).total_seconds(),
            archived=len(self.archive),
            dead=len(self.dead),
            dead_by_reason=by_reason,
        )


def _message(row: Row) -> model.OutboxMessage:
    return model.OutboxMessage(
        id=row.id,
        message_id=row.message_id,
        exchange=row.exchange,
        routing_key=row.routing_key,
        body=row.body,
        headers=dict(row.headers),
        properties=dict(row.properties),
        ordering_key=row.ordering_key,
        created_at=row.created_at,
        attempts=row.attempts,
        ambiguous=row.ambiguous,
        last_error=row.last_error,
    )


Script = Callable[[model.OutboxMessage], model.PublishResult]


def acked(_: model.OutboxMessage) -> model.PublishResult:
    return model.PublishResult(model.Outcome.ACKED)


class ScriptedPublisher:
    """ports.Publisher whose outcome for each message is decided by `script`.
    `down` > 0 makes that many connect() calls raise BrokerUnavailable; `blocked` stands for a
    broker alarm; with `gate` set, publish() waits for the gate (the broker's confirms) or for
    its `abort`, which turns everything still unconfirmed AMBIGUOUS. Like the real one, it sends
    nothing unless `still_held` says the lease is still the relay's (then: UNSENT)."""

    def __init__(self, script: Script = acked) -> None:
        self.script = script
        self.down = 0
        self.blocked = False
        self.unblocked = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.publishing = asyncio.Event()
        self.published: list[model.OutboxMessage] = []
        self.batches = 0
        self.closes = 0

    async def connect(self) -> None:
        if self.down > 0:
            self.down -= 1
            raise errors.BrokerUnavailable("simulated broker outage")

    async def until_unblocked(self) -> None:
        await self.unblocked.wait()

    async def publish(
        self,
        messages: Sequence[model.OutboxMessage],
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        if still_held is not None and not still_held():
            return [model.PublishResult(model.Outcome.UNSENT, "lease not held") for _ in messages]
        self.batches += 1
        self.published.extend(messages)
        self.publishing.set()
        await asyncio.sleep(0)  # the confirms come back over the network: others run meanwhile
        if self.gate is not None:
            abort = abort or asyncio.Event()
            waiters = [asyncio.ensure_future(self.gate.wait()), asyncio.ensure_future(abort.wait())]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            if not self.gate.is_set():
                return [model.PublishResult(model.Outcome.AMBIGUOUS, "aborted") for _ in messages]
        return [self.script(m) for m in messages]

    async def close(self) -> None:
        self.closes += 1


def observation(**changes: object) -> model.Observation:
    """A healthy observation of a small outbox, with `changes`."""
    seen = model.Observation(
        due=3,
        scheduled=1,
        gated=2,
        in_flight=4,
        oldest_due_seconds=1.5,
        dead=5,
        blocked_keys=0,
        dead_tuples=7,
        last_autovacuum=None,
        autovacuum_on=True,
        xmin_seconds=None,
        xmin_xids=None,
        xmin_pid=None,
        xmin_state=None,
    )
    return dataclasses.replace(seen, **changes)  # type: ignore[arg-type]


class ScriptedReadings:
    """What the watcher and `top` read (ports.Readings), scripted: an exception to raise or the
    values to return; counts the looks at the gauges."""

    def __init__(self, version: int = 20) -> None:
        self.inserts: dict[str, int] = {}
        self.dead: dict[str, int] = {}
        self.version: int | Exception = version
        self.seen: model.Observation | Exception = observation()
        self.observed = 0

    async def schema_version(self) -> int:
        if isinstance(self.version, Exception):
            raise self.version
        return self.version

    async def observe(self) -> model.Observation:
        self.observed += 1
        if isinstance(self.seen, Exception):
            raise self.seen
        return self.seen

    async def table_inserts(self) -> dict[str, int]:
        return dict(self.inserts)

    async def dead_by_reason(self) -> dict[str, int]:
        return dict(self.dead)
