"""What the broker's answers mean: each publish's outcome (acked, returned, nacked, refused with a
reason, or ambiguous), the errors that leave a message's fate unknown, and the timing of confirms
for the latency metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Awaitable, Mapping
from typing import Any

import aiormq
import aiormq.exceptions

from relay.core import model

Outcome = model.Outcome
Reason = model.DeadReason

#: The broker or the network failing (as opposed to our code).
BROKER_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
)
#: Errors after which a message may or may not have reached the broker.
CONNECTION_ERRORS = (*BROKER_ERRORS, asyncio.CancelledError)


def stopping() -> bool:
    """Whether the current task is being cancelled: aiormq raises CancelledError when a
    connection is lost, so a CancelledError caught as a connection error is re-raised when the
    cancel was the caller's own (a shutdown), never turned into a broker error."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


SIZE_LIMIT = re.compile(r"message size \d+ is larger than configured max size (\d+)")


class Stopwatch:
    """When each publish of a batch started and when its confirm came, for the latency metrics."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._done: dict[int, tuple[float, float]] = {}

    def watch(self, i: int, sending: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(sending)
        task.add_done_callback(lambda _: self._done.setdefault(i, (time.monotonic(), time.time())))
        return task

    def time(self, i: int, result: model.PublishResult) -> model.PublishResult:
        if result.outcome is not Outcome.ACKED or i not in self._done:
            return result
        done, wall = self._done[i]
        return dataclasses.replace(result, seconds=done - self._started, confirmed_at=wall)


async def wait_all(tasks: list[asyncio.Future[Any]], seconds: float, abort: asyncio.Event) -> None:
    """Wait until every task is done, `seconds` pass or `abort` is set; cancel the stragglers."""
    everything = asyncio.ensure_future(asyncio.wait(tasks))
    aborted = asyncio.ensure_future(abort.wait())
    try:
        await asyncio.wait(
            {everything, aborted}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        everything.cancel()
        aborted.cancel()
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def outcome(task: asyncio.Future[Any], timeout: float, abort: asyncio.Event) -> model.PublishResult:
    if task.cancelled():
        why = "the relay is stopping" if abort.is_set() else f"no confirm within {timeout:g}s"
        return ambiguous(why)
    exc = task.exception()
    if exc is None:
        return model.PublishResult(Outcome.ACKED)
    if isinstance(exc, aiormq.exceptions.PublishError):
        returned = getattr(exc.message, "delivery", None)
        return model.PublishResult(
            Outcome.RETURNED,
            f"returned by the broker: {getattr(returned, 'reply_code', '?')} "
            f"{getattr(returned, 'reply_text', '?')}",
        )
    if isinstance(exc, aiormq.exceptions.DeliveryError):
        return model.PublishResult(Outcome.NACKED, "the broker nacked the message")
    if isinstance(exc, CONNECTION_ERRORS):
        return ambiguous(f"connection or channel lost before the confirm: {describe(exc)}")
    return model.PublishResult(Outcome.FAILED, f"unexpected error: {describe(exc)}")


def refusal(error: aiormq.exceptions.ChannelClosed) -> model.PublishResult:
    """The final outcome of a message the broker closed the channel over."""
    text = describe(error)
    if isinstance(error, aiormq.exceptions.ChannelNotFoundEntity) and "no exchange" in str(error):
        return model.PublishResult(Outcome.NO_EXCHANGE, text)
    if isinstance(error, aiormq.exceptions.ChannelAccessRefused):
        return rejected(Reason.ACCESS_REFUSED, text)
    if SIZE_LIMIT.search(str(error)):
        return rejected(Reason.TOO_LARGE, text)
    return rejected(Reason.REJECTED, text)


def rejected(reason: model.DeadReason, detail: str) -> model.PublishResult:
    return model.PublishResult(Outcome.REJECTED, detail, reason=reason)


def ambiguous(detail: str, resent: bool = False) -> model.PublishResult:
    return model.PublishResult(Outcome.AMBIGUOUS, detail, resent=resent)


NOT_HELD = "not written: the relay can no longer be sure it holds the lease"


def not_held(round_: int) -> model.PublishResult:
    """A message not written because the lease may be gone: UNSENT if it never was, else
    AMBIGUOUS (an earlier write may have arrived; twice written from the third round on)."""
    if round_ == 0:
        return model.PublishResult(Outcome.UNSENT, NOT_HELD)
    return ambiguous(f"{NOT_HELD} again", resent=round_ >= 2)


def channel_error(tasks: Any) -> aiormq.exceptions.ChannelClosed | None:
    """The broker's channel-close error among the tasks' failures, if it closed the channel."""
    for task in tasks:
        if not task.cancelled() and isinstance(task.exception(), aiormq.exceptions.ChannelClosed):
            return task.exception()  # type: ignore[no-any-return]
    return None


def any_error(tasks: Mapping[int, asyncio.Future[Any]]) -> BaseException:
    for task in tasks.values():
        if not task.cancelled() and task.exception() is not None:
            return task.exception()  # type: ignore[return-value]
    return RuntimeError("unknown reason")


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
