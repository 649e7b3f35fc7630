"""relay.amqp.encoding from the bytes on the wire: what pamqp writes for everything but floats
(which go as doubles), decoded back exactly, and every refusal named. No broker."""

from __future__ import annotations

import dataclasses
import struct
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import pamqp.encode
import pytest
from pamqp import commands, frame, header

from relay.amqp import encoding, publisher, sending
from relay.core import model

CREATED = datetime(2026, 11, 26, 12, 30, 5, 999_000, tzinfo=UTC)
MESSAGE_ID = UUID("00000000-0000-4000-8000-000000000001")


def row(
    headers: dict[str, Any] | None = None, body: bytes = b"{}", **properties: Any
) -> model.OutboxMessage:
    return model.OutboxMessage(
        id=1,
        message_id=MESSAGE_ID,
        exchange="orders",
        routing_key="order.created",
        body=body,
        headers=headers or {},
        properties=properties,
        ordering_key=None,
        created_at=CREATED,
        attempts=2,
    )


def encode(message: model.OutboxMessage, frame_max: int = 131072) -> encoding.Encoded:
    return encoding.encode(message, login="relay", frame_max=frame_max)


def pamqps(message: model.OutboxMessage, **properties: Any) -> bytes:
    """What pamqp marshals for the same message (its float encoding aside)."""
    headers = {**message.headers, model.ATTEMPT_HEADER: message.attempts}
    built = commands.Basic.Properties(
        headers=headers, message_id=str(message.message_id), timestamp=CREATED, **properties
    )
    return frame.marshal(header.ContentHeader(0, len(message.body), built), 0)


HEADERS: list[dict[str, Any]] = [
    {},
    {"tenant": "acme", "ünïcode": "värde ✓", "flag": True, "off": False, "none": None},
    {f"i{n}": n for n in (0, -1, 127, -128, 128, -129, 32767, -32768, 32768, 65535, 65536)},
    {"wide": 2**31 - 1, "wider": 2**31, "u32": 2**32 - 1, "i64": 2**63 - 1, "min": -(2**63)},
    {"nested": {"b": [1, "two", {"c": None}], "a": {}}, "list": [], "deep": [[["x"]]]},
    {"z": 1, "a": 2, "m": 3},  # names go out sorted
]


@pytest.mark.parametrize("headers", HEADERS)
def test_headers_without_floats_are_byte_for_byte_pamqps(headers: dict[str, Any]) -> None:
    message = row(headers, body=b"x" * 10)
    expected = pamqps(message, delivery_mode=2)
    assert encode(message).header == expected


def test_every_property_is_byte_for_byte_pamqps() -> None:
    stored: dict[str, Any] = {
        "content_type": "application/json",
        "content_encoding": "gzip",
        "delivery_mode": 1,
        "priority": 9,
        "correlation_id": "c-1",
        "reply_to": "amq.rabbitmq.reply-to",
        "expiration": 60000,
        "type": "order.created",
        "user_id": "relay",
        "app_id": "shop",
    }
    message = row({"h": 1}, **stored)
    expected = pamqps(
        message,
        **{k: v for k, v in stored.items() if k not in ("type", "expiration")},
        message_type="order.created",
        expiration="60000",
    )
    assert encode(message).header == expected


def test_an_empty_string_property_is_left_out_as_pamqp_leaves_it_out() -> None:
    assert encode(row(content_type="")).header == pamqps(row(), delivery_mode=2)


def test_whole_numbers_may_arrive_from_json_as_floats_or_strings() -> None:
    as_ints = encode(row(delivery_mode=1, priority=5, expiration=1000))
    assert encode(row(delivery_mode=1.0, priority="5", expiration=1000.0)) == as_ints


@pytest.mark.parametrize("value", [0.1, 16777217.0, 1e300, -2.5e-308, 1.0])
def test_floats_travel_as_exact_doubles(value: float) -> None:
    message = row({"f": value, "in": [{"g": value}]})
    encoded = encode(message)
    assert b"d" + struct.pack(">d", value) in encoded.header
    _, _, decoded = frame.unmarshal(encoded.header)
    assert isinstance(decoded, header.ContentHeader)
    assert decoded.properties.headers is not None
    assert decoded.properties.headers["f"] == value  # exactly: a 32-bit float would not be
    assert decoded.properties.headers["in"] == [{"g": value}]
    assert decoded.body_size == len(message.body)


def test_importing_the_publisher_changes_nothing_in_pamqp() -> None:
    assert publisher  # imported: pamqp's own encoder still writes floats as 'f' for everyone else
    assert pamqp.encode.encode_table_value(0.5)[:1] == b"f"


def test_the_relays_headers_are_added_to_the_stored_ones() -> None:
    replayed = datetime(2026, 11, 1, tzinfo=UTC)
    message = dataclasses.replace(
        row({"h": "v"}),
        ordering_key="order-7",
        seq=12,
        replays=1,
        replayed_at=replayed,
        replayed_from="rejected",
    )
    _, _, decoded = frame.unmarshal(encode(message).header)
    assert isinstance(decoded, header.ContentHeader)
    assert decoded.properties.headers == {
        "h": "v",
        model.ATTEMPT_HEADER: 2,
        model.ORDERING_KEY_HEADER: "order-7",
        model.SEQUENCE_HEADER: 12,
        model.REPLAYS_HEADER: 1,
        model.REPLAYED_FROM_HEADER: "rejected",
        model.REPLAYED_AT_HEADER: replayed.isoformat(),
    }


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"n": value}
    return value


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (row({"k" * 129: 1}), "longer than AMQP's 128 bytes"),  # pamqp would truncate it
        (row({"n": [{"é" * 65: 1}]}), "longer than AMQP's 128 bytes"),
        (row({"big": 2**64}), "cannot encode as AMQP: headers"),
        (row(_nested(100_000)), "cannot encode as AMQP: headers"),
        (row(delivery_mode=3), "invalid delivery_mode value: 3"),
        (row(priority=256), "cannot encode as AMQP: priority"),
        (row(priority=2.5), "whole number"),
        (row(priority=True), "whole number"),
        (row(content_type=5), "property content_type must be a string"),
        (row(correlation_id="é" * 128), "cannot encode as AMQP: correlation_id"),
        (row(user_id="someone-else"), "must equal the relay's RabbitMQ user"),
        (row(colour="red"), "unknown AMQP properties: colour"),
        (row({"huge": "x" * 200_000}), "frame_max is 131072"),
    ],
)
def test_what_cannot_go_as_stored_is_refused_with_a_reason(
    message: model.OutboxMessage, says: str
) -> None:
    with pytest.raises(encoding.InvalidRow, match=says):
        encode(message)


@pytest.mark.parametrize(
    ("exchange", "routing_key", "says"),
    [
        ("no spaces! allowed", "k", "is not valid in AMQP"),
        ("x" * 128, "k", "is not valid in AMQP"),
        ("orders", "é" * 128, "longer than AMQP's 255 bytes"),
    ],
)
def test_names_amqp_cannot_carry_are_refused(exchange: str, routing_key: str, says: str) -> None:
    message = dataclasses.replace(row(), exchange=exchange, routing_key=routing_key)
    with pytest.raises(encoding.InvalidRow, match=says):
        encode(message)


def test_aiormqs_own_publish_path_sends_the_same_bytes() -> None:
    """The fallback (a message alone, an unfamiliar aiormq) marshals what encode wrote."""
    message = row({"f": 0.1, "s": "x"}, body=b"abc")
    encoded = encode(message)
    prebuilt = sending._Prebuilt(str(message.message_id), encoded.properties)
    assert frame.marshal(header.ContentHeader(0, 3, prebuilt), 0) == encoded.header
    assert prebuilt.message_id == str(MESSAGE_ID)
