"""Replays from the lake: archived messages selected on Spark, put back in the outbox through
enqueue_many at the operator's rate, in the lake's id order, resumably and idempotently."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F  # Spark's own convention
from pyspark.sql import types as T

from relay.core import errors
from relay.core.filters import glob_to_like
from relay.pipeline import pace, sending
from relay.pipeline.database import ReplayDatabase
from relay.pipeline.lake import Manifest, read, table_path

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
    #: The first sending.KEEP_SKIPPED rows skipped: lake id, original message_id, reason.
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
    sender = sending.Sender(db, name, selection.to_exchange, selection.to_routing_key, after)
    total = 0
    for chunk in _chunks(rows, batch):
        began = pacer.wait()
        moved = sender.enqueued + sender.skipped
        sender.send(chunk)
        pacer.sent(sender.enqueued + sender.skipped - moved, began, pacer.clock())
        total += len(chunk)
        progress(len(chunk))
    return Outcome(total, sender.enqueued, sender.skipped, sender.first_skipped)


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
