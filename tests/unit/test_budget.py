"""What a tier prints at its end: the slowest tests over its runs, each part of its time, and a
warning (never a failure) when the whole ran past its budget."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import budget


def recorded(path: Path, wall: float, tests: dict[str, float]) -> Path:
    path.write_text(json.dumps({"wall": wall, "tests": tests}))
    return path


def test_the_total_counts_set_up_checks_and_every_run_and_warns_past_the_budget(
    tmp_path: Path,
) -> None:
    runs = [
        recorded(tmp_path / "parallel.json", 200, {"a::slow": 50.0, "b::quick": 0.5}),
        recorded(tmp_path / "serial.json", 90, {"c::paced": 30.0}),
        tmp_path / "never-ended.json",  # a run that did not reach its end is left out
    ]
    lines = budget.report(300, 25, 30, runs)
    assert lines[0] == "3 tests; the 3 slowest (setup + call + teardown):"
    assert [line.split()[-1] for line in lines[1:4]] == ["a::slow", "c::paced", "b::quick"]
    assert lines[4] == "set-up 25s, checks 30s, tests 290s, total 345s (budget 300s)"
    assert lines[5].startswith("WARNING: this tier took 345s, 45s over its budget of 300s.")
    assert "a::slow (50s)" in lines[5]
    assert budget.report(400, 25, 30, runs)[-1].startswith("set-up")  # within it: no warning
