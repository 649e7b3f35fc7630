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
    return {
        "claim_id": claim_id,
        "archive": list(settlement.archive),
        "dead": [d.id for d in settlement.dead],
        "reasons": [d.reason.value for d in settlement.dead],
        "details": [d.detail for d in settlement.dead],
        "retry": [r.id for r in settlement.retry],
        "delays": [r.delay for r in settlement.retry],
        "errors": [r.error for r in settlement.retry],
        "refunds": [r.refund for r in settlement.retry],
        "ambiguous": [r.ambiguous for r in settlement.retry],
        "resent": list(settlement.resent),
        "durable": durable,
    }
