"""Which errors are transient, and the back-off policies for reconnecting and retrying messages."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import tenacity

from relay.core import errors


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying after a pause: a service down or a connection lost.
    Everything else is a bug or a misconfiguration and must fail loudly."""
    return isinstance(exc, errors.TransientError)


def reconnect_wait(initial: float = 0.1, maximum: float = 30.0) -> tenacity.wait.wait_base:
    """Exponential back-off with jitter between attempts to reach a service that is down."""
    return tenacity.wait_exponential(multiplier=initial, max=maximum) + tenacity.wait_random(
        0, initial
    )


class Lost(Exception):
    """A connection that worked has ended: connect again at once, and back off from the start."""


async def reconnecting(
    serve: Callable[[], Awaitable[object]],
    failed: Callable[[BaseException | None], None],
    lost: Callable[[Lost], None],
) -> None:
    """Run `serve` (which connects, then serves until its connection ends) until cancelled.
    Transient failures to connect are retried with `reconnect_wait`, calling `failed` before each
    wait; a connection that worked and ended (`serve` raises `Lost`) calls `lost` and starts the
    back-off again from its shortest wait — a process that outlives many outages still comes back
    within a fraction of a second of the next."""
    while True:
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(is_transient),
            wait=reconnect_wait(),
            before_sleep=lambda state: failed(state.outcome.exception() if state.outcome else None),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await serve()
        except Lost as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from exc  # lost while being stopped: stop
            lost(exc)


def message_delay(attempt: int, base: float, cap: float) -> float:
    """How long a message waits after failed attempt number `attempt` (1-based): `base` doubling per
    attempt up to `cap`, then scaled by a random factor in [0.5, 1] so retried rows spread out."""
    exponent = min(max(attempt - 1, 0), 32)
    return min(cap, base * 2.0**exponent) * random.uniform(0.5, 1.0)
