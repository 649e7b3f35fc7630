"""What the console's forms and links carry, read and checked at the boundary: a bad field is
an InvalidArgument with one line for the page (400), never a traceback."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from relay.core import errors, model
from relay.core.filters import DeadFilter, DeadSearch

#: The filter's fields, as the form names them.
FIELDS = ("reason", "exchange", "routing_key", "key", "since", "until", "id", "text")
#: A field's longest value (a routing key is at most 255 bytes in AMQP).
MAX_LENGTH = 300
REASONS = tuple(r.value for r in model.DeadReason)


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """A dead-letter page's request: the filter as typed (to fill the form again) and as
    checked, where the page starts, and its size."""

    raw: dict[str, list[str]]
    search: DeadSearch
    before: tuple[datetime, int] | None
    limit: int

    def link(self, **changes: str | None) -> str:
        """This page's query string with some fields changed (None: removed)."""
        pairs = [(k, v) for k, vs in self.raw.items() if k not in changes for v in vs]
        pairs += [(k, v) for k, v in changes.items() if v is not None]
        return urlencode(pairs)

    def next_link(self, after: tuple[datetime, int]) -> str:
        return self.link(before=encode_position(after))


def _values(params: Any, name: str) -> list[str]:
    got = params.getlist(name) if hasattr(params, "getlist") else [params.get(name, "")]
    values = [str(v).strip() for v in got if str(v).strip()]
    for value in values:
        check_text(name, value)
    return values


def check_text(name: str, value: str) -> str:
    """A field's text: not too long, and no control characters (PostgreSQL refuses NUL)."""
    if len(value) > MAX_LENGTH:
        raise errors.InvalidArgument(f"{name} is longer than {MAX_LENGTH} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise errors.InvalidArgument(f"{name} has a control character")
    return value


def position_id(value: Any) -> int:
    """The dead id a confirm page counted up to (its hidden `upto`)."""
    try:
        upto = int(str(value))
    except ValueError:
        raise errors.InvalidArgument("this form is incomplete: confirm it again") from None
    if not 0 <= upto < 2**63:
        raise errors.InvalidArgument("this form is incomplete: confirm it again")
    return upto


def _one(params: Any, name: str) -> str | None:
    values = _values(params, name)
    if len(values) > 1:
        raise errors.InvalidArgument(f"give {name} once")
    return values[0] if values else None


def search(params: Any) -> DeadSearch:
    """The filter of a form or query string (a Starlette QueryParams or FormData)."""
    reasons = _values(params, "reason")
    unknown = sorted(set(reasons) - set(REASONS))
    if unknown:
        raise errors.InvalidArgument(f"unknown reason {unknown[0]!r}; one of: {', '.join(REASONS)}")
    where = DeadFilter.build(
        reasons=reasons,
        exchange=_one(params, "exchange"),
        routing_key=_one(params, "routing_key"),
        key=_one(params, "key"),
        since=_one(params, "since"),
        until=_one(params, "until"),
        message_ids=_values(params, "ids"),
    )
    return DeadSearch(where, _one(params, "id"), _one(params, "text"))


def query(params: Any) -> Query:
    raw = {name: _values(params, name) for name in (*FIELDS, "limit")}
    raw = {k: v for k, v in raw.items() if v}
    before = _one(params, "before")
    limit_text = _one(params, "limit") or "50"
    try:
        limit = int(limit_text)
    except ValueError:
        raise errors.InvalidArgument(f"limit must be a whole number, not {limit_text!r}") from None
    return Query(raw, search(params), decode_position(before) if before else None, limit)


def encode_position(position: tuple[datetime, int]) -> str:
    at, row = position
    return base64.urlsafe_b64encode(json.dumps([at.isoformat(), row]).encode()).decode()


def decode_position(text: str) -> tuple[datetime, int]:
    try:
        at, row = json.loads(base64.urlsafe_b64decode(text.encode()))
        return datetime.fromisoformat(at), int(row)
    except (ValueError, TypeError, binascii.Error):
        raise errors.InvalidArgument("not a page position (follow the page's own links)") from None


def hidden_fields(where: DeadFilter) -> list[tuple[str, str]]:
    """A filter as the hidden fields of a confirm form (times fixed, as the count was made)."""
    pairs: list[tuple[str, str]] = [("reason", r) for r in where.reasons or ()]
    for name in ("exchange", "routing_key", "key"):
        value = getattr(where, name)
        if value is not None:
            pairs.append((name, value))
    for name in ("since", "until"):
        value = getattr(where, name)
        if value is not None:
            pairs.append((name, value.isoformat()))
    pairs += [("ids", str(i)) for i in where.message_ids or ()]
    return pairs


def body_view(body: bytes, properties: Mapping[str, Any]) -> tuple[str, str]:
    """How a body is shown: ("json", pretty text), ("text", text) or ("binary", a hex dump of
    its first 4 KiB)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "binary", _hexdump(body[:4096])
    try:
        return "json", json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to pretty-print
        return "text", text


def _hexdump(data: bytes) -> str:
    lines = []
    for offset in range(0, len(data), 16):
        chunk = data[offset : offset + 16]
        shown = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{offset:08x}  {chunk.hex(' '):<47}  {shown}")
    return "\n".join(lines)


def describe(where: DeadFilter) -> Iterable[tuple[str, str]]:
    """A filter in words, field by field, for a confirm page and the audit list."""
    if where.reasons:
        yield "reason", ", ".join(where.reasons)
    for name in ("exchange", "routing_key", "key"):
        value = getattr(where, name)
        if value is not None:
            yield name.replace("_", " "), value
    if where.since is not None:
        yield "since", where.since.isoformat(timespec="seconds")
    if where.until is not None:
        yield "until", where.until.isoformat(timespec="seconds")
    if where.message_ids:
        yield "messages", f"{len(where.message_ids)} selected"
