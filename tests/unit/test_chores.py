"""The chore supervisor: a failing chore is logged, counted, run again; a hung one fails livez."""

from __future__ import annotations

import asyncio
import logging

import pytest

from relay.core import chores, retry
from relay.ops import lifecycle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_failing_chore_is_logged_counted_and_backed_off_until_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcomes: list[Exception | None] = [ValueError("bad row"), ValueError("bad row"), None]
    failed: list[str] = []

    async def step() -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    chore = chores.Chore("gauges", step, 5.0, max_backoff=60.0, on_error=failed.append)
    with caplog.at_level(logging.INFO, logger="relay.chores"):
        delays = [await chore.run_once() for _ in range(3)]
    assert delays == [5.0, 10.0, 5.0]  # back-off doubles from the interval; success resets it
    assert failed == ["gauges", "gauges"]
    assert chore.failures == 0
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert "chore gauges failed (ValueError: bad row)" in errors[0].message
    assert errors[0].exc_info is not None  # the traceback is in the log
    assert "works again after 2 failures" in caplog.records[-1].message


async def test_the_back_off_is_capped_and_starts_at_the_first_wait() -> None:
    async def step() -> None:
        raise RuntimeError("always")

    chore = chores.Chore("fast", step, 0.0, max_backoff=0.8)
    delays = [await chore.run_once() for _ in range(6)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 0.8, 0.8])  # retry.FIRST_WAIT doubling
    default = chores.Chore("default", step, 0.0)
    assert max([await default.run_once() for _ in range(12)]) == retry.LONGEST_WAIT


async def test_run_survives_failures_and_only_cancellation_ends_it() -> None:
    runs = 0
    third = asyncio.Event()

    async def step() -> None:
        nonlocal runs
        runs += 1
        if runs >= 3:
            third.set()
        raise KeyError("gone")

    task = asyncio.create_task(chores.Chore("x", step, 0.0, max_backoff=0.0).run())
    await asyncio.wait_for(third.wait(), timeout=5)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_hung_run_shows_as_stuck_and_fails_liveness() -> None:
    clock = Clock()
    release = asyncio.Event()

    async def hangs() -> None:
        await release.wait()

    chore = chores.Chore("watcher", hangs, 1.0, stall_after=60.0, clock=clock)
    process = lifecycle.Process()
    process.chores = [chore]
    process.watcher = _AliveWatcher()  # type: ignore[assignment]
    running = asyncio.create_task(chore.run_once())
    await asyncio.sleep(0)  # the run has started
    clock.now += 59.0
    assert chore.stuck() is None
    assert process.live() == (True, "cycling")
    clock.now += 2.0
    assert chore.stuck() == pytest.approx(61.0)
    ok, detail = process.live()
    assert not ok
    assert detail == "the watcher chore has been stuck in one run for 61s"
    release.set()
    await running
    assert chore.stuck() is None
    assert process.live()[0]


class _AliveWatcher:
    class _Verdict:
        ok = True
        detail = "cycling"

    def liveness(self) -> _AliveWatcher._Verdict:
        return self._Verdict()


def test_one_liveness_rule_covers_the_loop_the_heartbeat_and_the_watcher() -> None:
    """Twice the longest wait a relay makes on purpose, for every part /livez watches: a
    heartbeat renewing a 10-s lease is no more "hung" at 31 s than a loop in a 30-s back-off."""
    from relay import app
    from relay.core import config, loop
    from relay.core.policy import Options

    assert Options().stalled_after == 2 * (retry.LONGEST_WAIT + 10.0 + 10.0 + 1.0)
    assert Options(lease=120.0).stalled_after == 2 * (retry.LONGEST_WAIT + 10.0 + 120.0 + 1.0)
    assert Options(lease=1.0, confirm_timeout=1.0, poll_interval=0.1).stalled_after == 64.2
    settings = config.load(database_url="postgresql://x/y", amqp_url="amqp://x/", lease=60.0)
    options = app.options(settings)
    assert options.stalled_after == 2 * (retry.LONGEST_WAIT + settings.confirm_timeout + 61.0)
    relay = loop.Relay(None, None, options)  # type: ignore[arg-type]
    assert relay.heartbeat._stall_after == options.stalled_after
