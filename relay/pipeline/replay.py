"""Replays from the lake: archived messages selected on Spark, put back in the outbox through
enqueue_many at the operator's rate, in the lake's id order, resumably and idempotently."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any

from psycopg.types.json import Jsonb
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F  # Spark's own convention
from pyspark.sql import types as T

from relay.core import errors
from relay.core.filters import glob_to_like
from relay.pipeline import pace
from relay.pipeline.database import Batch, ReplayDatabase
from relay.pipeline.lake import Manifest, read, table_path

#: The message ids a replay gives are uuid5 of this namespace and "<replay name>/<lake id>/<original
#: id>": the same replay gives a message the same new id every time, two replays different ones,
#: and two archived messages that shared an id (one reused after the other was sent) two ids.
NAMESPACE = uuid.UUID("6f1d2c1e-8b0a-5d55-9a43-0c7e0b1d9f21")
#: The provenance headers each replayed message carries (a producer may not use `x-outbox-`).
HEADERS = (
    "x-replay",
    "x-replay-of",
    "x-replay-published-at",
    "x-replay-exchange",
    "x-replay-routing-key",
)
#: What a replay reads of the lake's archive: columns every version of it had, given rather than
#: inferred, so that no file outside the selection's days is opened (not even for its footer).
SCHEMA = T.StructType(
    [
        T.StructField("id", T.LongType()),
        T.StructField("message_id", T.StringType()),
        T.StructField("exchange", T.StringType()),
        T.StructField("routing_key", T.StringType()),
        T.StructField("body", T.BinaryType()),
        T.StructField("headers", T.StringType()),
        T.StructField("properties", T.StringType()),
        T.StructField("ordering_key", T.StringType()),
        T.StructField("published_at", T.TimestampType()),
        T.StructField("day", T.DateType()),
        T.StructField("id_range", T.StringType()),
    ]
)
#: A batch is sent once it holds this many bytes of bodies, whatever --batch says (a bytea[]
#: parameter is one value, and PostgreSQL's values stop at 1 GB).
BATCH_BYTES = 64 * 1024 * 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
#: Which message of a batch enqueue_many refused, in its error ("message 3 of 500: …").
_WHICH = re.compile(r"^enqueue_many: message (\d+) of \d+: ")
#: How many skipped rows a run keeps to tell (the replays table keeps the first 100 too).
KEEP_SKIPPED = 100

Progress = Callable[[int], object]
Say = Callable[[str], object]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which archived messages a replay takes (every field left None matches everything) and
    where it sends them (None: where they went). Messages that were themselves replays (they
    carry `x-replay`) are left out unless `include_replays`."""

    since: datetime | None = None  # published at or after
    until: datetime | None = None  # published before
    exchange: str | None = None  # exactly
    routing_key: str | None = None  # a shell glob (* and ?)
    key: str | None = None  # a shell glob over the ordering key
    to_exchange: str | None = None
    to_routing_key: str | None = None
    include_replays: bool = False

    def checked(self) -> Selection:
        """Itself, or InvalidArgument saying what is wrong with it."""
        for bound in (self.since, self.until):
            if bound is not None and bound.tzinfo is None:
                raise errors.InvalidArgument("a replay's time bounds must be timezone-aware")
            if bound is not None and not 2 <= bound.astimezone(UTC).year <= 9998:
                raise errors.InvalidArgument(
                    f"a replay's time bound must be within years 2–9998, not {bound}"
                )
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise errors.InvalidArgument("--since must be before --until")
        for name in ("to_exchange", "to_routing_key"):
            value = getattr(self, name)
            if value is not None and len(value.encode()) > 255:
                raise errors.InvalidArgument(f"--{name.replace('_', '-')}: over 255 bytes")
        return self

    def document(self) -> dict[str, Any]:
        """As the replays table keeps it (times in ISO 8601)."""
        return {
            k: v.isoformat() if isinstance(v, datetime) else v
            for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> Selection:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in document.items() if k in fields}
        for bound in ("since", "until"):
            if values.get(bound) is not None:
                values[bound] = datetime.fromisoformat(values[bound])
        return cls(**values)

    def target(self) -> str:
        parts = [f"exchange {self.to_exchange!r}" if self.to_exchange is not None else ""]
        parts.append(
            f"routing key {self.to_routing_key!r}" if self.to_routing_key is not None else ""
        )
        chosen = " and ".join(p for p in parts if p)
        return f" to {chosen}" if chosen else ""


def check_name(name: str) -> str:
    """`name`, or InvalidArgument unless it is 1 to 128 letters, digits, `.`, `_`, `:` or `-`
    starting with a letter or digit (as the replays table requires)."""
    if not _NAME.fullmatch(name):
        raise errors.InvalidArgument(
            f"a replay name is 1 to 128 letters, digits, '.', '_', ':' or '-', starting with a "
            f"letter or digit; not {name!r}"
        )
    return name


def default_name(given: Mapping[str, object]) -> str:
    """A replay's name from its options as they were given (relative times unresolved): running
    the same command again continues the same replay."""
    text = json.dumps({k: given[k] for k in sorted(given)}, default=str)
    return "lake-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def selected(
    spark: SparkSession, lake: str, selection: Selection, after: int = 0
) -> DataFrame | None:
    """The lake's archived messages `selection` takes, with ids past `after`; None if the lake
    has none. Only id ranges an export finished are read (a range being written may be
    incomplete), and with a `since`, only the folders of the days between the bounds are listed
    and read."""
    done = sorted(
        r.name
        for r, states in Manifest(spark, lake).states().items()
        if r.table == "archive" and "done" in states
    )
    if not done:
        return None
    days = None
    if selection.since is not None:
        until = selection.until or datetime.now(UTC)
        # Published before `until`: its day is the last only if `until` is past midnight.
        days = (_day(selection.since), _day(until - timedelta(microseconds=1)))
    data = read(spark, table_path(lake, "archive"), schema=SCHEMA, days=days)
    if data is None:
        return None
    conditions = [F.col("id_range").isin(done), F.col("id") > F.lit(after)]
    if selection.since is not None:
        conditions.append(F.col("published_at") >= F.lit(selection.since))
    if selection.until is not None:
        last = _day(selection.until - timedelta(microseconds=1))
        conditions.append(F.col("day") <= F.lit(last))  # a partition filter: later days unread
        conditions.append(F.col("published_at") < F.lit(selection.until))
    if selection.exchange is not None:
        conditions.append(F.col("exchange") == F.lit(selection.exchange))
    if selection.routing_key is not None:
        conditions.append(F.col("routing_key").like(glob_to_like(selection.routing_key)))
    if selection.key is not None:
        conditions.append(F.col("ordering_key").like(glob_to_like(selection.key)))
    if not selection.include_replays:
        conditions.append(F.get_json_object("headers", "$['x-replay']").isNull())
    for condition in conditions:
        data = data.where(condition)
    return data


@dataclasses.dataclass(frozen=True)
class Route:
    """What a dry run prints: messages of one exchange and routing key, and their time span."""

    exchange: str
    routing_key: str
    messages: int
    first: datetime
    last: datetime


def routes(data: DataFrame) -> list[Route]:
    """The selection counted per route (most messages first), times in UTC."""
    grouped = data.groupBy("exchange", "routing_key").agg(
        F.count(F.lit(1)).alias("messages"),
        F.min("published_at").alias("first"),
        F.max("published_at").alias("last"),
    )
    rows = grouped.orderBy(F.desc("messages"), "exchange", "routing_key").collect()
    return [Route(r.exchange, r.routing_key, r.messages, _utc(r.first), _utc(r.last)) for r in rows]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one run of a replay found to do, and did (a dry run: found only)."""

    selected: int  # past the replay's position when the run began
    enqueued: int = 0
    skipped: int = 0
    #: The first KEEP_SKIPPED rows skipped: lake id, original message_id, reason.
    first_skipped: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)


def replay(
    data: DataFrame,
    db: ReplayDatabase,
    name: str,
    selection: Selection,
    *,
    after: int,
    rate: float,
    batch: int,
    progress: Progress = lambda _: None,
    sleep: Callable[[float], object] = time.sleep,
) -> Outcome:
    """Enqueue the rows of `data` past `after` in id order, `batch` at a time (fewer when their
    bodies pass BATCH_BYTES) and `rate` messages a second at most. Each batch is a transaction
    that moves the replay's position, so an interrupted replay continues after its last batch. A
    row the outbox refuses is skipped, and recorded with the reason, not retried for ever.

    `rate` is a ceiling on what reaches the outbox, which relays that keep up pass on to the
    consumers: no second holds more than `rate` messages and one batch, however late the first
    rows came from Spark, and the run keeps to `rate` on average (relay.pipeline.pace)."""
    if rate <= 0 or batch <= 0:
        raise errors.InvalidArgument("the rate and the batch size must be positive")
    pacer = pace.Pacer(rate, sleep=sleep)
    columns = [f.name for f in SCHEMA.fields if f.name not in ("day", "id_range")]
    rows = data.select(*columns).orderBy("id").toLocalIterator(prefetchPartitions=True)
    sender = _Sender(db, name, selection, after)
    total = 0
    for chunk in _chunks(rows, batch):
        began = pacer.wait()
        moved = sender.enqueued + sender.skipped
        sender.send(chunk)
        pacer.sent(sender.enqueued + sender.skipped - moved, began, pacer.clock())
        total += len(chunk)
        progress(len(chunk))
    return Outcome(total, sender.enqueued, sender.skipped, sender.first_skipped)


def message_id(name: str, lake_id: int, original: str) -> uuid.UUID:
    """The id replay `name` gives the message that had `original` and is `lake_id` in the lake."""
    return uuid.uuid5(NAMESPACE, f"{name}/{lake_id}/{original}")


@dataclasses.dataclass
class _Sender:
    """Sends a replay's rows in order, moving its position: whole batches while the outbox takes
    them; past a message it refuses (enqueue_many names it), that message is skipped and the
    rest of the batch sent again."""

    db: ReplayDatabase
    name: str
    selection: Selection
    after: int
    enqueued: int = 0
    skipped: int = 0
    first_skipped: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)

    def send(self, rows: list[Row]) -> None:
        good: list[tuple[Row, _Message]] = []
        for row in rows:
            if row.id <= self.after:
                continue  # at or behind the position: done before (never expected)
            try:
                good.append((row, _message(self.name, row)))
            except errors.InvalidMessage as exc:
                self._batch(good)
                good = []
                self._skip(row, str(exc))
        self._batch(good)

    def _batch(self, rows: list[tuple[Row, _Message]]) -> None:
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

    def _one_by_one(self, rows: list[tuple[Row, _Message]]) -> None:
        for one in rows:
            try:
                self._enqueue([one])
            except errors.InvalidMessage as exc:
                self._skip(one[0], str(exc))

    def _enqueue(self, rows: list[tuple[Row, _Message]]) -> None:
        ids = [row.id for row, _ in rows]
        messages = [m for _, m in rows]
        exchange, routing_key = self.selection.to_exchange, self.selection.to_routing_key
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
class _Message:
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


def _message(name: str, row: Row) -> _Message:
    """What lake row `row` becomes; InvalidMessage if it cannot become one (the outbox never
    stores such a row, but a lake is files anyone can write)."""
    if row.body is None or row.published_at is None or row.exchange is None:
        raise errors.InvalidMessage("its body, exchange or publish time is missing in the lake")
    return _Message(
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


def _chunks(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    held = 0
    for row in rows:
        chunk.append(row)
        held += len(row.body or b"")
        if len(chunk) == size or held >= BATCH_BYTES:
            yield chunk
            chunk, held = [], 0
    if chunk:
        yield chunk


def _utc(moment: datetime) -> datetime:
    """A time Spark gave (naive, in this process's local time zone) as UTC."""
    return moment.astimezone(UTC)


def _day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()
