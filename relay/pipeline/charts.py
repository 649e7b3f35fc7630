"""The report for people: Markdown with PNG charts of latency percentiles and daily volume."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from relay.pipeline.report import Report

#: Routes drawn in the latency chart (the busiest); the table lists them all.
CHART_ROUTES = 15
#: Attempt counts shown as their own column; more are summed in the last one.
ATTEMPT_COLUMNS = 5


def write(report: Report, folder: Path, lake: str) -> Path:
    """Write `report.md`, `latency.png` and `daily.png` into `folder`; the Markdown's path."""
    folder.mkdir(parents=True, exist_ok=True)
    _latency_chart(report.by_route[:CHART_ROUTES], folder / "latency.png")
    _daily_chart(report.daily, folder / "daily.png")
    published = sum(r["published"] for r in report.daily)
    dead = sum(r["dead"] for r in report.daily)
    span = f"{report.first_day} to {report.last_day}" if report.first_day else "no data yet"
    lines = [
        "# outbox-relay delivery report",
        "",
        f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from `{lake}` ({span}).",
        "",
        f"**{published:,} messages published, {dead:,} dead-lettered.**",
        "",
        "## Enqueue → confirm latency, by route",
        "",
        f"![latency percentiles of the {CHART_ROUTES} busiest routes](latency.png)",
        "",
        "| exchange | routing key | messages | p50 | p95 | p99 | max |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {_cell(r['exchange'])} | {_cell(r['routing_key'])} | {r['messages']:,} | "
            + " | ".join(_seconds(r[k]) for k in ("p50_seconds", "p95_seconds", "p99_seconds"))
            + f" | {_seconds(r['max_seconds'])} |"
            for r in report.by_route
        ),
        "",
        "## Attempts per message, by route",
        "",
        *_attempts_table(report.attempts),
        "",
        "## Dead letters, by reason",
        "",
        "| reason | messages | exchanges |",
        "| --- | ---: | ---: |",
        *(
            f"| {_cell(r['reason'])} | {r['messages']:,} | {r['exchanges']:,} |"
            for r in report.dead_by_reason
        ),
        "",
        "## Volume per day (UTC)",
        "",
        "![messages published and dead-lettered per day](daily.png)",
        "",
        "| day | published | dead |",
        "| --- | ---: | ---: |",
        *(f"| {r['day']} | {r['published']:,} | {r['dead']:,} |" for r in report.daily),
        "",
    ]
    path = folder / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _attempts_table(rows: list[dict[str, Any]]) -> list[str]:
    routes: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        counts = routes.setdefault((r["exchange"], r["routing_key"]), [0] * ATTEMPT_COLUMNS)
        counts[min(r["attempts"], ATTEMPT_COLUMNS) - 1] += r["messages"]
    heads = [str(n) for n in range(1, ATTEMPT_COLUMNS)] + [f"{ATTEMPT_COLUMNS}+"]
    return [
        "| exchange | routing key | " + " | ".join(heads) + " |",
        "| --- | --- |" + " ---: |" * ATTEMPT_COLUMNS,
        *(
            f"| {_cell(x)} | {_cell(k)} | " + " | ".join(f"{c:,}" for c in counts) + " |"
            for (x, k), counts in sorted(routes.items())
        ),
    ]


def _latency_chart(rows: list[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(9, 0.45 * max(len(rows), 2) + 1.5), layout="constrained")
    ax = fig.subplots()
    labels = [f"{r['exchange']} / {r['routing_key']}" for r in rows][::-1]
    height = 0.27
    for i, (key, name) in enumerate(
        (("p50_seconds", "p50"), ("p95_seconds", "p95"), ("p99_seconds", "p99"))
    ):
        values = [r[key] * 1000 for r in rows][::-1]
        ax.barh([y + (i - 1) * height for y in range(len(rows))], values, height, label=name)
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel("enqueue → confirm (ms)")
    if rows and max(r["p99_seconds"] for r in rows) > 50 * min(r["p50_seconds"] for r in rows):
        ax.set_xscale("log")
    # Above the plot, not inside it: inside, it always covers some route's bars.
    ax.legend(loc="lower right", bbox_to_anchor=(1, 1), ncols=3, frameon=False)
    ax.set_title("Latency percentiles, busiest routes", loc="left")
    fig.savefig(path, dpi=100)


def _daily_chart(rows: list[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    days = [str(r["day"]) for r in rows]
    ax.bar(days, [r["published"] for r in rows], label="published")
    ax.bar(days, [r["dead"] for r in rows], bottom=[r["published"] for r in rows], label="dead")
    ax.set_ylabel("messages")
    ax.tick_params(axis="x", labelrotation=45)
    ax.legend()
    ax.set_title("Messages per day (UTC)")
    fig.savefig(path, dpi=100)


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") or "(empty)"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
