"""A relay of the previous release (0.2, migrations up to 0014) in the interleaving world: its own
statements against today's schema, as during a rolling upgrade. It claims from the start of the
due rows (no cursor), takes an orphan alone when it finds one (after burying exhausted ones), renews
with a plain UPDATE that waits for locks, settles through the twelve-argument `settle` (kept for
it by migration 0026), and knows nothing of rescues. The real loop drives it, as it drives PgStore:
what differs between releases is what reaches the database."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from psycopg.rows import namedtuple_row

from relay.core import model
from relay.postgres import pg, rows, store

#: 0.2's statements (relay/queries.sql at 368e2e9), `{schema}` as `outbox`.
CLAIM = """
WITH due AS MATERIALIZED (
    SELECT id, available_at,
           octet_length(body) + pg_column_size(headers) + pg_column_size(properties) AS bytes
    FROM outbox.messages
    WHERE claim_id IS NULL AND NOT gated AND available_at <= now()
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), taken AS MATERIALIZED (
    SELECT id
    FROM (SELECT id, bytes, sum(bytes) OVER (ORDER BY available_at, id) AS running
          FROM due) AS sized
    WHERE running <= %(max_bytes)s OR running = bytes
)
UPDATE outbox.messages AS m
SET attempts = m.attempts + 1,
    claim_id = %(claim_id)s,
    claimed_by = %(claimed_by)s,
    claimed_at = now(),
    available_at = now() + make_interval(secs => %(lease)s)
FROM taken
WHERE m.id = taken.id
RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers::text AS headers,
          m.properties::text AS properties, m.ordering_key, m.created_at, m.attempts, m.ambiguous,
          m.last_error, m.seq, m.replays, m.replayed_at, m.replayed_from,
          (SELECT count(*) FROM due) AS locked
"""
ORPHAN = """
WITH due AS MATERIALIZED (
    SELECT id
    FROM outbox.messages
    WHERE claim_id IS NOT NULL AND available_at <= now() AND attempts < %(max_attempts)s
    ORDER BY available_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox.messages AS m
SET attempts = m.attempts + 1,
    claim_id = %(claim_id)s,
    claimed_by = %(claimed_by)s,
    claimed_at = now(),
    available_at = now() + make_interval(secs => %(lease)s)
FROM due
WHERE m.id = due.id
RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers::text AS headers,
          m.properties::text AS properties, m.ordering_key, m.created_at, m.attempts, m.ambiguous,
          m.last_error, m.seq, m.replays, m.replayed_at, m.replayed_from
"""
BURY = "SELECT buried_id, buried_attempts FROM outbox.bury_exhausted(%(max_attempts)s, 1000)"
EXTEND = """
UPDATE outbox.messages
SET available_at = now() + make_interval(secs => %(lease)s)
WHERE id = ANY(%(ids)s::bigint[]) AND claim_id = %(claim_id)s
RETURNING id
"""
SETTLE = """
SELECT archived, dead, retried, released, blocked
FROM outbox.settle(
    %(claim_id)s, %(archive)s::bigint[], %(dead)s::bigint[], %(reasons)s::text[],
    %(details)s::text[], %(retry)s::bigint[], %(delays)s::float8[], %(errors)s::text[],
    %(refunds)s::boolean[], %(ambiguous)s::boolean[], %(resent)s::bigint[], %(durable)s)
"""


def settle_params(params: dict[str, Any]) -> dict[str, Any]:
    """Today's settle arrays (rows.settle_params) as 0.2's twelve arguments."""
    by_fate: dict[str, list[int]] = {}
    for i, fate in zip(params["ids"], params["fates"], strict=True):
        by_fate.setdefault(fate, []).append(i)
    dead = [n for n, fate in enumerate(params["fates"]) if fate == "dead"]
    retry = [n for n, fate in enumerate(params["fates"]) if fate not in ("archive", "dead")]
    return {
        "claim_id": params["claim_id"],
        "archive": by_fate.get("archive", []),
        "dead": [params["ids"][n] for n in dead],
        "reasons": [params["reasons"][n] for n in dead],
        "details": [params["notes"][n] for n in dead],
        "retry": [params["ids"][n] for n in retry],
        "delays": [params["delays"][n] for n in retry],
        "errors": [params["notes"][n] for n in retry],
        "refunds": [params["fates"][n] in ("refund", "ambiguous") for n in retry],
        "ambiguous": [params["fates"][n] == "ambiguous" for n in retry],
        "resent": params["resent"],
        "durable": params["durable"],
    }


class LegacyStore(store.PgStore):
    """ports.Store with 0.2's statements (see the module's docstring)."""

    async def claim(self, ask: model.Ask) -> model.Claim:
        params: dict[str, Any] = {
            "limit": ask.limit,
            "max_bytes": self._batch_max_bytes,
            "lease": ask.lease,
            "claim_id": uuid.uuid4(),
            "claimed_by": self._relay_name,
            "max_attempts": ask.max_attempts,
        }
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=namedtuple_row)
            await cur.execute(BURY, params)
            buried = tuple((UUID(str(m)), int(n)) for m, n in await cur.fetchall())
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=namedtuple_row)
            await cur.execute(ORPHAN, params)
            found: list[Any] = await cur.fetchall()
            if not found:
                await cur.execute(CLAIM, params)
                found = await cur.fetchall()
        messages = tuple(rows.to_message(r) for r in sorted(found, key=lambda r: r.id))
        locked = max((int(getattr(r, "locked", 1)) for r in found), default=0)
        return model.Claim(params["claim_id"], messages, locked > len(found), buried)

    async def extend(self, claim_id: UUID, ids: Sequence[int], lease: float) -> frozenset[int]:
        async with self._connection() as conn:
            cur = await conn.execute(
                EXTEND, {"claim_id": claim_id, "ids": list(ids), "lease": lease}
            )
            return frozenset(int(i) for (i,) in await cur.fetchall())

    async def settle(
        self, claim_id: UUID, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        params = settle_params(rows.settle_params(claim_id, settlement, True))
        async with self._connection() as conn:
            cur = await conn.execute(SETTLE, params)
            archived, dead, retried, released, blocked = await pg.one_row(cur)
        fenced = settlement.size - archived - dead - retried
        counts = model.SettleCounts(archived, dead, retried, fenced, released, blocked)
        return counts, model.Claim(uuid.uuid4(), ())

    async def rescue(self) -> int:
        return 0  # 0.2 had none: its claims start from the beginning every time
