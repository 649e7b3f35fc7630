"""Publishes onto a confirm channel in the bytes encoding wrote: a batch as one payload, or one."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiormq.abc
from pamqp import commands

from relay.amqp import frames as wire
from relay.amqp.encoding import Encoded
from relay.core import model


class _Prebuilt(commands.Basic.Properties):
    """Properties that marshal as encoding.encode wrote them, for aiormq's own basic_publish (a
    message alone, or an aiormq `frames` cannot use): the same bytes on every path."""

    def __init__(self, message_id: str, encoded: bytes) -> None:
        super().__init__(message_id=message_id)  # aiormq tracks returns by message_id
        self._encoded = encoded

    def marshal(self) -> bytes:
        return self._encoded


async def batch(
    channel: aiormq.abc.AbstractChannel,
    messages: Sequence[model.OutboxMessage],
    todo: Mapping[int, Encoded],
    frame_max: int,
) -> list[asyncio.Future[Any]]:
    """Hand `todo`'s frames to the channel's writer in one payload; one confirm future each.
    Only on a channel `frames.usable` accepts; raises what aiormq raises if it closed."""
    number = channel.number
    payloads = []
    for i, encoded in todo.items():
        message = messages[i]
        frames = b"".join(
            (
                wire.method(number, message.exchange, message.routing_key, mandatory=True),
                wire.on_channel(encoded.header, number),
                wire.body(number, message.body, frame_max),
            )
        )
        payloads.append((str(message.message_id), frames))
    return await wire.publish(channel, payloads)


async def one(
    channel: aiormq.abc.AbstractChannel, message: model.OutboxMessage, encoded: Encoded
) -> Any:
    """One publish through aiormq's own path (a message alone, or an aiormq `wire` cannot use),
    done when the broker confirms it; raises what aiormq raises for a nack, a return or a close."""
    return await channel.basic_publish(
        message.body,
        exchange=message.exchange,
        routing_key=message.routing_key,
        properties=_Prebuilt(str(message.message_id), encoded.properties),
        mandatory=True,
    )
