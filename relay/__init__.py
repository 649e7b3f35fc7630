"""outbox-relay: a transactional outbox relay from PostgreSQL to RabbitMQ.

Producers call `relay.enqueue(conn, ...)` (or `relay.enqueue_async`, or `relay.enqueue_many` for
batches) inside their own transaction;
`outbox-relay run` publishes what commits. The producer functions load psycopg on first use, so
`import relay.core.model` stays free of drivers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.3.0.dev0"

if TYPE_CHECKING:
    from relay.postgres.producer import (
        Message,
        enqueue,
        enqueue_async,
        enqueue_many,
        enqueue_many_async,
    )

__all__ = [
    "Message",
    "__version__",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
]


def __getattr__(name: str) -> Any:
    if name in ("Message", "enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"):
        from relay.postgres import producer

        return getattr(producer, name)
    raise AttributeError(f"module 'relay' has no attribute {name!r}")
