"""The RabbitMQ adapter: publishes a batch pipelined on a confirm channel and names each outcome."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aio_pika.abc
import aiormq
import aiormq.abc
import aiormq.exceptions
from pamqp import commands, frame, header

from relay import errors, model

log = logging.getLogger(__name__)

#: How long an exchange seen to exist is trusted before it is checked again.
EXCHANGE_TTL = 30.0
_STRING_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "type",
    "user_id",
    "app_id",
)
_ENCODING_ERRORS = (TypeError, ValueError, OverflowError, RecursionError, struct.error)
#: The broker or the network failing (as opposed to our code).
_BROKER_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
)
#: Errors after which a message may or may not have reached the broker.
_CONNECTION_ERRORS = (*_BROKER_ERRORS, asyncio.CancelledError)


class InvalidRow(ValueError):
    """The row cannot be encoded as the AMQP message it claims to be."""


class AmqpPublisher:
    """ports.Publisher on RabbitMQ. One connection with two channels: a confirm channel that
    carries the batches, and a probe channel for passive exchange checks. The probe exists because
    a publish to a missing exchange closes its channel, failing every unconfirmed message on it;
    checking first keeps the innocent messages of a batch out of that blast radius."""

    def __init__(
        self,
        url: str,
        *,
        confirm_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        exchange_ttl: float = EXCHANGE_TTL,
    ) -> None:
        self._url = url
        self._login = unquote(urlsplit(url).username or "guest")
        self._confirm_timeout = confirm_timeout
        self._connect_timeout = connect_timeout
        self._exchange_ttl = exchange_ttl
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aiormq.abc.AbstractChannel | None = None
        self._probe: aio_pika.abc.AbstractChannel | None = None
        self._frame_max = 131072
        self._exchanges_seen: dict[str, float] = {}

    @property
    def connected(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    async def connect(self) -> None:
        """Open the connection and channels unless they are open. Raises BrokerUnavailable."""
        if self.connected:
            return
        await self.close()
        try:
            connection = await aio_pika.connect(self._url, timeout=self._connect_timeout)
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            self._channel = await channel.get_underlay_channel()
            self._connection = connection
            self._frame_max = _frame_max(connection)
        except (*_CONNECTION_ERRORS, RuntimeError) as exc:
            await self.close()
            raise errors.BrokerUnavailable(f"RabbitMQ unavailable: {_describe(exc)}") from exc
        log.info("connected to RabbitMQ (frame_max=%d)", self._frame_max)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._probe = None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(*_CONNECTION_ERRORS, RuntimeError):
                await connection.close()

    async def publish(self, messages: Sequence[model.OutboxMessage]) -> list[model.PublishResult]:
        results: dict[int, model.PublishResult] = {}
        ready: dict[int, commands.Basic.Properties] = {}
        for i, message in enumerate(messages):
            try:
                ready[i] = self._properties(message)
            except InvalidRow as exc:
                results[i] = model.PublishResult(model.Outcome.INVALID, str(exc))
        missing = await self._missing_exchanges({messages[i].exchange for i in ready})
        for i in [i for i in ready if messages[i].exchange in missing]:
            del ready[i]
            results[i] = model.PublishResult(
                model.Outcome.NO_EXCHANGE, f"no exchange '{messages[i].exchange}' on the broker"
            )
        results.update(await self._publish_confirmed(messages, ready))
        return [results[i] for i in range(len(messages))]

    async def _publish_confirmed(
        self,
        messages: Sequence[model.OutboxMessage],
        ready: Mapping[int, commands.Basic.Properties],
    ) -> dict[int, model.PublishResult]:
        channel = self._channel
        if channel is None or channel.is_closed:
            return {i: _ambiguous("the channel closed before publishing") for i in ready}
        tasks = {
            i: asyncio.ensure_future(
                channel.basic_publish(
                    messages[i].body,
                    exchange=messages[i].exchange,
                    routing_key=messages[i].routing_key,
                    properties=properties,
                    mandatory=True,
                )
            )
            for i, properties in ready.items()
        }
        if tasks:
            _, pending = await asyncio.wait(tasks.values(), timeout=self._confirm_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        results = {
            i: _outcome(task, messages[i], self._confirm_timeout) for i, task in tasks.items()
        }
        if not self.connected:
            # aiormq may still write queued frames on a channel the broker closed, which makes the
            # broker close the whole connection; start the next batch on a fresh one instead.
            log.warning("lost the publish channel: %s", _channel_error(tasks.values()))
            await self.close()
        return results

    async def _missing_exchanges(self, names: set[str]) -> set[str]:
        """Which of `names` do not exist, by passive declare (the default exchange always does).
        An exchange that cannot be checked in time counts as present: the publish will tell."""
        now = time.monotonic()
        missing: set[str] = set()
        try:
            async with asyncio.timeout(self._confirm_timeout):
                for name in sorted(n for n in names if n and self._exchanges_seen.get(n, 0) < now):
                    if await self._exchange_exists(name):
                        self._exchanges_seen[name] = now + self._exchange_ttl
                    else:
                        missing.add(name)
        except TimeoutError:
            log.warning("exchange check took over %gs; publishing unchecked", self._confirm_timeout)
            self._probe = None  # its RPC was abandoned mid-flight; open a fresh one next time
        return missing

    async def _exchange_exists(self, name: str) -> bool:
        try:
            probe = await self._probe_channel()
            await probe.get_exchange(name, ensure=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        except (*_BROKER_ERRORS, RuntimeError) as exc:
            log.debug("could not check exchange %r: %s", name, _describe(exc))
        return True

    async def _probe_channel(self) -> aio_pika.abc.AbstractChannel:
        if self._probe is None or self._probe.is_closed:
            if self._connection is None:
                raise aiormq.exceptions.ChannelInvalidStateError("not connected")
            self._probe = await self._connection.channel(publisher_confirms=False)
        return self._probe

    def _properties(self, message: model.OutboxMessage) -> commands.Basic.Properties:
        """The AMQP properties for `message`, checked to encode exactly as stored."""
        stored = dict(message.properties)
        unknown = set(stored) - model.SETTABLE_PROPERTIES
        if unknown:
            raise InvalidRow(f"unknown AMQP properties: {', '.join(sorted(unknown))}")
        for key in _STRING_PROPERTIES:
            if key in stored and not isinstance(stored[key], str):
                raise InvalidRow(f"property {key} must be a string")
        if "user_id" in stored and stored["user_id"] != self._login:
            raise InvalidRow(
                "property user_id must equal the relay's RabbitMQ user "
                "(RabbitMQ closes the channel otherwise)"
            )
        headers: dict[str, Any] = dict(message.headers)
        headers[model.ATTEMPT_HEADER] = message.attempts
        if message.ordering_key is not None:
            headers[model.ORDERING_KEY_HEADER] = message.ordering_key
        try:
            _check_field_names(headers)
            properties = commands.Basic.Properties(
                content_type=stored.get("content_type"),
                content_encoding=stored.get("content_encoding"),
                headers=headers,
                delivery_mode=_whole(stored.get("delivery_mode", 2)),
                priority=_whole(stored.get("priority")),
                correlation_id=stored.get("correlation_id"),
                reply_to=stored.get("reply_to"),
                expiration=None
                if "expiration" not in stored
                else str(_whole(stored["expiration"])),
                message_id=str(message.message_id),
                timestamp=message.created_at,
                message_type=stored.get("type"),
                user_id=stored.get("user_id"),
                app_id=stored.get("app_id"),
            )
            size = len(frame.marshal(header.ContentHeader(0, len(message.body), properties), 1))
        except _ENCODING_ERRORS as exc:
            raise InvalidRow(f"cannot encode as AMQP: {exc}") from None
        if size > self._frame_max:
            raise InvalidRow(
                f"headers and properties take {size} bytes; "
                f"the broker's frame_max is {self._frame_max}"
            )
        return properties


def _outcome(
    task: asyncio.Future[Any], message: model.OutboxMessage, timeout: float
) -> model.PublishResult:
    if task.cancelled():
        return _ambiguous(f"no confirm within {timeout:g}s")
    exc = task.exception()
    if exc is None:
        return model.PublishResult(model.Outcome.ACKED)
    if isinstance(exc, aiormq.exceptions.PublishError):
        returned = getattr(exc.message, "delivery", None)
        return model.PublishResult(
            model.Outcome.RETURNED,
            f"returned by the broker: {getattr(returned, 'reply_code', '?')} "
            f"{getattr(returned, 'reply_text', '?')}",
        )
    if isinstance(exc, aiormq.exceptions.DeliveryError):
        return model.PublishResult(model.Outcome.NACKED, "the broker nacked the message")
    if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity) and (
        f"no exchange '{message.exchange}'" in str(exc)
    ):
        return model.PublishResult(model.Outcome.NO_EXCHANGE, _describe(exc))
    if isinstance(exc, _CONNECTION_ERRORS):
        return _ambiguous(f"connection or channel lost before the confirm: {_describe(exc)}")
    return model.PublishResult(model.Outcome.FAILED, f"unexpected error: {_describe(exc)}")


def _ambiguous(detail: str) -> model.PublishResult:
    return model.PublishResult(model.Outcome.AMBIGUOUS, detail)


def _channel_error(tasks: Any) -> str:
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            return _describe(task.exception())
    return "unknown reason"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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


def _check_field_names(value: Any) -> None:
    """AMQP field names are at most 128 bytes; pamqp would silently truncate longer ones."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if len(key.encode("utf-8")) > 128:
                raise InvalidRow(f"header name {key[:40]!r}… is longer than AMQP's 128 bytes")
            _check_field_names(item)
    elif isinstance(value, list):
        for item in value:
            _check_field_names(item)


def _frame_max(connection: aio_pika.abc.AbstractConnection) -> int:
    transport = getattr(connection, "transport", None)
    tune = getattr(getattr(transport, "connection", None), "connection_tune", None)
    frame_max = getattr(tune, "frame_max", 0)
    return frame_max if isinstance(frame_max, int) and frame_max > 0 else 131072
