"""AmqpPublisher against real RabbitMQ: each broker outcome, and failures caused through a proxy."""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest

from relay.amqp import frames as wire
from relay.amqp.publisher import AmqpPublisher
from relay.core import errors, model
from tests.support.amqp import Broker
from tests.support.proxy import TcpProxy
from tests.support.services import Services
from tests.support.wait import until_async

Outcome = model.Outcome
_ids = itertools.count(1)


def message(
    exchange: str,
    routing_key: str = "k",
    body: bytes = b"body",
    *,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    attempts: int = 1,
    ordering_key: str | None = None,
) -> model.OutboxMessage:
    return model.OutboxMessage(
        id=next(_ids),
        message_id=uuid.uuid4(),
        exchange=exchange,
        routing_key=routing_key,
        body=body,
        headers=headers or {},
        properties={"content_type": "application/octet-stream"} | (properties or {}),
        ordering_key=ordering_key,
        created_at=datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC),
        attempts=attempts,
    )


@pytest.fixture(params=["batched frames", "basic_publish"])
async def publisher(
    amqp_url: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AmqpPublisher]:
    """The publisher on its hot path, and on the fallback it takes on an unfamiliar aiormq."""
    if request.param == "basic_publish":
        monkeypatch.setattr(wire, "usable", lambda channel: False)
    p = AmqpPublisher(amqp_url, confirm_timeout=5)
    await p.connect()
    yield p
    await p.close()


def outcomes(results: list[model.PublishResult]) -> list[Outcome]:
    return [r.outcome for r in results]


async def test_acked_message_arrives_with_its_id_properties_and_headers(
    publisher: AmqpPublisher, broker: Broker
) -> None:
    await broker.declare(binding="order.*")
    sent = message(
        broker.exchange,
        "order.created",
        b'{"id": 1}',
        headers={"tenant": "acme"},
        properties={
            "content_type": "application/json",
            "correlation_id": "c-9",
            "priority": 3,
            "expiration": 60000,
            "type": "OrderCreated",
            "app_id": "shop",
        },
        attempts=2,
        ordering_key="order-1",
    )
    assert outcomes(await publisher.publish([sent])) == [Outcome.ACKED]
    (got,) = await broker.collect(1)
    incoming = got.properties
    assert got.message_id == str(sent.message_id)
    assert got.body == b'{"id": 1}'
    assert got.headers == {
        "tenant": "acme",
        "x-outbox-attempt": 2,
        "x-outbox-ordering-key": "order-1",
    }
    assert incoming.content_type == "application/json"
    assert incoming.correlation_id == "c-9"
    assert incoming.priority == 3
    assert incoming.expiration == 60.0  # aio-pika decodes the AMQP milliseconds into seconds
    assert incoming.type == "OrderCreated"
    assert incoming.app_id == "shop"
    assert incoming.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert incoming.timestamp == datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)


async def test_transient_delivery_mode_when_asked(publisher: AmqpPublisher, broker: Broker) -> None:
    await broker.declare()
    await publisher.publish([message(broker.exchange, properties={"delivery_mode": 1})])
    (got,) = await broker.collect(1)
    assert got.properties.delivery_mode == aio_pika.DeliveryMode.NOT_PERSISTENT


async def test_unroutable_message_is_returned(publisher: AmqpPublisher, broker: Broker) -> None:
    await broker.declare(binding="only.this")
    results = await publisher.publish([message(broker.exchange, "something.else")])
    assert outcomes(results) == [Outcome.RETURNED]
    assert "312 NO_ROUTE" in results[0].detail


async def test_refusing_queue_nacks(publisher: AmqpPublisher, broker: Broker) -> None:
    await broker.declare(queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    assert outcomes(await publisher.publish([message(broker.exchange)])) == [Outcome.NACKED]


async def test_missing_exchange_spares_the_rest_of_the_batch(
    publisher: AmqpPublisher, broker: Broker
) -> None:
    await broker.declare()
    batch = [
        message(broker.exchange, "a"),
        message(f"{broker.exchange}.missing", "b"),
        message(broker.exchange, "c"),
    ]
    results = await publisher.publish(batch)
    assert outcomes(results) == [Outcome.ACKED, Outcome.NO_EXCHANGE, Outcome.ACKED]
    assert ".missing" in results[1].detail
    got = await broker.collect(2, settle=0.2)
    assert sorted(g.routing_key for g in got) == ["a", "c"]


async def test_exchange_deleted_after_it_was_checked(amqp_url: str, broker: Broker) -> None:
    # The probe's answer is cached; when the exchange vanishes after that, the publish itself closes
    # the channel. The culprit is named, the others are ambiguous (never lost), and the publisher
    # recovers on the next connect().
    publisher = AmqpPublisher(amqp_url, confirm_timeout=5, exchange_ttl=3600)
    await publisher.connect()
    try:
        await broker.declare()
        doomed = f"{broker.exchange}.doomed"
        async with broker.channel() as channel:
            await channel.declare_exchange(doomed)
            # It exists (so the probe caches it) but nothing is bound: returned, not missing.
            assert outcomes(await publisher.publish([message(doomed)])) == [Outcome.RETURNED]
            await channel.exchange_delete(doomed)
        results = await publisher.publish(
            [message(broker.exchange, "a"), message(doomed), message(broker.exchange, "c")]
        )
        assert results[1].outcome == Outcome.NO_EXCHANGE
        assert {results[0].outcome, results[2].outcome} <= {Outcome.ACKED, Outcome.AMBIGUOUS}
        await publisher.connect()
        assert outcomes(await publisher.publish([message(broker.exchange, "d")])) == [Outcome.ACKED]
    finally:
        await publisher.close()


@pytest.mark.parametrize(
    ("headers", "properties", "detail"),
    [
        ({}, {"colour": "red"}, "unknown AMQP properties: colour"),
        ({"k" * 129: 1}, {}, "longer than AMQP's 128 bytes"),
        ({"nested": [{"k" * 200: 1}]}, {}, "longer than AMQP's 128 bytes"),
        ({"big": 2**70}, {}, "cannot encode"),
        ({}, {"delivery_mode": 3}, "cannot encode"),
        ({}, {"priority": 2.5}, "whole number"),
        ({}, {"reply_to": 7}, "reply_to must be a string"),
        ({}, {"user_id": "somebody-else"}, "user_id must equal"),
        ({"huge": "x" * 200_000}, {}, "frame_max"),
        ({}, {"exchange": "no spaces! allowed"}, "is not valid in AMQP"),
        ({}, {"routing_key": "é" * 128}, "longer than AMQP's 255 bytes"),
    ],
)
async def test_rows_that_cannot_be_encoded_are_invalid_and_spare_the_batch(
    publisher: AmqpPublisher,
    broker: Broker,
    headers: dict[str, Any],
    properties: dict[str, Any],
    detail: str,
) -> None:
    await broker.declare()
    # The exchange and routing key are columns, not properties; the table makes them part of the
    # case so that rows edited past enqueue's checks are covered too.
    properties = dict(properties)  # the table's dict is shared by both publisher paths
    exchange = properties.pop("exchange", broker.exchange)
    routing_key = properties.pop("routing_key", "bad")
    results = await publisher.publish(
        [
            message(broker.exchange, "ok"),
            message(exchange, routing_key, headers=headers, properties=properties),
        ]
    )
    assert outcomes(results) == [Outcome.ACKED, Outcome.INVALID]
    assert detail in results[1].detail
    assert [g.routing_key for g in await broker.collect(1, settle=0.2)] == ["ok"]


def _target(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5672


def _via(url: str, port: int) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{parts.username}:{parts.password}@127.0.0.1:{port}").geturl()


async def test_stalled_broker_makes_the_batch_ambiguous(amqp_url: str, broker: Broker) -> None:
    await broker.declare()
    with TcpProxy(*_target(amqp_url)) as proxy:
        publisher = AmqpPublisher(_via(amqp_url, proxy.port), confirm_timeout=0.5)
        await publisher.connect()
        await publisher.publish([message(broker.exchange)])  # warms the exchange cache
        proxy.pause()
        results = await publisher.publish([message(broker.exchange) for _ in range(3)])
        assert outcomes(results) == [Outcome.AMBIGUOUS] * 3
        assert "no confirm within 0.5s" in results[0].detail
        proxy.resume()
        await publisher.close()


async def test_cut_connection_is_ambiguous_then_reconnects(amqp_url: str, broker: Broker) -> None:
    await broker.declare()
    with TcpProxy(*_target(amqp_url)) as proxy:
        publisher = AmqpPublisher(_via(amqp_url, proxy.port), confirm_timeout=5)
        await publisher.connect()
        await publisher.publish([message(broker.exchange)])
        proxy.pause()
        batch = [message(broker.exchange) for _ in range(3)]
        task = asyncio.ensure_future(publisher.publish(batch))
        await asyncio.sleep(0)  # let the frames be queued before the cut
        proxy.cut()
        assert outcomes(await task) == [Outcome.AMBIGUOUS] * 3
        with pytest.raises(errors.BrokerUnavailable):
            await publisher.connect()  # the proxy refuses: the broker looks down
        proxy.restore()
        proxy.resume()
        await publisher.connect()
        assert outcomes(await publisher.publish([message(broker.exchange)])) == [Outcome.ACKED]
        await publisher.close()


async def test_unreachable_broker_raises_broker_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        publisher = AmqpPublisher(f"amqp://guest:secret@127.0.0.1:{port}/", connect_timeout=2)
        with pytest.raises(errors.BrokerUnavailable) as info:
            await publisher.connect()
    assert "secret" not in str(info.value)


async def test_malformed_header_closing_the_channel_is_found_and_the_rest_resent(
    publisher: AmqpPublisher, broker: Broker
) -> None:
    # RabbitMQ closes the channel over a CC header that is not a list of strings, naming neither
    # the exchange nor the message: only publishing one at a time can tell who did it.
    await broker.declare()
    batch = [message(broker.exchange, f"ok.{i}") for i in range(6)]
    batch.insert(3, message(broker.exchange, "bad", headers={"CC": 5}))
    results = await publisher.publish(batch)
    culprit = results.pop(3)
    assert (culprit.outcome, culprit.reason) == (Outcome.REJECTED, model.DeadReason.REJECTED)
    assert "unacceptable_type_in_header" in culprit.detail
    assert outcomes(results) == [Outcome.ACKED] * 6
    got = await broker.collect(6, settle=0.3)
    assert {g.routing_key for g in got} == {f"ok.{i}" for i in range(6)}
    # A message sent again after its first send was cut short says so (and may arrive twice).
    copies = collections.Counter(g.routing_key for g in got)
    assert all(
        r.resent
        for r, key in zip(results, [f"ok.{i}" for i in range(6)], strict=True)
        if copies[key] > 1
    )


async def test_internal_exchange_is_access_refused_and_the_rest_delivered(
    publisher: AmqpPublisher, broker: Broker
) -> None:
    await broker.declare()
    internal = f"{broker.exchange}.internal"
    async with broker.channel() as channel:
        await channel.declare_exchange(internal, internal=True)
    try:
        results = await publisher.publish(
            [message(broker.exchange, "a"), message(internal), message(broker.exchange, "c")]
        )
    finally:
        async with broker.channel() as channel:
            await channel.exchange_delete(internal)
    assert (results[1].outcome, results[1].reason) == (
        Outcome.REJECTED,
        model.DeadReason.ACCESS_REFUSED,
    )
    assert "internal exchange" in results[1].detail
    assert outcomes([results[0], results[2]]) == [Outcome.ACKED, Outcome.ACKED]


@pytest.fixture
def broker_max_message_size(svc: Services) -> Iterator[int]:
    """Lower RabbitMQ's max_message_size for the test (new channels pick it up)."""
    limit = 4096
    svc.broker_ctl("eval", f"application:set_env(rabbit, max_message_size, {limit}).")
    try:
        yield limit
    finally:
        svc.broker_ctl("eval", "application:set_env(rabbit, max_message_size, 134217728).")


@pytest.mark.serial  # it changes the broker's max_message_size for everyone
async def test_message_over_the_brokers_size_limit_is_too_large(
    amqp_url: str, broker: Broker, broker_max_message_size: int
) -> None:
    await broker.declare()
    publisher = AmqpPublisher(amqp_url, confirm_timeout=5)
    await publisher.connect()
    try:
        big = b"x" * (broker_max_message_size + 1)
        results = await publisher.publish(
            [
                message(broker.exchange, "a"),
                message(broker.exchange, "big", big),
                message(broker.exchange, "c"),
            ]
        )
        assert (results[1].outcome, results[1].reason) == (
            Outcome.REJECTED,
            model.DeadReason.TOO_LARGE,
        )
        assert outcomes([results[0], results[2]]) == [Outcome.ACKED, Outcome.ACKED]
        # The limit is now known: the next oversized message is refused before it is sent, so the
        # channel (and the batch on it) is not disturbed again.
        again = await publisher.publish(
            [message(broker.exchange, "big2", big), message(broker.exchange, "d")]
        )
        assert [(r.outcome, r.resent) for r in again] == [
            (Outcome.REJECTED, False),
            (Outcome.ACKED, False),
        ]
        assert f"max_message_size is {broker_max_message_size}" in again[0].detail
    finally:
        await publisher.close()


async def test_a_stop_while_connecting_to_or_closing_on_a_stalled_broker_is_a_stop(
    amqp_url: str, broker: Broker
) -> None:
    # aiormq raises CancelledError for a lost connection too, and the publisher maps those to
    # BrokerUnavailable: a relay's own cancel (its shutdown timeout) must not become one, or the
    # relay would go on as after an outage.
    await broker.declare()
    with TcpProxy(*_target(amqp_url)) as proxy:
        proxy.pause()
        publisher = AmqpPublisher(_via(amqp_url, proxy.port), connect_timeout=30)
        connecting = asyncio.ensure_future(publisher.connect())
        await until_async(lambda: asyncio.sleep(0, proxy.accepted), message="a connection")
        connecting.cancel()
        await asyncio.wait({connecting}, timeout=10)
        assert connecting.cancelled()
        proxy.resume()
        await publisher.connect()
        proxy.pause()
        closing = asyncio.ensure_future(publisher.close())  # waits for the broker's reply
        await until_async(lambda: asyncio.sleep(0, not publisher.connected), message="closing")
        assert not closing.done()
        closing.cancel()
        await asyncio.wait({closing}, timeout=10)
        assert closing.cancelled()
        proxy.resume()
