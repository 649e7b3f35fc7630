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


#: The one back-off of the relay, for every service that is down and every chore that failed:
#: the first wait, doubling up to the longest.
FIRST_WAIT = 0.1
LONGEST_WAIT = 30.0


def reconnect_wait(
    initial: float = FIRST_WAIT, maximum: float = LONGEST_WAIT
) -> tenacity.wait.wait_base:
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
    quick_loss: float = LONGEST_WAIT,
) -> None:
    """Run `serve` (which connects, then serves until its connection ends) until cancelled.
    Transient failures to connect are retried with `reconnect_wait`, calling `failed` before each
    wait; a connection that worked and ended (`serve` raises `Lost`) calls `lost` and starts the
    back-off again from its shortest wait — a process that outlives many outages still comes back
    within a fraction of a second of the next. A connection that did not outlive `quick_loss`
    seconds (the longest back-off) counts as lost at once: those back off too."""
    loop = asyncio.get_running_loop()
    quick = 0  # connections in a row that ended within `quick_loss` seconds of being made
    while True:
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(is_transient),
            wait=reconnect_wait(),
            before_sleep=lambda state: failed(state.outcome.exception() if state.outcome else None),
        )
        began = loop.time()
        try:
            async for attempt in retrying:
                with attempt:
                    began = loop.time()
                    try:
                        await serve()
                    except Exception as exc:
                        task = asyncio.current_task()
                        if task is not None and task.cancelling():
                            # An error in place of a cancel (a connection closed under it):
                            # stop, do not retry.
                            raise asyncio.CancelledError from exc
                        raise
        except Lost as exc:
            lost(exc)
            # A connection that ends as soon as it is made (a server that kills idle sessions
            # at once, a proxy): back off too, not reconnect in a tight loop.
            quick = quick + 1 if loop.time() - began < quick_loss else 0
            if quick > 1:
                wait = min(LONGEST_WAIT, FIRST_WAIT * 2.0**quick)
                await asyncio.sleep(wait * random.uniform(0.5, 1.0))


def message_delay(attempt: int, base: float, cap: float) -> float:
    """How long a message waits after failed attempt number `attempt` (1-based): `base` doubling per
    attempt up to `cap`, then scaled by a random factor in [0.5, 1] so retried rows spread out."""
    exponent = min(max(attempt - 1, 0), 32)
    return min(cap, base * 2.0**exponent) * random.uniform(0.5, 1.0)
