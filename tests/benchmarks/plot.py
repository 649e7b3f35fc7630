"""Draws the pinned-horizon scenario's chart from the JSON files `perf.py --json` wrote.

    .venv/bin/python tests/benchmarks/plot.py docs/pinned-horizon.png before.json:before \\
        after.json:after

One column per load; the top row is the commit-to-delivery p99 (and p50, thinner) over time, the
bottom row the exact dead tuples of the outbox tables, with the phases shaded. Each labelled file
is one line in every panel. Needs matplotlib (the `spark` extra has it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

SHADES = {"pinned": "#fde2c8", "readers": "#f7c08a"}
#: Issue 18's bound on the dead tuples at the end of the pinned phase (drawn dotted).
DEAD_TUPLE_BOUND = 10_000


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    series: list[tuple[str, dict[str, Any]]] = []
    for arg in sys.argv[2:]:
        path, _, label = arg.partition(":")
        series.append((label or Path(path).stem, json.loads(Path(path).read_text())))
    rates = sorted({run["rate"] for _, data in series for run in data["runs"]})
    fig, axes = plt.subplots(2, len(rates), figsize=(6.5 * len(rates), 7), squeeze=False)
    for col, rate in enumerate(rates):
        top, bottom = axes[0][col], axes[1][col]
        for label, data in series:
            run = next((r for r in data["runs"] if r["rate"] == rate), None)
            if run is None:
                continue
            t = [b["t"] / 60 for b in run["latency"]]
            line = top.plot(t, [b["p99_ms"] for b in run["latency"]], label=f"{label} p99")[0]
            top.plot(
                t,
                [b["p50_ms"] for b in run["latency"]],
                color=line.get_color(),
                linewidth=0.7,
                alpha=0.6,
                label=f"{label} p50",
            )
            samples = run["samples"]
            bottom.plot(
                [s["t"] / 60 for s in samples],
                [sum(s["dead"].values()) for s in samples],
                color=line.get_color(),
                label=label,
            )
        phases = next(r for _, d in series for r in d["runs"] if r["rate"] == rate)["phases"]
        start = 0.0
        for phase in phases:
            end = start + phase["seconds"] / 60
            for ax in (top, bottom):
                if phase["phase"] in SHADES:
                    ax.axvspan(start, end, color=SHADES[phase["phase"]], zorder=0)
            top.text(
                (start + end) / 2,
                1.01,
                phase["phase"],
                transform=top.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=8,
            )
            start = end
        top.set_yscale("log")
        top.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        top.set_ylabel("commit → delivery (ms, 5 s buckets)")
        top.set_title(f"{rate:,} messages/s", pad=16)
        top.legend(fontsize=7)
        # From zero, and at least to the bound: a flat line of 2 is not a range of 0.2.
        bottom.set_ylim(0, max(DEAD_TUPLE_BOUND * 1.1, bottom.get_ylim()[1]))
        bottom.axhline(DEAD_TUPLE_BOUND, color="grey", linestyle=":", linewidth=0.8)
        bottom.set_ylabel("dead tuples, outbox queue tables (pgstattuple)")
        bottom.set_xlabel("minutes")
        bottom.legend(fontsize=7)
    fig.suptitle("Steady load while a transaction pins the vacuum horizon")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
