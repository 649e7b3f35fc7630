"""The publisher's hot path: a batch of publishes encoded once, handed to aiormq's writer at once.

aiormq's `basic_publish` costs a task, a lock, a timeout scope, a write-queue item and a drain wait
per message, and marshals its content header again after the publisher has already marshalled it
to check its size. Here the frames of a whole batch are built from bytes the publisher already has
(the method frame by hand, the header as marshalled, the body as is) and handed to the channel's
writer as one payload, with one confirmation future per delivery tag registered exactly as
`basic_publish` registers it — so acks, nacks, returns and channel closes reach these futures
through aiormq's own handlers. That registration is aiormq's internal state, so `usable()` checks
it is there; the publisher falls back to `basic_publish` on an aiormq that looks different.
"""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import Sequence
from typing import Any

import aiormq.abc

_FRAME = struct.Struct(">BHI")  # frame type, channel, payload size; then the payload and 0xCE
_FRAME_END = b"\xce"
_METHOD, _HEADER, _BODY = 1, 2, 3
_BASIC_PUBLISH = struct.pack(">HHH", 60, 40, 0)  # class basic, method publish, reserved ticket
#: Frame type, channel, size and frame-end: what a frame adds to its payload.
OVERHEAD = _FRAME.size + len(_FRAME_END)
_INTERNALS = ("lock", "confirmations", "message_id_delivery_tag", "write_queue", "number")


def usable(channel: Any) -> bool:
    """Whether `channel` keeps the state `publish` registers confirmations in (aiormq 6.x–7.x)."""
    return (
        all(hasattr(channel, name) for name in _INTERNALS)
        and isinstance(getattr(channel, "delivery_tag", None), int)
        and getattr(channel, "publisher_confirms", False) is True
    )


def frame(kind: int, channel: int, payload: bytes) -> bytes:
    return b"".join((_FRAME.pack(kind, channel, len(payload)), payload, _FRAME_END))


def method(channel: int, exchange: str, routing_key: str, *, mandatory: bool) -> bytes:
    """The Basic.Publish method frame. Raises ValueError for names AMQP cannot carry."""
    names = []
    for name in (exchange, routing_key):
        encoded = name.encode("utf-8")
        if len(encoded) > 255:
            raise ValueError(f"{name[:40]!r}… is longer than AMQP's 255 bytes")
        names.append(bytes((len(encoded),)) + encoded)
    return frame(_METHOD, channel, b"".join((_BASIC_PUBLISH, *names, bytes((int(mandatory),)))))


def body(channel: int, content: bytes, frame_max: int) -> bytes:
    """The body frames: `content` cut to fit frame_max (no frame for an empty body)."""
    size = frame_max - OVERHEAD
    return b"".join(
        frame(_BODY, channel, content[at : at + size]) for at in range(0, len(content), size)
    )


def on_channel(header: bytes, channel: int) -> bytes:
    """A frame marshalled for channel 0, moved to `channel`."""
    return header[:1] + channel.to_bytes(2, "big") + header[3:]


async def publish(
    channel: aiormq.abc.AbstractChannel, messages: Sequence[tuple[str, bytes]]
) -> list[asyncio.Future[Any]]:
    """Write each (message_id, frames) in order, as one payload; return one future per message,
    resolved by the broker's confirm (or failed by a nack, a return or the channel closing). The
    writer drains the socket after the payload, which is the batch's back-pressure."""
    ch: Any = channel
    confirmations: list[asyncio.Future[Any]] = []
    drained = ch.create_future()
    async with ch.lock:
        for message_id, _ in messages:
            ch.delivery_tag += 1
            tag = ch.delivery_tag
            confirmation = ch.create_future()
            ch.confirmations[tag] = confirmation
            ch.message_id_delivery_tag[message_id] = tag
            confirmation.add_done_callback(functools.partial(_forget, ch, message_id, tag))
            confirmations.append(confirmation)
        payload = b"".join(frames for _, frames in messages)
        try:
            await ch.write_queue.put(
                aiormq.abc.ChannelFrame(payload=payload, should_close=False, drain_future=drained)
            )
        except BaseException:
            # Not handed to the writer (cancelled while the queue was full): the broker never saw
            # these tags, so give them back, as basic_publish does, and fail the futures.
            for _ in messages:
                ch.confirmations.pop(ch.delivery_tag, None)
                ch.delivery_tag -= 1
            for confirmation in confirmations:
                confirmation.cancel()
            drained.cancel()
            raise
    return confirmations


def _forget(channel: Any, message_id: str, tag: int, _: asyncio.Future[Any]) -> None:
    """What basic_publish does once a confirm came: the message id no longer names the tag."""
    if channel.message_id_delivery_tag.get(message_id) == tag:
        del channel.message_id_delivery_tag[message_id]
