"""`outbox-relay top`: the outbox live in a terminal — rates, backlog, waits, dead letters."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import datetime

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from relay.core import config, model, ports
from relay.postgres.store import PgStore


@dataclasses.dataclass(frozen=True)
class Frame:
    """One refresh: the observation, dead letters by reason, and rates since the last frame."""

    at: datetime
    seen: model.Observation
    dead_by_reason: dict[str, int]
    rates: dict[str, float]  # enqueued, published, dead — per second


async def frame(store: ports.Readings, interval: float) -> Frame:
    """One frame, taken over `interval` seconds (a rate needs two readings)."""
    before, started = await store.table_inserts(), time.monotonic()
    await asyncio.sleep(interval)
    after, elapsed = await store.table_inserts(), time.monotonic() - started
    names = {"messages": "enqueued", "archive": "published", "dead": "dead"}
    rates = {
        label: max(0, after.get(t, 0) - before.get(t, 0)) / elapsed for t, label in names.items()
    }
    return Frame(
        datetime.now().astimezone(), await store.observe(), await store.dead_by_reason(), rates
    )


def render(frame: Frame, schema: str) -> Panel:
    seen = frame.seen
    flow = Table.grid(padding=(0, 2))
    flow.add_row("[b]enqueued/s", "[b]published/s", "[b]dead/s")
    flow.add_row(*(f"{frame.rates[k]:,.0f}" for k in ("enqueued", "published", "dead")))
    backlog = Table("due", "scheduled", "gated", "in flight", "oldest due", box=None)
    backlog.add_row(
        f"{seen.due:,}",
        f"{seen.scheduled:,}",
        f"{seen.gated:,}",
        f"{seen.in_flight:,}",
        _age(seen.oldest_due_seconds),
    )
    dead = Table("dead by reason", "", box=None)
    for reason, n in sorted(frame.dead_by_reason.items(), key=lambda item: -item[1]):
        dead.add_row(reason, f"{n:,}")
    if not frame.dead_by_reason:
        dead.add_row("[dim]none", "")
    health = Table.grid(padding=(0, 2))
    health.add_row("blocked keys", str(seen.blocked_keys))
    health.add_row(
        "dead tuples",
        f"{seen.dead_tuples:,}" + ("" if seen.autovacuum_on else "  [red]autovacuum off"),
    )
    health.add_row("vacuum horizon", _horizon(seen))
    title = f"outbox-relay top — schema {schema} — {frame.at:%Y-%m-%d %H:%M:%S %Z}"
    return Panel(Group(flow, "", backlog, "", dead, "", health), title=title, expand=False)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _horizon(seen: model.Observation) -> str:
    if seen.xmin_seconds is None or seen.xmin_seconds < 1:  # every short transaction holds it
        return "free"
    return (
        f"held {_age(seen.xmin_seconds)} ({seen.xmin_xids} xids) by pid {seen.xmin_pid} "
        f"({seen.xmin_state})"
    )


async def run(
    settings: config.Settings, *, interval: float = 1.0, once: bool = False, svg: str | None = None
) -> None:
    """Refresh every `interval` seconds until Ctrl-C; with `once`, print one frame and return;
    with `svg`, also save the last frame as an SVG picture."""
    store = await PgStore.open(
        settings.database_url.get_secret_value(),
        settings.db_schema,
        "outbox-relay top",
        max_size=1,
        pooled=settings.transaction_pooler,
    )
    console = Console(record=svg is not None)
    try:
        if once:
            console.print(render(await frame(store, interval), settings.db_schema))
        else:
            with Live(console=console, auto_refresh=False) as live:
                while True:
                    live.update(
                        render(await frame(store, interval), settings.db_schema), refresh=True
                    )
    finally:
        await store.close()
        if svg is not None:
            console.save_svg(svg, title="outbox-relay top")
