"""The hand-built publish frames are byte for byte what pamqp marshals."""

from __future__ import annotations

import pytest
from pamqp import body, commands, frame, header

from relay.amqp import frames as wire


@pytest.mark.parametrize(
    ("exchange", "routing_key", "mandatory"),
    [
        ("", "q", True),
        ("orders", "order.created", False),
        ("a.b:c", "k" * 255, True),
        ("x", "ünï", False),
    ],
)
@pytest.mark.parametrize("channel", [1, 7, 65535])
def test_method_frame_is_pamqps(
    exchange: str, routing_key: str, mandatory: bool, channel: int
) -> None:
    expected = frame.marshal(
        commands.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory),
        channel,
    )
    assert wire.method(channel, exchange, routing_key, mandatory=mandatory) == expected


def test_names_over_255_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="255 bytes"):
        wire.method(1, "", "é" * 128, mandatory=True)


@pytest.mark.parametrize("size", [0, 1, 4088, 4089, 4096, 10_000])
def test_body_frames_are_pamqps_split_at_frame_max(size: int) -> None:
    content = bytes(i % 251 for i in range(size))
    frame_max = 4096
    step = frame_max - wire.OVERHEAD
    expected = b"".join(
        frame.marshal(body.ContentBody(content[at : at + step]), 3) for at in range(0, size, step)
    )
    assert wire.body(3, content, frame_max) == expected
    assert all(len(f) <= frame_max for f in _frames(expected))


def test_header_moves_to_its_channel() -> None:
    properties = commands.Basic.Properties(message_id="m", headers={"a": 1}, delivery_mode=2)
    content_header = header.ContentHeader(0, 42, properties)
    assert wire.on_channel(frame.marshal(content_header, 0), 513) == frame.marshal(
        content_header, 513
    )


def _frames(data: bytes) -> list[bytes]:
    out = []
    while data:
        size = int.from_bytes(data[3:7], "big") + wire.OVERHEAD
        out.append(data[:size])
        data = data[size:]
    return out
