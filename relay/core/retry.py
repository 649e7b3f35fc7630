"""Which errors are transient, and the back-off policies for reconnecting and retrying messages."""

from __future__ import annotations

import random

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


def message_delay(attempt: int, base: float, cap: float) -> float:
    """How long a message waits after failed attempt number `attempt` (1-based): `base` doubling per
    attempt up to `cap`, then scaled by a random factor in [0.5, 1] so retried rows spread out."""
    exponent = min(max(attempt - 1, 0), 32)
    return min(cap, base * 2.0**exponent) * random.uniform(0.5, 1.0)
