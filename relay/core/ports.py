"""The interfaces the relay loop needs from the outside world (a store and a publisher), and what
the chores beside it read (the outbox's readings, the broker's state)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol
from uuid import UUID

from relay.core import model


class Store(Protocol):
    """Where outbox rows live. Raises errors.DatabaseUnavailable if the database is unreachable,
    errors.LockTimeout when a lock was not granted in time (retry it)."""

    async def claim(self, ask: model.Ask) -> model.Claim:
        """Lease due rows (expired leases first) as `ask` says, counting an attempt each."""
        ...

    async def settle(
        self, claim_id: UUID, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        """Apply a claim's transitions in one transaction, skipping rows no longer under
        `claim_id`; with `then`, claim the next batch in the same transaction (it sees the keyed
        rows the settle released): one round trip for both. Without, the claim is empty."""
        ...

    async def extend(self, claim_id: UUID, ids: Sequence[int], lease: float) -> frozenset[int]:
        """Push the lease of rows still under `claim_id` to `lease` seconds from now (by the
        database's clock); return those rows. The others were re-claimed by another relay."""
        ...

    async def stats(self) -> model.Stats:
        """Counts of pending, in-flight, archived and dead rows."""
        ...


class Doorbell(Protocol):
    """Producers wake a relay (NOTIFY) only while some relay holds the doorbell. `armed` is set
    while this relay holds it and `arms` counts the times it took it: every producer that
    committed without waking anyone did so before the latest, so a look for work that began
    after it sees their rows. `lost` is set when the doorbell went with its session."""

    armed: asyncio.Event
    lost: asyncio.Event
    arms: int

    def arm(self) -> None:
        """Take it in the background, before sleeping."""
        ...

    def disarm(self) -> None:
        """Let go of it in the background (`armed` is clear at once), when working back to back."""
        ...


class Publisher(Protocol):
    """Where messages go. Raises errors.BrokerUnavailable when the broker cannot be reached."""

    async def connect(self) -> None:
        """Make sure a connection and channels are open; cheap when they already are."""
        ...

    @property
    def blocked(self) -> bool:
        """True while the broker refuses to accept publishes (a memory or disk alarm)."""
        ...

    async def until_unblocked(self) -> None:
        """Return once the broker accepts publishes again (or the connection is gone)."""
        ...

    async def publish(
        self,
        messages: Sequence[model.OutboxMessage],
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        """Publish all messages and return one result per message, in order. Never raises for a
        per-message failure: a lost connection makes the unconfirmed messages AMBIGUOUS. Setting
        `abort` stops waiting for confirms; what is still unconfirmed comes back AMBIGUOUS.
        `still_held` is asked right before anything is written: once it says no (the lease on
        the messages may have passed to another relay), nothing more is written, and messages
        never written come back UNSENT."""
        ...

    async def close(self) -> None: ...


class Readings(Protocol):
    """What the watcher and `top` read of the outbox. Raises errors.DatabaseUnavailable when the
    database is unreachable, errors.SchemaMissing before the first `migrate`."""

    async def schema_version(self) -> int:
        """The newest migration applied."""
        ...

    async def observe(self) -> model.Observation:
        """The gauges' snapshot: backlog by state and the database's health."""
        ...

    async def table_inserts(self) -> dict[str, int]:
        """Rows ever inserted into messages, archive and dead (for rates between two readings)."""
        ...

    async def dead_by_reason(self) -> dict[str, int]:
        """Dead letters waiting, by reason."""
        ...


class BrokerState(Protocol):
    """What the watcher reads of the publisher for the probes and the broker gauges."""

    @property
    def connected(self) -> bool: ...

    @property
    def blocked(self) -> bool: ...


class Progress(Protocol):
    """A loop that says when it last cycled or waited on purpose (`time.monotonic()`)."""

    @property
    def last_progress(self) -> float: ...
