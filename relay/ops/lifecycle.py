"""A relay process's life: its signals, what its probes say, and stopping with a grace."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from typing import Any

from relay.core import chores, errors, waiting
from relay.ops.watch import Watcher

log = logging.getLogger("relay.app")  # the name these lines carried before they moved here


class Process:
    """What the signal handlers and the probes look at while a relay process runs."""

    def __init__(self) -> None:
        self.work: asyncio.Task[Any] | None = None  # the loop, or a drain (`--until-empty`)
        self.watcher: Watcher | None = None
        self.chores: list[chores.Chore] = []
        self.step = "starting"  # what start-up is doing, for /readyz until the watcher answers

    def starting(self, step: str) -> None:
        self.step = f"starting: {step}"

    def cancel(self) -> None:
        if self.work is not None:
            self.work.cancel()

    def live(self) -> tuple[bool, str]:
        """Alive unless the loop or a chore is stuck (a hung call a restart would end). A chore
        that fails is not: it logs, is counted, and runs again; restarting would not help."""
        if self.watcher is None:
            return True, "starting"
        for chore in self.chores:
            stuck = chore.stuck()
            if stuck is not None:
                return False, f"the {chore.name} chore has been stuck in one run for {stuck:.0f}s"
        verdict = self.watcher.liveness()
        return verdict.ok, verdict.detail

    def ready(self) -> tuple[bool, str]:
        if self.watcher is None:
            return False, self.step
        return self.watcher.readiness.ok, self.watcher.readiness.detail


async def until_stopped(
    work: asyncio.Task[Any], stop: asyncio.Event, grace: float, margin: float
) -> None:
    """Wait for `work` (the loop) to end, or for `stop`; then give it `grace` for its confirms and
    `margin` (a lease: after it the rows come back anyway) for the final settle, which retries
    through outages. A crash of the loop propagates."""
    await waiting.done_or_set(work, stop)
    if not work.done():
        log.info("stopping: no new claims; finishing the batch in flight (up to %gs)", grace)
        try:
            await asyncio.wait_for(work, grace + margin)
        except TimeoutError:
            raise errors.RelayError(
                f"the batch in flight could not be settled within {grace + margin:g}s; "
                "its rows return to the queue when their lease ends"
            ) from None
        except asyncio.CancelledError:
            if work.cancelled():
                raise errors.RelayError(
                    "cancelled by a second signal; unsettled rows return when their lease ends"
                ) from None
            raise
    work.result()  # a crash of the loop propagates from here
    log.info("stopped cleanly")


@contextlib.contextmanager
def signals_set(stop: asyncio.Event, second: Callable[[], object]) -> Iterator[None]:
    """The first SIGINT/SIGTERM sets `stop`; a second one calls `second` (to cancel outright)."""
    loop_ = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: cancelling now", signal.Signals(signum).name)
            second()
        else:
            log.info("%s received", signal.Signals(signum).name)
            stop.set()

    installed = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop_.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop_.remove_signal_handler(signum)
