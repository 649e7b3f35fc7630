"""How the publisher's connection is set up: TLS, the refusals named, what the broker tuned."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq
import aiormq.abc
import aiormq.exceptions

from relay.amqp import outcomes
from relay.core import errors

#: The frame_max assumed until the broker tunes the connection (RabbitMQ's default).
DEFAULT_FRAME_MAX = 131072


def tls_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """The TLS settings of an `amqps://` connection: the broker's certificate checked against
    `ca_file` (else the system's trust store) and its host name verified; a client certificate if
    given. ConfigError if a file is not what it should be."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise errors.ConfigError(f"TLS settings for RabbitMQ: {exc}") from None
    return context


async def open_confirming(
    url: str, *, connect_timeout: float, tls: ssl.SSLContext | None
) -> tuple[aio_pika.abc.AbstractConnection, aiormq.abc.AbstractChannel]:
    """A connection and, on it, a channel with publisher confirms whose returns raise (as aiormq's
    own channel). Raises BrokerRefused if RabbitMQ refuses the login or the virtual host,
    BrokerUnavailable if it cannot be reached."""
    try:
        return await _open(url, connect_timeout, tls)
    except aiormq.exceptions.ProbableAuthenticationError as exc:
        raise errors.BrokerRefused(
            f"RabbitMQ refused the login ({outcomes.describe(exc)}); check the user and "
            "password in OUTBOX_AMQP_URL"
        ) from exc
    except aiormq.exceptions.InvalidFrameError as exc:
        if "Connection.Close" not in str(exc):
            raise errors.BrokerUnavailable(
                f"RabbitMQ unavailable: {outcomes.describe(exc)}"
            ) from exc
        raise errors.BrokerRefused(
            "RabbitMQ closed the connection as it opened: the virtual host in "
            "OUTBOX_AMQP_URL does not exist, or this user may not use it"
        ) from exc
    except (*outcomes.CONNECTION_ERRORS, RuntimeError) as exc:
        if outcomes.stopping():
            raise
        raise errors.BrokerUnavailable(f"RabbitMQ unavailable: {outcomes.describe(exc)}") from exc


async def _open(
    url: str, connect_timeout: float, tls: ssl.SSLContext | None
) -> tuple[aio_pika.abc.AbstractConnection, aiormq.abc.AbstractChannel]:
    connection = await aio_pika.connect(url, timeout=connect_timeout, ssl_context=tls)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        return connection, await channel.get_underlay_channel()
    except BaseException:  # a connection without its channel is of no use: never leave it open
        with contextlib.suppress(Exception):
            await asyncio.wait_for(connection.close(), connect_timeout)
        raise


def frame_max(connection: aio_pika.abc.AbstractConnection) -> int:
    """The largest frame the broker accepts on `connection`, as it tuned it."""
    tune = getattr(_aiormq_connection(connection), "connection_tune", None)
    size = getattr(tune, "frame_max", 0)
    return size if isinstance(size, int) and size > 0 else DEFAULT_FRAME_MAX


def unblocked_event(connection: aio_pika.abc.AbstractConnection) -> asyncio.Event | None:
    """aiormq tracks connection.blocked/unblocked in a private event and offers no public view of
    it; we read it (None if a future aiormq moves it, and the relay says so at connect)."""
    event = getattr(_aiormq_connection(connection), "_Connection__connection_unblocked", None)
    return event if isinstance(event, asyncio.Event) else None


def _aiormq_connection(connection: aio_pika.abc.AbstractConnection) -> Any:
    return getattr(getattr(connection, "transport", None), "connection", None)
