"""A replay's sending half: lake rows made into messages (new ids, provenance headers), sent in
order through enqueue_many, skipping (and recording) what the outbox refuses."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from datetime import UTC, datetime

from psycopg.types.json import Jsonb
from pyspark.sql import Row

from relay.core import errors
from relay.pipeline.database import Batch, ReplayDatabase

#: The message ids a replay gives are uuid5 of this namespace and "<replay name>/<lake id>/<original
#: id>": the same replay gives a message the same new id every time, two replays different ones,
#: and two archived messages that shared an id (one reused after the other was sent) two ids.
NAMESPACE = uuid.UUID("6f1d2c1e-8b0a-5d55-9a43-0c7e0b1d9f21")
#: Which message of a batch enqueue_many refused, in its error ("message 3 of 500: …").
_WHICH = re.compile(r"^enqueue_many: message (\d+) of \d+: ")
#: How many skipped rows a run keeps to tell (the replays table keeps the first 100 too).
KEEP_SKIPPED = 100


def message_id(name: str, lake_id: int, original: str) -> uuid.UUID:
    """The id replay `name` gives the message that had `original` and is `lake_id` in the lake."""
    return uuid.uuid5(NAMESPACE, f"{name}/{lake_id}/{original}")


@dataclasses.dataclass
class Sender:
    """Sends a replay's rows in order, moving its position: whole batches while the outbox takes
    them; past a message it refuses (enqueue_many names it), that message is skipped and the
    rest of the batch sent again."""

    db: ReplayDatabase
    name: str
    to_exchange: str | None  # None: each message's own
    to_routing_key: str | None
    after: int
    enqueued: int = 0
    skipped: int = 0
    first_skipped: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)

    def send(self, rows: list[Row]) -> None:
        good: list[tuple[Row, Message]] = []
        for row in rows:
            if row.id <= self.after:
                continue  # at or behind the position: done before (never expected)
            try:
                good.append((row, message(self.name, row)))
            except errors.InvalidMessage as exc:
                self._batch(good)
                good = []
                self._skip(row, str(exc))
        self._batch(good)

    def _batch(self, rows: list[tuple[Row, Message]]) -> None:
        while rows:
            try:
                self._enqueue(rows)
                return
            except errors.InvalidMessage as exc:
                which = _WHICH.match(str(exc))
                bad = int(which.group(1)) - 1 if which and len(rows) > 1 else 0
                if not 0 <= bad < len(rows):
                    bad = 0
                if bad > 0:
                    self._enqueue(rows[:bad])  # refused for a later message: these are fine
                reason = str(exc) if len(rows) == 1 or which else None
                if reason is None:  # refused, and not saying which: find it one by one
                    self._one_by_one(rows)
                    return
                self._skip(rows[bad][0], _WHICH.sub("", reason))
                rows = rows[bad + 1 :]

    def _one_by_one(self, rows: list[tuple[Row, Message]]) -> None:
        for one in rows:
            try:
                self._enqueue([one])
            except errors.InvalidMessage as exc:
                self._skip(one[0], str(exc))

    def _enqueue(self, rows: list[tuple[Row, Message]]) -> None:
        ids = [row.id for row, _ in rows]
        messages = [m for _, m in rows]
        exchange, routing_key = self.to_exchange, self.to_routing_key
        self.enqueued += self.db.enqueue(
            self.name,
            Batch(
                after=self.after,
                ids=ids,
                exchanges=[m.exchange if exchange is None else exchange for m in messages],
                routing_keys=[
                    m.routing_key if routing_key is None else routing_key for m in messages
                ],
                bodies=[m.body for m in messages],
                headers=[m.headers for m in messages],
                provenance=[Jsonb(m.provenance) for m in messages],
                properties=[m.properties for m in messages],
                ordering_keys=[m.ordering_key for m in messages],
                message_ids=[m.message_id for m in messages],
            ),
        )
        self.after = ids[-1]

    def _skip(self, row: Row, reason: str) -> None:
        self.db.skip(self.name, self.after, row.id, str(row.message_id), reason)
        self.after = row.id
        self.skipped += 1
        if len(self.first_skipped) < KEEP_SKIPPED:
            self.first_skipped.append((row.id, str(row.message_id), reason))


@dataclasses.dataclass(frozen=True)
class Message:
    """A lake row as the message it becomes (its headers and properties as the lake's JSON text,
    merged with the provenance in PostgreSQL, so no value passes through Python's floats)."""

    exchange: str
    routing_key: str
    body: bytes
    headers: str
    provenance: dict[str, str]
    properties: str
    ordering_key: str | None
    message_id: uuid.UUID


def message(name: str, row: Row) -> Message:
    """What lake row `row` becomes; InvalidMessage if it cannot become one (the outbox never
    stores such a row, but a lake is files anyone can write)."""
    if row.body is None or row.published_at is None or row.exchange is None:
        raise errors.InvalidMessage("its body, exchange or publish time is missing in the lake")
    return Message(
        exchange=row.exchange,
        routing_key=row.routing_key or "",
        body=bytes(row.body),
        headers=_object(row.headers, "headers"),
        provenance={
            "x-replay": name,
            "x-replay-of": str(row.message_id),
            "x-replay-published-at": _utc(row.published_at).isoformat(),
            "x-replay-exchange": row.exchange,
            "x-replay-routing-key": row.routing_key or "",
        },
        properties=_object(row.properties, "properties"),
        ordering_key=row.ordering_key,
        message_id=message_id(name, row.id, str(row.message_id)),
    )


def _object(text: str | None, column: str) -> str:
    """`text` if it is a JSON object PostgreSQL's jsonb takes (no NaN or Infinity, no NUL);
    InvalidMessage otherwise."""
    if not text:
        return "{}"
    try:
        loaded = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        loaded = None
    if not isinstance(loaded, dict):
        raise errors.InvalidMessage(f"its {column} in the lake are not a JSON object")
    if "\\u0000" in text or "\x00" in text:
        raise errors.InvalidMessage(f"its {column} in the lake hold a NUL character")
    return text


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON PostgreSQL takes")


def _utc(moment: datetime) -> datetime:
    """A time Spark gave (naive, in this process's local time zone) as UTC."""
    return moment.astimezone(UTC)
