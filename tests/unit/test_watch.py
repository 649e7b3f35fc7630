"""The watcher's run_once against scripted readings: readiness, gauges, warnings, liveness."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from relay.core import errors
from relay.ops import metrics
from relay.ops.watch import Watcher
from tests.support.fakes import ScriptedReadings as Readings
from tests.support.fakes import observation

SCHEMA = 20


@dataclasses.dataclass
class Broker:
    connected: bool = True
    blocked: bool = False


@dataclasses.dataclass
class Loop:
    last_progress: float = dataclasses.field(default_factory=time.monotonic)


def watcher(
    readings: Readings, broker: Broker | None = None, loop: Loop | None = None
) -> tuple[Watcher, metrics.Metrics]:
    counters = metrics.Metrics()
    watch = Watcher(
        readings,
        broker or Broker(),
        loop or Loop(),
        counters,
        stats_interval=3600,
        xmin_warning=60,
        schema_version=SCHEMA,
        stall_after=60,
    )
    return watch, counters


def gauge(counters: metrics.Metrics, name: str, **labels: str) -> float | None:
    return counters.registry.get_sample_value(name, labels)


async def test_ready_with_a_current_schema_and_a_broker_and_gauges_once_an_interval() -> None:
    readings = Readings()
    watch, counters = watcher(readings)
    starting = watch.readiness
    await watch.run_once()
    assert not starting.ok  # until the first look
    assert watch.readiness.ok
    assert watch.readiness.detail == f"database: ok (schema version {SCHEMA})\nbroker: ok"
    assert gauge(counters, "outbox_messages", state="due") == 3
    assert gauge(counters, "outbox_messages", state="gated") == 2
    assert gauge(counters, "outbox_broker_connected") == 1
    await watch.run_once()
    assert readings.observed == 1  # the next look at the gauges is an interval away


@pytest.mark.parametrize(
    ("version", "says"),
    [
        (errors.DatabaseUnavailable("down"), "database: unreachable"),
        (errors.SchemaMissing("no schema"), "database: the outbox schema is missing"),
        (SCHEMA - 1, f"schema at version {SCHEMA - 1}, this relay needs {SCHEMA}"),
    ],
)
async def test_not_ready_without_a_usable_database_and_never_raising(
    version: int | Exception, says: str
) -> None:
    readings = Readings()
    readings.version = version
    watch, _ = watcher(readings)
    await watch.run_once()
    assert not watch.readiness.ok
    assert says in watch.readiness.detail
    assert readings.observed == 0  # no gauges from a database the relay cannot use


async def test_not_ready_without_the_broker_and_the_gauge_says_so() -> None:
    readings = Readings()
    watch, counters = watcher(readings, Broker(connected=False, blocked=False))
    await watch.run_once()
    assert not watch.readiness.ok
    assert watch.readiness.detail.endswith("broker: not connected")
    assert gauge(counters, "outbox_broker_connected") == 0
    assert readings.observed == 0


async def test_a_failed_look_at_the_gauges_keeps_readiness_and_the_old_values() -> None:
    readings = Readings()
    readings.seen = errors.DatabaseUnavailable("statement timeout")
    watch, counters = watcher(readings)
    await watch.run_once()
    assert watch.readiness.ok
    assert readings.observed == 1
    assert gauge(counters, "outbox_messages", state="due") is None


async def test_a_pinned_horizon_is_warned_once_per_session_that_pins_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    readings = Readings()
    watch, _ = watcher(readings)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "vacuum horizon pinned" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="relay.watch"):
        for pid, seconds in ((7, 90.0), (7, 120.0), (8, 90.0), (8, 10.0), (8, 90.0)):
            readings.seen = observation(
                xmin_seconds=seconds, xmin_xids=3, xmin_pid=pid, xmin_state="idle in transaction"
            )
            await watch.observe()
    # pid 7 once, pid 8 once, and pid 8 again after its horizon moved on in between.
    assert len(warnings()) == 3
    assert "by pid 7 (idle in transaction)" in warnings()[0]


async def test_autovacuum_off_is_warned_once_until_it_is_back_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    readings = Readings()
    watch, counters = watcher(readings)
    with caplog.at_level(logging.WARNING, logger="relay.watch"):
        for on in (False, False, True, False):
            readings.seen = observation(autovacuum_on=on)
            await watch.observe()
    assert sum("autovacuum is off" in r.getMessage() for r in caplog.records) == 2
    assert gauge(counters, "outbox_db_autovacuum_enabled") == 0


def test_alive_while_the_loop_moves_and_not_once_it_stalls() -> None:
    loop = Loop()
    watch, _ = watcher(Readings(), loop=loop)
    assert watch.liveness().ok
    loop.last_progress = time.monotonic() - 61
    verdict = watch.liveness()
    assert not verdict.ok
    assert "no progress for 61s" in verdict.detail
