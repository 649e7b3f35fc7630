"""Runs the relay's coroutines on uvloop when it is installed (or asked for), else on asyncio's."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from relay.core import errors

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """`asyncio.run(main)` on the loop `choice` names: `auto`, `uvloop` or `asyncio`."""
    try:
        new_loop = factory(choice)
    except errors.ConfigError:
        main.close()  # never started: no "was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)


def factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory for `uvloop` (ConfigError if it is missing) and for `auto` when it
    is installed; None (asyncio's default loop) otherwise."""
    if choice == "asyncio":
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            raise errors.ConfigError(
                "OUTBOX_EVENT_LOOP=uvloop but uvloop is not installed (pip install uvloop)"
            ) from None
        return None
    new_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return new_loop


def name() -> str:
    """The running loop's kind, for the start-up log line."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
