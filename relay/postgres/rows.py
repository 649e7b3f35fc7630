"""Rows and parameters between the store and PostgreSQL: a claimed row as a message, a settlement
as the settle functions' arrays."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from relay.core import model


def to_message(row: Any) -> model.OutboxMessage:
    """A claimed row as a message. JSON that will not decode (a row edited by hand, nesting deeper
    than Python's parser goes) marks this one message invalid instead of failing the claim."""
    invalid = None
    try:
        headers, properties = json.loads(row.headers), json.loads(row.properties)
    except (ValueError, RecursionError) as exc:
        headers, properties = {}, {}
        invalid = f"stored headers or properties cannot be decoded: {type(exc).__name__}"
    return model.OutboxMessage(
        id=row.id,
        message_id=row.message_id,
        exchange=row.exchange,
        routing_key=row.routing_key,
        body=bytes(row.body),
        headers=headers,
        properties=properties,
        ordering_key=row.ordering_key,
        created_at=row.created_at,
        attempts=row.attempts,
        ambiguous=row.ambiguous,
        last_error=row.last_error,
        invalid=invalid,
        seq=row.seq,
        replays=row.replays,
        replayed_at=row.replayed_at,
        replayed_from=row.replayed_from,
    )


def settle_params(claim_id: UUID, settlement: model.Settlement, durable: bool) -> dict[str, Any]:
    """A settlement as the settle function's arrays: one entry per row (migration 0026): its
    fate, the dead letter's reason, the detail or error, the retry's delay."""
    rows: list[tuple[int, str, str | None, str | None, float | None]] = [
        *((i, "archive", None, None, None) for i in settlement.archive),
        *((d.id, "dead", d.reason.value, d.detail, None) for d in settlement.dead),
        *((r.id, _fate(r), None, r.error, r.delay) for r in settlement.retry),
    ]
    return {
        "claim_id": claim_id,
        "ids": [r[0] for r in rows],
        "fates": [r[1] for r in rows],
        "reasons": [r[2] for r in rows],
        "notes": [r[3] for r in rows],
        "delays": [r[4] for r in rows],
        "resent": list(settlement.resent),
        "durable": durable,
    }


def _fate(retry: model.Retry) -> str:
    return "ambiguous" if retry.ambiguous else "refund" if retry.refund else "retry"
