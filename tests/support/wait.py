"""Waiting on conditions with a deadline, never on fixed sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def until(
    predicate: Callable[[], T],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        time.sleep(interval)


async def until_async(
    predicate: Callable[[], Awaitable[T]],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    message: str = "condition",
) -> T:
    """`until` for a coroutine predicate."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        await asyncio.sleep(interval)
