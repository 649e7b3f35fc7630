"""The Python producer API: enqueue a message inside the caller's own psycopg transaction."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import psycopg.errors
from psycopg.types.json import Jsonb

from relay.core import errors, tracing
from relay.postgres import joins, sql

#: What a body may be: bytes are sent as they are, a dict or list as JSON, a str as UTF-8 text.
Body = bytes | bytearray | memoryview | str | Mapping[str, Any] | list[Any]

_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"


def enqueue(
    conn: psycopg.Connection[Any] | Any,
    exchange: str,
    routing_key: str,
    body: Body,
    *,
    headers: Mapping[str, Any] | None = None,
    properties: Mapping[str, Any] | None = None,
    available_at: datetime | timedelta | None = None,
    ordering_key: str | None = None,
    message_id: UUID | None = None,
    schema: str = "outbox",
) -> UUID:
    """Queue one message in `conn`'s current transaction and return its message_id.

    `conn` is a psycopg Connection, a SQLAlchemy Session or Connection on the psycopg 3 driver
    (`postgresql+psycopg://`), or Django's connection (psycopg 3) inside `transaction.atomic()`
    (InvalidArgument outside it), whose transaction the message joins, on the same connection.
    The message exists if and only if that transaction commits; this function never commits.
    `available_at` is a tz-aware time or a delay from now (by the database's clock).
    With OpenTelemetry installed and a span active, its trace context (W3C `traceparent`,
    `tracestate`) is stored in the headers, so the consumer's span continues this trace.
    Raises InvalidMessage (or DuplicateMessage) for bad arguments, after which the transaction is
    aborted as after any SQL error; SchemaMissing if `outbox-relay migrate` has not run.
    """
    query, params = _call(
        schema,
        exchange,
        routing_key,
        body,
        headers,
        properties,
        available_at,
        ordering_key,
        message_id,
    )
    with _translate(schema):
        row = joins.sync_connection(conn).execute(query, params).fetchone()
    assert row is not None  # a SELECT of one function call returns one row
    return UUID(str(row[0]))


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any] | Any,
    exchange: str,
    routing_key: str,
    body: Body,
    *,
    headers: Mapping[str, Any] | None = None,
    properties: Mapping[str, Any] | None = None,
    available_at: datetime | timedelta | None = None,
    ordering_key: str | None = None,
    message_id: UUID | None = None,
    schema: str = "outbox",
) -> UUID:
    """`enqueue` for an AsyncConnection: same arguments, same guarantees, same errors."""
    query, params = _call(
        schema,
        exchange,
        routing_key,
        body,
        headers,
        properties,
        available_at,
        ordering_key,
        message_id,
    )
    driver = await joins.async_connection(conn)
    with _translate(schema):
        cur = await driver.execute(query, params)
        row = await cur.fetchone()
    assert row is not None
    return UUID(str(row[0]))


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """One message for `enqueue_many`: the arguments `enqueue` takes, with the same meaning."""

    exchange: str
    routing_key: str
    body: Body
    headers: Mapping[str, Any] | None = None
    properties: Mapping[str, Any] | None = None
    available_at: datetime | timedelta | None = None
    ordering_key: str | None = None
    message_id: UUID | None = None


def enqueue_many(
    conn: psycopg.Connection[Any] | Any, messages: Iterable[Message], *, schema: str = "outbox"
) -> list[UUID]:
    """Queue many messages in `conn`'s current transaction with one round trip and return their
    message_ids, in order. Each is checked as `enqueue` checks it; the first bad one raises
    InvalidMessage naming its position, and nothing is written (the transaction is aborted if the
    database refused it). Relays are woken once, at commit. Never commits."""
    query, params = _many(schema, messages)
    if not params["bodies"]:
        return []
    with _translate(schema):
        rows = joins.sync_connection(conn).execute(query, params).fetchall()
    return [UUID(str(row[0])) for row in rows]


async def enqueue_many_async(
    conn: psycopg.AsyncConnection[Any] | Any,
    messages: Iterable[Message],
    *,
    schema: str = "outbox",
) -> list[UUID]:
    """`enqueue_many` for an AsyncConnection: same arguments, same guarantees, same errors."""
    query, params = _many(schema, messages)
    if not params["bodies"]:
        return []
    driver = await joins.async_connection(conn)
    with _translate(schema):
        cur = await driver.execute(query, params)
        rows = await cur.fetchall()
    return [UUID(str(row[0])) for row in rows]


def _many(schema: str, messages: Iterable[Message]) -> tuple[Any, dict[str, list[Any]]]:
    """enqueue_many's statement, and its parameters as one array per column."""
    batch = list(messages)
    columns: dict[str, list[Any]] = {
        "exchanges": [],
        "routing_keys": [],
        "bodies": [],
        "headers": [],
        "properties": [],
        "available_at": [],
        "delays": [],
        "ordering_keys": [],
        "message_ids": [],
    }
    for n, message in enumerate(batch, 1):
        if not isinstance(message, Message):
            raise errors.InvalidMessageType(
                f"message {n} must be a relay.Message, not {type(message).__name__}"
            )
        try:
            _, one = _call(
                schema,
                message.exchange,
                message.routing_key,
                message.body,
                message.headers,
                message.properties,
                message.available_at,
                message.ordering_key,
                message.message_id,
            )
        except errors.InvalidMessage as exc:
            raise errors.InvalidMessage(f"message {n} of {len(batch)}: {exc}") from None
        for column, key in (
            ("exchanges", "exchange"),
            ("routing_keys", "routing_key"),
            ("bodies", "body"),
            ("headers", "headers"),
            ("properties", "properties"),
            ("available_at", "available_at"),
            ("delays", "delay"),
            ("ordering_keys", "ordering_key"),
            ("message_ids", "message_id"),
        ):
            columns[column].append(one[key])
    return sql.load(schema).enqueue_many, columns


def _call(
    schema: str,
    exchange: str,
    routing_key: str,
    body: Body,
    headers: Mapping[str, Any] | None,
    properties: Mapping[str, Any] | None,
    available_at: datetime | timedelta | None,
    ordering_key: str | None,
    message_id: UUID | None,
) -> tuple[Any, dict[str, Any]]:
    """The statement and parameters shared by the sync and async entry points."""
    payload, content_type = encode_body(body)
    props = dict(_mapping("properties", properties))
    if content_type is not None:
        props.setdefault("content_type", content_type)
    for name, value in (
        ("exchange", exchange),
        ("routing_key", routing_key),
        ("ordering_key", ordering_key),
    ):
        if value is not None and not isinstance(value, str):
            raise errors.InvalidMessageType(f"{name} must be a str, not {type(value).__name__}")
        if value is not None:
            _storable_text(name, value)
    params = {
        "exchange": exchange,
        "routing_key": routing_key,
        "body": payload,
        "headers": _jsonb("headers", tracing.with_trace_context(_mapping("headers", headers))),
        "properties": _jsonb("properties", props),
        "available_at": None,
        "delay": None,
        "ordering_key": ordering_key,
        "message_id": message_id,
    }
    if isinstance(available_at, timedelta):
        params["delay"] = available_at
    elif isinstance(available_at, datetime):
        if available_at.tzinfo is None or available_at.utcoffset() is None:
            raise errors.InvalidMessage("available_at must be timezone-aware (e.g. tzinfo=UTC)")
        params["available_at"] = available_at
    elif available_at is not None:
        raise errors.InvalidMessageType(
            f"available_at must be a datetime or timedelta, not {type(available_at)}"
        )
    return sql.load(schema).enqueue, params


def encode_body(body: Body) -> tuple[bytes, str | None]:
    """The bytes to send and the content type they imply (None for raw bytes: the caller's call)."""
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body), None
    if isinstance(body, str):
        return _utf8("body", body), _TEXT
    if isinstance(body, Mapping | list):
        try:
            text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise errors.InvalidMessage(f"body is not JSON-serialisable: {exc}") from None
        return _utf8("body", text), _JSON
    raise errors.InvalidMessageType(
        f"body must be bytes, str, dict or list, not {type(body).__name__}"
    )


def _mapping(name: str, value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise errors.InvalidMessageType(f"{name} must be a mapping, not {type(value).__name__}")
    return value


def _jsonb(name: str, value: Mapping[str, Any]) -> Jsonb:
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise errors.InvalidMessage(f"{name} are not JSON-serialisable: {exc}") from None
    _utf8(name, text)
    if _has_nul(value):  # jsonb refuses \u0000
        raise errors.InvalidMessage(f"{name} contain a NUL character: PostgreSQL cannot store it")
    return Jsonb(dict(value))


def _has_nul(value: Any) -> bool:
    """Whether any key or string inside `value` holds a NUL (iteratively: nesting may be deep)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, Mapping):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            todo.extend(item)
    return False


def _storable_text(name: str, value: str) -> None:
    """Text PostgreSQL can store: valid UTF-8 (no lone surrogates) and no NUL."""
    if "\x00" in value:
        raise errors.InvalidMessage(f"{name} contains a NUL character: PostgreSQL cannot store it")
    _utf8(name, value)


def _utf8(name: str, text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.InvalidMessage(
            f"{name} is not valid Unicode text (a lone surrogate cannot be encoded as UTF-8)"
        ) from None


@contextlib.contextmanager
def _translate(schema: str) -> Iterator[None]:
    try:
        yield
    except psycopg.errors.InvalidParameterValue as exc:
        raise errors.InvalidMessage(exc.diag.message_primary or str(exc)) from exc
    except psycopg.errors.UniqueViolation as exc:
        raise errors.DuplicateMessage(exc.diag.message_primary or str(exc)) from exc
    except (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName) as exc:
        raise errors.SchemaMissing(
            f'no enqueue function in schema "{schema}"; run `outbox-relay migrate`'
        ) from exc
