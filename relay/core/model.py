"""The relay's vocabulary: messages, broker outcomes, settlements and reports (stdlib only)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeVar
from uuid import UUID

_K = TypeVar("_K")

#: Headers the relay adds to every published message; producers may not set names with this prefix.
RESERVED_HEADER_PREFIX = "x-outbox-"
ATTEMPT_HEADER = "x-outbox-attempt"
ORDERING_KEY_HEADER = "x-outbox-ordering-key"
SEQUENCE_HEADER = "x-outbox-sequence"  # 1, 2, 3… within an ordering key, in commit order
REPLAYS_HEADER = "x-outbox-replays"  # provenance of a message an operator replayed from dead
REPLAYED_AT_HEADER = "x-outbox-replayed-at"
REPLAYED_FROM_HEADER = "x-outbox-replayed-from"

#: The AMQP basic properties a producer may set through `properties` (the rest are the relay's).
SETTABLE_PROPERTIES = frozenset(
    {
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "type",
        "user_id",
        "app_id",
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One claimed row of the outbox, as the relay publishes it."""

    id: int
    message_id: UUID
    exchange: str
    routing_key: str
    body: bytes
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    ordering_key: str | None
    created_at: datetime
    attempts: int
    ambiguous: int = 0
    last_error: str | None = None
    #: Why the stored row cannot be read back as a message (then it is dead-lettered unpublished).
    invalid: str | None = None
    #: Its number within its ordering key (None without a key).
    seq: int | None = None
    #: How often an operator replayed it from dead, when last, and from which dead reason.
    replays: int = 0
    replayed_at: datetime | None = None
    replayed_from: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Ask:
    """What a claim asks for: up to `limit` rows, leased for `lease` seconds; a row whose lease
    ran out after `max_attempts` claims is moved to dead unread instead."""

    limit: int
    lease: float
    max_attempts: int


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """A batch of rows leased together; `claim_id` is the fencing token every settle presents."""

    claim_id: UUID
    messages: tuple[OutboxMessage, ...]
    #: The claim stopped at its row or byte budget with more due rows behind it: claim again.
    cut_short: bool = False
    #: Rows whose lease ran out once too often, moved to dead unread: (message_id, attempts).
    buried: tuple[tuple[UUID, int], ...] = ()
    #: One row whose lease ran out more than once, claimed alone: it may be what kills relays,
    #: so nothing is claimed ahead while it is published.
    alone: bool = False


class Outcome(enum.Enum):
    """What the broker (or the attempt to reach it) said about one published message."""

    ACKED = "acked"  # confirmed: the broker took responsibility
    RETURNED = "returned"  # mandatory and unroutable: no queue is bound for it
    NACKED = "nacked"  # the broker refused it (e.g. a queue that rejects publishes)
    NO_EXCHANGE = "no_exchange"  # the exchange does not exist
    INVALID = "invalid"  # the row cannot be encoded as an AMQP message
    REJECTED = "rejected"  # the broker closed the channel over this message (reason says why)
    AMBIGUOUS = "ambiguous"  # sent or maybe sent, but no confirm arrived: it may have arrived
    FAILED = "failed"  # publishing raised an error nobody expected: a bug, or a poison row
    UNSENT = "unsent"  # never written: the relay could no longer be sure it held the lease


@dataclasses.dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome of publishing one message, with a human-readable detail. `reason` names a
    REJECTED message's fault; `resent` says it was written twice in this claim (after a channel
    error cut its first send short), which the settle records as an ambiguous re-send."""

    outcome: Outcome
    detail: str = ""
    reason: DeadReason | None = None
    resent: bool = False
    #: For an ACKED message: seconds from its publish to the confirm, and the confirm's wall time.
    seconds: float | None = None
    confirmed_at: float | None = None


class DeadReason(enum.StrEnum):
    """The machine word stored in `dead.reason`."""

    UNROUTABLE = "unroutable"  # returned: no queue is bound for its routing key
    NO_EXCHANGE = "no_exchange"  # its exchange does not exist
    ACCESS_REFUSED = "access_refused"  # the relay's user may not publish to its exchange
    TOO_LARGE = "too_large"  # larger than the broker's max_message_size
    REJECTED = "rejected"  # the broker closed the channel over it for another reason
    INVALID = "invalid"  # the row cannot be read or encoded as an AMQP message
    MAX_ATTEMPTS = "max_attempts"  # attempts exhausted (nacks, errors, or relays dying on it)


@dataclasses.dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    reason: DeadReason
    detail: str


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """Put a row back for a later attempt. `refund` gives back the attempt its claim counted;
    `ambiguous` counts the claim as a send whose outcome is unknown (it may have arrived)."""

    id: int
    delay: float
    error: str
    refund: bool = False
    ambiguous: bool = False
    why: str = "failed"  # nacked, ambiguous, failed or released: for the metrics


@dataclasses.dataclass(frozen=True, slots=True)
class Settlement:
    """Every row transition one claim ends with, applied by the store in one transaction."""

    archive: tuple[int, ...] = ()
    dead: tuple[DeadLetter, ...] = ()
    retry: tuple[Retry, ...] = ()
    #: Rows written twice in this claim; each gets one more ambiguous send on record.
    resent: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.archive) + len(self.dead) + len(self.retry)


@dataclasses.dataclass(frozen=True, slots=True)
class SettleCounts:
    """How many rows each transition moved; the rest were fenced off (re-claimed elsewhere)."""

    archived: int = 0
    dead: int = 0
    retried: int = 0
    fenced: int = 0
    #: Keyed rows that became free to go because the row before them settled.
    released: int = 0
    #: Keys blocked because one of their messages was dead-lettered (strict policy).
    blocked: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class CycleReport:
    """What one claim → publish → settle cycle did."""

    claimed: int = 0
    outcomes: Mapping[Outcome, int] = dataclasses.field(default_factory=dict)
    dead: Mapping[DeadReason, int] = dataclasses.field(default_factory=dict)
    settled: SettleCounts = dataclasses.field(default_factory=SettleCounts)
    #: Rows whose relays kept dying on them, moved to dead without being read.
    buried: int = 0
    #: The broker refused publishing (a memory or disk alarm), so nothing was claimed.
    blocked: bool = False
    #: Rows put back for another try, by why: nacked, ambiguous, failed, released.
    retried: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Sends whose outcome was unknown (and were or will be sent again).
    ambiguous: int = 0
    #: A claim stopped at its byte budget with due rows left behind it.
    cut_short: bool = False
    # Measurements for the histograms (one entry per claim, or per acked message).
    batch_sizes: tuple[int, ...] = ()
    claim_seconds: tuple[float, ...] = ()
    publish_seconds: tuple[float, ...] = ()
    commit_seconds: tuple[float, ...] = ()

    def counts(self) -> CycleReport:
        """This report without its measurements: what a sum over many cycles keeps, so that it
        does not grow with every message (each cycle's measurements go to the histograms as the
        cycle ends). Summing them all made a drain of 1,000,000 spend an eighth of the relay's CPU
        copying tuples."""
        return dataclasses.replace(
            self, batch_sizes=(), claim_seconds=(), publish_seconds=(), commit_seconds=()
        )

    def combine(self, other: CycleReport) -> CycleReport:
        """The sum of two reports (for runs of several cycles)."""
        return CycleReport(
            claimed=self.claimed + other.claimed,
            outcomes=_add(self.outcomes, other.outcomes),
            dead=_add(self.dead, other.dead),
            settled=SettleCounts(
                *(a + b for a, b in zip(_fields(self.settled), _fields(other.settled), strict=True))
            ),
            buried=self.buried + other.buried,
            blocked=self.blocked or other.blocked,
            retried=_add(self.retried, other.retried),
            ambiguous=self.ambiguous + other.ambiguous,
            cut_short=self.cut_short or other.cut_short,
            batch_sizes=self.batch_sizes + other.batch_sizes,
            claim_seconds=self.claim_seconds + other.claim_seconds,
            publish_seconds=self.publish_seconds + other.publish_seconds,
            commit_seconds=self.commit_seconds + other.commit_seconds,
        )


def _add(a: Mapping[_K, int], b: Mapping[_K, int]) -> dict[_K, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in a.keys() | b.keys()}


def _fields(counts: SettleCounts) -> tuple[int, ...]:
    return tuple(getattr(counts, f.name) for f in dataclasses.fields(counts))


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of the outbox, as `outbox-relay stats` prints it."""

    pending: int
    due: int
    scheduled: int
    in_flight: int
    oldest_pending_age_seconds: float | None
    archived: int
    dead: int
    dead_by_reason: Mapping[str, int]
    blocked_keys: int = 0
    #: Behind an earlier message of their key (in `pending`, neither due nor scheduled).
    gated: int = 0
    #: The gauges' view (the longest wait, the database's health), when available.
    observation: Observation | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """One look at the outbox and the database, for the gauges, `stats` and `top`."""

    due: int
    scheduled: int
    gated: int
    in_flight: int
    oldest_due_seconds: float | None
    dead: int
    blocked_keys: int
    dead_tuples: int
    last_autovacuum: float | None  # unix time
    autovacuum_on: bool  # for the server and the messages table
    xmin_seconds: float | None  # age of the oldest transaction holding the vacuum horizon
    xmin_xids: int | None
    xmin_pid: int | None
    xmin_state: str | None
