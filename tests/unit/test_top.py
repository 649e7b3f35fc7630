"""`outbox-relay top`'s frame and panel against scripted readings: rates from two readings, the
backlog, dead letters by reason, the vacuum horizon."""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from relay.cli import top
from tests.support.fakes import ScriptedReadings, observation


def text(readings: ScriptedReadings, interval: float) -> tuple[top.Frame, str]:
    frame = asyncio.run(top.frame(readings, interval))
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(top.render(frame, "outbox"))
    return frame, console.export_text()


def test_rates_are_the_inserts_between_two_readings_per_second() -> None:
    readings = ScriptedReadings()
    readings.inserts = {"messages": 1_000, "archive": 900, "dead": 10}

    async def grow() -> top.Frame:
        taking = asyncio.ensure_future(top.frame(readings, 0.2))
        await asyncio.sleep(0.05)
        readings.inserts = {"messages": 1_100, "archive": 1_000, "dead": 10}
        return await taking

    frame = asyncio.run(grow())
    assert 300 < frame.rates["enqueued"] <= 500  # 100 rows in a little over 0.2 s
    assert frame.rates["published"] == frame.rates["enqueued"]
    assert frame.rates["dead"] == 0


def test_the_panel_shows_the_backlog_dead_letters_and_who_pins_the_horizon() -> None:
    readings = ScriptedReadings()
    readings.dead = {"unroutable": 2, "rejected": 5}
    readings.seen = observation(
        due=1_234, xmin_seconds=300.0, xmin_xids=12, xmin_pid=42, xmin_state="idle in transaction"
    )
    _, shown = text(readings, 0.0)
    assert "1,234" in shown
    assert shown.index("rejected") < shown.index("unroutable")  # most first
    assert "held 5m (12 xids) by pid 42 (idle in transaction)" in shown
    readings.seen = observation(autovacuum_on=False)
    readings.dead = {}
    _, shown = text(readings, 0.0)
    assert "autovacuum off" in shown
    assert "none" in shown
    assert "vacuum horizon  free" in shown
