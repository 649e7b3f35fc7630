"""What an operator's dead-letter filter means: globs, time bounds, and their SQL parameters."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from relay.core import errors, values


def glob_to_like(pattern: str) -> str:
    """A shell glob (`*` any characters, `?` one) as a LIKE pattern with backslash escapes, so
    that `%`, `_` and `\\` in the glob are taken literally."""
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def when(value: str | datetime | timedelta, now: datetime | None = None) -> datetime:
    """A time bound: an ISO 8601 time (UTC if it names no zone), or a duration meaning that long
    ago (`30m`, `2h`, `7d`). InvalidArgument otherwise."""
    now = now or datetime.now(UTC)
    if isinstance(value, timedelta):
        return now - value
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    try:
        return now - timedelta(seconds=values.parse_duration(value))
    except ValueError:
        pass
    except OverflowError:
        raise errors.InvalidArgument(f"{value!r} ago is before the year 1") from None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise errors.InvalidArgument(
            f"not a time: {value!r} (an ISO 8601 time such as 2026-11-21T08:00, or a duration "
            "ago such as 30m, 2h, 7d)"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class DeadFilter:
    """Which dead rows an operation applies to; every field left None matches everything."""

    reasons: tuple[str, ...] | None = None
    exchange: str | None = None
    routing_key: str | None = None  # a shell glob
    key: str | None = None  # a shell glob over the ordering key
    since: datetime | None = None  # failed at or after
    until: datetime | None = None  # failed before
    message_ids: tuple[UUID, ...] | None = None

    @classmethod
    def build(
        cls,
        *,
        reasons: Sequence[str] = (),
        exchange: str | None = None,
        routing_key: str | None = None,
        key: str | None = None,
        since: str | datetime | timedelta | None = None,
        until: str | datetime | timedelta | None = None,
        message_ids: Sequence[str | UUID] = (),
    ) -> DeadFilter:
        """A filter from loosely typed input (the CLI's), checked: InvalidArgument if bad.
        Relative times are fixed now, so running the same filter again selects the same rows."""
        ids = tuple(_uuid(m) for m in message_ids) or None
        low = when(since) if since is not None else None
        high = when(until) if until is not None else None
        if low is not None and high is not None and low >= high:
            raise errors.InvalidArgument("--since must be before --until")
        return cls(tuple(reasons) or None, exchange, routing_key, key, low, high, ids)

    @property
    def is_everything(self) -> bool:
        return self == DeadFilter()

    def params(self) -> dict[str, Any]:
        """The parameters of the dead_matches() SQL function, by name."""
        return {
            "reasons": list(self.reasons) if self.reasons else None,
            "exchange": self.exchange,
            "routing_key": None if self.routing_key is None else glob_to_like(self.routing_key),
            "key": None if self.key is None else glob_to_like(self.key),
            "since": self.since,
            "until": self.until,
            "ids": list(self.message_ids) if self.message_ids else None,
        }


_DASHES = (8, 12, 16, 20)  # where a UUID's text has its dashes, by hex digit


def id_prefix(value: str) -> str:
    """A message id, or its start, as PostgreSQL writes uuids (lowercase, dashed):
    `F54A159C6B` → `f54a159c-6b`. InvalidArgument unless it is 4 to 32 hex digits."""
    digits = value.strip().replace("-", "").lower()
    if not re.fullmatch(r"[0-9a-f]{4,32}", digits):
        raise errors.InvalidArgument(
            f"not a message id or the start of one (4 or more hex digits): {value!r}"
        )
    return "".join(("-" if i in _DASHES else "") + c for i, c in enumerate(digits))


_UUID = re.compile(r"[0-9a-fA-F]{8}-?([0-9a-fA-F]{4}-?){3}[0-9a-fA-F]{12}")


def _uuid(value: str | UUID) -> UUID:
    if isinstance(value, UUID):
        return value
    if not _UUID.fullmatch(value.strip()):
        raise errors.InvalidArgument(f"not a message id: {value!r}")
    return UUID(value.strip())


def id_range(start: str) -> tuple[UUID, UUID]:
    """The ids that begin with `start` (checked as `id_prefix` checks it), as the first and last
    uuid of that range: a range of an index on the ids, where a LIKE on their text is a scan."""
    digits = id_prefix(start).replace("-", "")
    return UUID(digits.ljust(32, "0")), UUID(digits.ljust(32, "f"))


#: The most characters a text search may have, and the most rows it reads.
SEARCH_MAX = 200
SEARCH_SCAN = 100_000


@dataclasses.dataclass(frozen=True, slots=True)
class DeadSearch:
    """A dead-letter filter as the web console offers it: a DeadFilter, the start of a message
    id, and a text searched for in headers (any case) and body (as written), over at most
    SEARCH_SCAN rows that match the rest."""

    where: DeadFilter = DeadFilter()
    id_start: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if self.id_start is not None:
            id_prefix(self.id_start)  # InvalidArgument if it cannot start an id
        if self.text is not None and not 1 <= len(self.text) <= SEARCH_MAX:
            raise errors.InvalidArgument(
                f"the text to search for must be 1 to {SEARCH_MAX} characters long"
            )

    @property
    def bulk_ok(self) -> bool:
        """Whether "all that match" is a set the server acts on as the CLI would (dead_matches):
        a text search is bounded in the rows it reads, so what it matches is not the whole set,
        and an id's start is the console's own finding aid. Those act on selected rows."""
        return self.text is None and self.id_start is None
