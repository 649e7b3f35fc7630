"""Replays from the lake: archived messages selected on Spark, put back in the outbox through
enqueue_many at the operator's rate, in the lake's id order, resumably and idempotently."""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
from relay.pipeline.database import Batch, ReplayDatabase
from relay.pipeline.lake import Manifest, read, table_path

#: The message ids a replay gives are uuid5 of this namespace and "<replay name>/<original id>":
#: the same replay gives a message the same new id every time, and two replays different ones.
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

Progress = Callable[[int], object]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which archived messages a replay takes (every field left None matches everything) and
    where it sends them (None: where they went)."""

    since: datetime | None = None  # published at or after
    until: datetime | None = None  # published before
    exchange: str | None = None  # exactly
    routing_key: str | None = None  # a shell glob (* and ?)
    key: str | None = None  # a shell glob over the ordering key
    to_exchange: str | None = None
    to_routing_key: str | None = None

    def __post_init__(self) -> None:
        for bound in (self.since, self.until):
            if bound is not None and bound.tzinfo is None:
                raise errors.InvalidArgument("a replay's time bounds must be timezone-aware")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise errors.InvalidArgument("--since must be before --until")
        for name in ("to_exchange", "to_routing_key"):
            value = getattr(self, name)
            if value is not None and len(value.encode()) > 255:
                raise errors.InvalidArgument(f"--{name.replace('_', '-')}: over 255 bytes")

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
        parts.append(f"routing key {self.to_routing_key!r}" if self.to_routing_key else "")
        chosen = " and ".join(p for p in parts if p)
        return f" to {chosen}" if chosen else ""


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
    incomplete), and only the days the time bounds allow: Spark prunes the other partitions."""
    done = sorted(
        r.name
        for r, states in Manifest(spark, lake).states().items()
        if r.table == "archive" and "done" in states
    )
    if not done:
        return None
    data = read(spark, table_path(lake, "archive"), schema=SCHEMA)
    if data is None:
        return None
    conditions = [F.col("id_range").isin(done), F.col("id") > F.lit(after)]
    if selection.since is not None:
        conditions.append(F.col("day") >= F.lit(_day(selection.since)))
        conditions.append(F.col("published_at") >= F.lit(selection.since))
    if selection.until is not None:
        # Published before `until`: its day is the last only if `until` is past midnight.
        conditions.append(F.col("day") <= F.lit(_day(selection.until - timedelta(microseconds=1))))
        conditions.append(F.col("published_at") < F.lit(selection.until))
    if selection.exchange is not None:
        conditions.append(F.col("exchange") == F.lit(selection.exchange))
    if selection.routing_key is not None:
        conditions.append(F.col("routing_key").like(glob_to_like(selection.routing_key)))
    if selection.key is not None:
        conditions.append(F.col("ordering_key").like(glob_to_like(selection.key)))
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
    """The selection counted per route (most messages first)."""
    grouped = data.groupBy("exchange", "routing_key").agg(
        F.count(F.lit(1)).alias("messages"),
        F.min("published_at").alias("first"),
        F.max("published_at").alias("last"),
    )
    rows = grouped.orderBy(F.desc("messages"), "exchange", "routing_key").collect()
    return [Route(r.exchange, r.routing_key, r.messages, r.first, r.last) for r in rows]


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
) -> int:
    """Enqueue the rows of `data` past `after` in id order, `batch` at a time and `rate` messages
    a second at most; the number enqueued. Each batch is a transaction that moves the replay's
    position, so an interrupted replay continues after its last batch."""
    if rate <= 0 or batch <= 0:
        raise errors.InvalidArgument("the rate and the batch size must be positive")
    columns = [f.name for f in SCHEMA.fields if f.name not in ("day", "id_range")]
    rows = data.select(*columns).orderBy("id").toLocalIterator(prefetchPartitions=True)
    started = time.monotonic()
    enqueued = 0
    for chunk in _chunks(rows, batch):
        messages = _batch(name, selection, after, chunk)
        enqueued += db.enqueue(name, messages)
        after = messages.last
        progress(len(chunk))
        ahead = started + enqueued / rate - time.monotonic()
        if ahead > 0:
            sleep(ahead)
    return enqueued


def message_id(name: str, original: str) -> uuid.UUID:
    """The id replay `name` gives the message that had `original`."""
    return uuid.uuid5(NAMESPACE, f"{name}/{original}")


def _batch(name: str, selection: Selection, after: int, rows: list[Row]) -> Batch:
    exchanges, routing_keys, headers = [], [], []
    for row in rows:
        exchanges.append(selection.to_exchange or row.exchange)
        routing_keys.append(
            row.routing_key if selection.to_routing_key is None else selection.to_routing_key
        )
        provenance = {
            "x-replay": name,
            "x-replay-of": row.message_id,
            "x-replay-published-at": row.published_at.astimezone(UTC).isoformat(),
            "x-replay-exchange": row.exchange,
            "x-replay-routing-key": row.routing_key,
        }
        headers.append(Jsonb({**_object(row.headers, row, "headers"), **provenance}))
    return Batch(
        after=after,
        last=rows[-1].id,
        exchanges=exchanges,
        routing_keys=routing_keys,
        bodies=[bytes(row.body) for row in rows],
        headers=headers,
        properties=[Jsonb(_object(row.properties, row, "properties")) for row in rows],
        ordering_keys=[row.ordering_key for row in rows],
        message_ids=[message_id(name, row.message_id) for row in rows],
    )


def _object(text: str | None, row: Row, column: str) -> dict[str, Any]:
    loaded = json.loads(text) if text else {}
    if not isinstance(loaded, dict):
        raise errors.RelayError(
            f"lake row id {row.id} (message {row.message_id}): {column} is not a JSON object"
        )
    return loaded


def _chunks(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    chunk: list[Row] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _day(moment: datetime) -> date:
    return moment.astimezone(UTC).date()
