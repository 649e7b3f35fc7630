"""An outbox row as AMQP 0-9-1 content: its properties checked and encoded by hand, and its
content header frame — pure functions, no connection.

Encoded here rather than by pamqp so that what goes on the wire is decided in one place: a JSON
number with a fraction is a header value of type 'd' (a 64-bit double; pamqp writes 'f', 32 bits,
and 0.1 would arrive as 0.10000000149), a header name longer than AMQP's 128 bytes is refused
(pamqp truncates it), and everything else is byte for byte what pamqp writes (held by
tests/unit/test_encoding.py), so consumers read what they always read.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from relay.core import model

#: Basic.Properties in the order of their flag bits (15 down to 2), with their AMQP types.
_PROPERTIES = (
    ("content_type", "shortstr"),
    ("content_encoding", "shortstr"),
    ("headers", "table"),
    ("delivery_mode", "octet"),
    ("priority", "octet"),
    ("correlation_id", "shortstr"),
    ("reply_to", "shortstr"),
    ("expiration", "shortstr"),
    ("message_id", "shortstr"),
    ("timestamp", "timestamp"),
    ("type", "shortstr"),
    ("user_id", "shortstr"),
    ("app_id", "shortstr"),
)
#: The string properties a row may set (expiration is a number there; message_id is the relay's).
_STRING_PROPERTIES = tuple(
    name
    for name, kind in _PROPERTIES
    if kind == "shortstr" and name not in ("expiration", "message_id")
)
#: What AMQP 0-9-1 allows in an exchange name (and what aio-pika's exchange check can ask about).
_EXCHANGE_NAME = re.compile(r"[a-zA-Z0-9-_.:@#,/+ ]*")
_BASIC = 60  # the class id of Basic, which a content header names
_HEADER_FRAME = 2
_FRAME = struct.Struct(">BHI")
_FRAME_END = b"\xce"
#: Table integers: the smallest type RabbitMQ reads that holds the value, as pamqp picks it.
_INTEGERS = (
    (-(2**7), 2**7 - 1, b"b", struct.Struct(">b")),
    (-(2**15), 2**15 - 1, b"s", struct.Struct(">h")),
    (0, 2**16 - 1, b"u", struct.Struct(">H")),
    (-(2**31), 2**31 - 1, b"I", struct.Struct(">i")),
    (0, 2**32 - 1, b"i", struct.Struct(">I")),
    (-(2**63), 2**63 - 1, b"l", struct.Struct(">q")),
)
_U32 = struct.Struct(">I")
_DOUBLE = struct.Struct(">d")
_TIMESTAMP = struct.Struct(">Q")


class InvalidRow(ValueError):
    """The row cannot be encoded as the AMQP message it claims to be."""


class Encoded(NamedTuple):
    """A message's encoded property list (flags and values), and its content header frame
    marshalled for channel 0 (frames.on_channel moves it to the publishing channel)."""

    properties: bytes
    header: bytes


def encode(message: model.OutboxMessage, *, login: str, frame_max: int) -> Encoded:
    """The AMQP properties and content header of `message`, checked to encode exactly as stored.
    `login` is the relay's RabbitMQ user (RabbitMQ closes the channel on any other user_id);
    `frame_max` the connection's. Raises InvalidRow, naming what is wrong."""
    if message.invalid is not None:
        raise InvalidRow(message.invalid)
    stored = dict(message.properties)
    unknown = set(stored) - model.SETTABLE_PROPERTIES
    if unknown:
        raise InvalidRow(f"unknown AMQP properties: {', '.join(sorted(unknown))}")
    for key in _STRING_PROPERTIES:
        if key in stored and not isinstance(stored[key], str):
            raise InvalidRow(f"property {key} must be a string")
    if "user_id" in stored and stored["user_id"] != login:
        raise InvalidRow(
            "property user_id must equal the relay's RabbitMQ user "
            "(RabbitMQ closes the channel otherwise)"
        )
    if len(message.exchange) > 127 or not _EXCHANGE_NAME.fullmatch(message.exchange):
        raise InvalidRow(f"exchange name {message.exchange[:40]!r} is not valid in AMQP")
    if len(message.routing_key.encode("utf-8")) > 255:
        raise InvalidRow("the routing key is longer than AMQP's 255 bytes")
    delivery_mode = _whole(stored.get("delivery_mode", 2))
    if delivery_mode not in (1, 2):
        raise InvalidRow(f"cannot encode as AMQP: invalid delivery_mode value: {delivery_mode}")
    values: dict[str, Any] = {
        **stored,
        "headers": _headers(message),
        "delivery_mode": delivery_mode,
        "priority": _whole(stored.get("priority")),
        "expiration": None if "expiration" not in stored else str(_whole(stored["expiration"])),
        "message_id": str(message.message_id),
        "timestamp": message.created_at,
    }
    properties = encode_properties(values)
    payload = struct.pack(">HHQ", _BASIC, 0, len(message.body)) + properties
    header = b"".join((_FRAME.pack(_HEADER_FRAME, 0, len(payload)), payload, _FRAME_END))
    if len(header) > frame_max:
        raise InvalidRow(
            f"headers and properties take {len(header)} bytes; "
            f"the broker's frame_max is {frame_max}"
        )
    return Encoded(properties, header)


def encode_properties(values: Mapping[str, Any]) -> bytes:
    """The property flags and the values present (neither None nor ''), as AMQP orders them."""
    flags, parts = 0, []
    for bit, (name, kind) in zip(range(15, 1, -1), _PROPERTIES, strict=False):
        value = values.get(name)
        if value is None or value == "":
            continue
        flags |= 1 << bit
        try:
            parts.append(_ENCODERS[kind](value))
        except InvalidRow:
            raise
        except (TypeError, ValueError, OverflowError, RecursionError, struct.error) as exc:
            raise InvalidRow(f"cannot encode as AMQP: {name}: {exc}") from None
    return struct.pack(">H", flags) + b"".join(parts)


def table(value: Mapping[str, Any]) -> bytes:
    """An AMQP field table: names in sorted order, each value tagged with its type."""
    data = []
    for key, item in sorted(value.items()):
        if not isinstance(key, str):
            raise TypeError(f"a header name must be a string, not {key!r}")
        name = key.encode("utf-8")
        if len(name) > 128:
            raise InvalidRow(f"header name {key[:40]!r}… is longer than AMQP's 128 bytes")
        data.append(bytes((len(name),)) + name)
        data.append(table_value(item))
    output = b"".join(data)
    return _U32.pack(len(output)) + output


def table_value(value: Any) -> bytes:
    """One tagged table value. JSON's types, and the datetimes AMQP can carry."""
    if isinstance(value, bool):
        return b"t" + bytes((int(value),))
    if isinstance(value, int):
        for low, high, tag, packer in _INTEGERS:
            if low <= value <= high:
                return tag + packer.pack(value)
        raise OverflowError(f"{value} does not fit a 64-bit integer")
    if isinstance(value, float):
        return b"d" + _DOUBLE.pack(value)
    if isinstance(value, str):
        return b"S" + _long_string(value)
    if isinstance(value, datetime):
        return b"T" + _timestamp(value)
    if isinstance(value, Mapping):
        return b"F" + table(value)
    if isinstance(value, list):
        items = b"".join(table_value(item) for item in value)
        return b"A" + _U32.pack(len(items)) + items
    if value is None:
        return b"V"
    raise TypeError(f"a header value cannot be {type(value).__name__} ({value!r})")


def _headers(message: model.OutboxMessage) -> dict[str, Any]:
    """The stored headers plus the relay's own: attempt, ordering key and sequence, replays."""
    headers: dict[str, Any] = dict(message.headers)
    headers[model.ATTEMPT_HEADER] = message.attempts
    if message.ordering_key is not None:
        headers[model.ORDERING_KEY_HEADER] = message.ordering_key
    if message.seq is not None:
        headers[model.SEQUENCE_HEADER] = message.seq
    if message.replays:
        headers[model.REPLAYS_HEADER] = message.replays
        headers[model.REPLAYED_FROM_HEADER] = message.replayed_from or ""
        if message.replayed_at is not None:
            headers[model.REPLAYED_AT_HEADER] = message.replayed_at.isoformat()
    return headers


def _short_string(value: Any) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"a string is required, not {type(value).__name__}")
    data = value.encode("utf-8")
    if len(data) > 255:
        raise ValueError("longer than AMQP's 255 bytes")
    return bytes((len(data),)) + data


def _long_string(value: str) -> bytes:
    data = value.encode("utf-8")
    return _U32.pack(len(data)) + data


def _octet(value: Any) -> bytes:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise ValueError(f"{value!r} is not an octet (0–255)")
    return bytes((value,))


def _timestamp(value: Any) -> bytes:
    if not isinstance(value, datetime):
        raise TypeError(f"a datetime is required, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        value = value.replace(tzinfo=UTC)
    return _TIMESTAMP.pack(int(value.timestamp()))


def _table_property(value: Any) -> bytes:
    if not isinstance(value, Mapping):
        raise TypeError(f"headers must be an object, not {type(value).__name__}")
    return table(value)


_ENCODERS = {
    "shortstr": _short_string,
    "table": _table_property,
    "octet": _octet,
    "timestamp": _timestamp,
}


def _whole(value: Any) -> int | None:
    """An integer property from JSON (where 2 may arrive as 2.0 or "2")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidRow(f"expected a whole number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise InvalidRow(f"expected a whole number, got {value!r}") from None
    if not number.is_integer():
        raise InvalidRow(f"expected a whole number, got {value!r}")
    return int(number)
