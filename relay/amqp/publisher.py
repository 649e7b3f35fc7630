"""The RabbitMQ adapter: publishes a batch pipelined on a confirm channel and names each outcome."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika.abc
import aiormq
import aiormq.abc
import aiormq.exceptions

from relay.amqp import connection, encoding, exchanges, outcomes, sending
from relay.amqp import frames as wire
from relay.amqp.encoding import Encoded, InvalidRow
from relay.core import errors, model

log = logging.getLogger("relay.publisher")  # the name log lines carry: as before the folders

Outcome = model.Outcome
Reason = model.DeadReason

Results = dict[int, model.PublishResult]


class AmqpPublisher:
    """ports.Publisher on RabbitMQ. One connection with two channels: a confirm channel that
    carries the batches, and a probe channel for passive exchange checks.

    A message the broker refuses by closing the channel (missing exchange, no write permission,
    over max_message_size, a malformed CC header…) fails every unconfirmed message on that channel.
    So the probe checks exchanges first; and when a channel error happens anyway, the culprits are
    named from the broker's reply (or, when it names none, found by publishing the rest one at a
    time), dead-lettered with a reason, and the innocent rest of the batch is sent again."""

    def __init__(
        self,
        url: str,
        *,
        confirm_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        exchange_ttl: float = exchanges.EXCHANGE_TTL,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._url = url
        self._tls = tls
        self._login = unquote(urlsplit(url).username or "guest")
        self._confirm_timeout = confirm_timeout
        self._connect_timeout = connect_timeout
        self._exchanges = exchanges.ExchangeProbe(confirm_timeout, exchange_ttl)
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aiormq.abc.AbstractChannel | None = None
        self._unblocked: asyncio.Event | None = None
        self._frame_max = connection.DEFAULT_FRAME_MAX
        self._max_message_size: int | None = None  # learnt from the broker's refusals

    @property
    def connected(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    @property
    def blocked(self) -> bool:
        return self.connected and self._unblocked is not None and not self._unblocked.is_set()

    async def until_unblocked(self) -> None:
        while self.blocked:
            assert self._unblocked is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._unblocked.wait(), 1.0)  # re-check the connection

    async def connect(self) -> None:
        """Open the connection and channels unless they are open. Raises BrokerUnavailable."""
        if self.connected:
            return
        await self.close()
        self._connection, self._channel = await connection.open_confirming(
            self._url, connect_timeout=self._connect_timeout, tls=self._tls
        )
        self._frame_max = connection.frame_max(self._connection)
        self._unblocked = connection.unblocked_event(self._connection)
        if self._unblocked is None:
            log.warning(
                "cannot see connection.blocked on this aiormq version; "
                "a broker alarm will show up as confirm timeouts"
            )
        log.info("connected to RabbitMQ (frame_max=%d)", self._frame_max)

    async def close(self) -> None:
        """Close the connection; give up waiting for the broker's reply after connect_timeout
        (a stalled network never sends one), which drops it all the same."""
        closing, self._connection = self._connection, None
        self._channel = None
        self._exchanges.forget_channel()
        if closing is not None and not closing.is_closed:
            try:
                await asyncio.wait_for(closing.close(), self._connect_timeout)
            except (*outcomes.CONNECTION_ERRORS, RuntimeError):
                if outcomes.stopping():
                    raise

    async def publish(
        self,
        messages: Sequence[model.OutboxMessage],
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        results: Results = {}
        ready: dict[int, Encoded] = {}
        for i, message in enumerate(messages):
            try:
                ready[i] = self._encode(message)
            except InvalidRow as exc:
                results[i] = model.PublishResult(Outcome.INVALID, str(exc))
        abort = abort or asyncio.Event()
        names = {messages[i].exchange for i in ready}
        missing = await self._exchanges.missing(self._connection, names, abort)
        for i in list(ready):
            early = self._refused_before_sending(messages[i], missing)
            if early is not None:
                results[i] = early
                del ready[i]
        held = still_held or _always
        results.update(await self._publish_in_rounds(messages, ready, abort, held))
        return [results[i] for i in range(len(messages))]

    def _refused_before_sending(
        self, message: model.OutboxMessage, missing: set[str]
    ) -> model.PublishResult | None:
        if message.exchange in missing:
            return model.PublishResult(
                Outcome.NO_EXCHANGE, f"no exchange '{message.exchange}' on the broker"
            )
        if self._max_message_size is not None and len(message.body) > self._max_message_size:
            return outcomes.rejected(
                Reason.TOO_LARGE,
                f"{len(message.body)} bytes; the broker's max_message_size is "
                f"{self._max_message_size}",
            )
        return None

    async def _publish_in_rounds(
        self,
        messages: Sequence[model.OutboxMessage],
        ready: Mapping[int, Encoded],
        abort: asyncio.Event,
        still_held: Callable[[], bool],
    ) -> Results:
        """Round 1 publishes everything pipelined. After a channel error, the broker's reply names
        the culprits if it can, and the rest go again pipelined; if it cannot, or a second error
        comes, the rest go one at a time, so each refusal names its own message. Before each
        write, `still_held` must say the relay still holds the messages' lease."""
        final: Results = {}
        todo = dict(ready)
        resent: set[int] = set()
        blamed: Results = {}
        for round_ in range(3):
            if not todo:
                break
            if round_:
                try:
                    await self.connect()
                except errors.BrokerUnavailable as exc:
                    final.update({i: outcomes.ambiguous(str(exc), i in resent) for i in todo})
                    break
            if not still_held():  # after reconnecting, which can take a while: right before writing
                final.update({i: outcomes.not_held(round_) for i in todo})
                break
            one_by_one = round_ == 2 or (round_ == 1 and not blamed)
            skipped: set[int] = set()
            if one_by_one:
                got, skipped = await self._one_at_a_time(messages, todo, abort, still_held)
                error = None
            else:
                got, error = await self._pipelined(messages, todo, abort)
            final.update(
                {
                    i: dataclasses.replace(r, resent=i in resent and i not in skipped)
                    for i, r in got.items()
                }
            )
            if error is None or abort.is_set():
                break
            unconfirmed = [i for i, r in got.items() if r.outcome is Outcome.AMBIGUOUS]
            blamed = self._blame(error, messages, unconfirmed)
            log.warning(
                "the broker closed the publish channel (%s); %d culprit(s) named, re-sending %d",
                outcomes.describe(error),
                len(blamed),
                len(unconfirmed) - len(blamed),
            )
            final.update(blamed)
            todo = {i: ready[i] for i in unconfirmed if i not in blamed}
            resent |= set(todo)
        return final

    async def _pipelined(
        self,
        messages: Sequence[model.OutboxMessage],
        todo: Mapping[int, Encoded],
        abort: asyncio.Event,
    ) -> tuple[Results, aiormq.exceptions.ChannelClosed | None]:
        """Publish all of `todo` at once and wait for the confirms (or the timeout, or `abort`).
        Also returns the channel error, if the broker closed the channel."""
        channel = self._channel
        if channel is None or channel.is_closed:
            return {
                i: outcomes.ambiguous("the channel closed before publishing") for i in todo
            }, None
        clock = outcomes.Stopwatch()
        if wire.usable(channel):
            try:
                confirms = await sending.batch(channel, messages, todo, self._frame_max)
            except outcomes.CONNECTION_ERRORS as exc:
                if outcomes.stopping():
                    raise
                why = f"the channel closed before publishing: {outcomes.describe(exc)}"
                return {i: outcomes.ambiguous(why) for i in todo}, None
            tasks = {i: clock.watch(i, c) for i, c in zip(todo, confirms, strict=True)}
        else:
            tasks = {
                i: clock.watch(i, sending.one(channel, messages[i], e)) for i, e in todo.items()
            }
        results, error = await self._confirms(clock, tasks, abort)
        if not self.connected:
            # aiormq may still write queued frames on a channel the broker closed, which makes the
            # broker close the whole connection: start again on a fresh one.
            log.warning(
                "lost the publish channel: %s",
                outcomes.describe(error or outcomes.any_error(tasks)),
            )
            await self.close()
        return results, error

    async def _one_at_a_time(
        self,
        messages: Sequence[model.OutboxMessage],
        todo: Mapping[int, Encoded],
        abort: asyncio.Event,
        still_held: Callable[[], bool],
    ) -> tuple[Results, set[int]]:
        """Publish each message alone and wait for its confirm: whatever closes the channel now
        can only be that message's doing. Also returns the messages it did not write again."""
        results: Results = {}
        skipped: set[int] = set()
        for i, encoded in todo.items():
            if abort.is_set():
                results[i] = outcomes.ambiguous("the relay is stopping")
                skipped.add(i)
                continue
            try:
                await self.connect()
            except errors.BrokerUnavailable as exc:
                results[i] = outcomes.ambiguous(str(exc))
                continue
            if not still_held():  # right before writing, after a reconnect that may have waited
                results[i] = outcomes.ambiguous(outcomes.NOT_HELD)
                skipped.add(i)
                continue
            assert self._channel is not None
            clock = outcomes.Stopwatch()
            task = clock.watch(i, sending.one(self._channel, messages[i], encoded))
            got, error = await self._confirms(clock, {i: task}, abort)
            results[i] = got[i]
            if error is not None:
                results[i] = self._blame(error, messages, [i]).get(i) or outcomes.refusal(error)
            if not self.connected:
                await self.close()
        return results, skipped

    async def _confirms(
        self,
        clock: outcomes.Stopwatch,
        tasks: Mapping[int, asyncio.Future[Any]],
        abort: asyncio.Event,
    ) -> tuple[Results, aiormq.exceptions.ChannelClosed | None]:
        """Wait for the tasks' confirms (or the timeout, or `abort`): each one's outcome, timed,
        and the channel error if the broker closed the channel."""
        await outcomes.wait_all(list(tasks.values()), self._confirm_timeout, abort)
        results = {
            i: clock.time(i, outcomes.outcome(t, self._confirm_timeout, abort))
            for i, t in tasks.items()
        }
        return results, outcomes.channel_error(tasks.values())

    def _blame(
        self,
        error: aiormq.exceptions.ChannelClosed,
        messages: Sequence[model.OutboxMessage],
        suspects: Sequence[int],
    ) -> Results:
        """The suspects the broker's reply points at, with their final outcome; {} when it names
        no exchange and no size (then only publishing them one by one can tell)."""
        named = exchanges.named(error)
        size = outcomes.SIZE_LIMIT.search(str(error))
        if size is not None:
            self._max_message_size = int(size[1])
            blamed = [i for i in suspects if len(messages[i].body) > self._max_message_size]
        elif named is not None and isinstance(
            error, aiormq.exceptions.ChannelNotFoundEntity | aiormq.exceptions.ChannelAccessRefused
        ):
            blamed = [i for i in suspects if messages[i].exchange == named]
        else:
            blamed = []
        return {i: outcomes.refusal(error) for i in blamed}

    def _encode(self, message: model.OutboxMessage) -> Encoded:
        return encoding.encode(message, login=self._login, frame_max=self._frame_max)


def _always() -> bool:
    return True
