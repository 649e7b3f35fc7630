"""The interfaces the relay loop needs from the outside world: a store and a publisher."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol
from uuid import UUID

from relay import model


class Store(Protocol):
    """Where outbox rows live. Raises errors.DatabaseUnavailable if the database is unreachable."""

    async def claim(self, limit: int, lease: float) -> model.Claim:
        """Lease up to `limit` due rows for `lease` seconds, counting one attempt on each."""
        ...

    async def settle(self, claim_id: UUID, settlement: model.Settlement) -> model.SettleCounts:
        """Apply a claim's transitions in one transaction; skip rows no longer under `claim_id`."""
        ...

    async def stats(self) -> model.Stats:
        """Counts of pending, in-flight, archived and dead rows."""
        ...


class Publisher(Protocol):
    """Where messages go. Raises errors.BrokerUnavailable when the broker cannot be reached."""

    async def connect(self) -> None:
        """Make sure a connection and channels are open; cheap when they already are."""
        ...

    async def publish(self, messages: Sequence[model.OutboxMessage]) -> list[model.PublishResult]:
        """Publish all messages and return one result per message, in order. Never raises for a
        per-message failure: a lost connection makes the unconfirmed messages AMBIGUOUS."""
        ...

    async def close(self) -> None: ...
