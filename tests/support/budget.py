"""Budgets that are seen: what each test took, summed over the runs of a tier, and a warning at
the end when the tier ran past its budget (a warning, not a failure: a 2-core machine is too
noisy for a timed pass or fail).

pytest records into a JSON file (`--record-durations PATH`, see tests/conftest.py) each test's
setup + call + teardown and the run's wall time; then

    python -m tests.support.budget BUDGET_SECONDS SETUP_SECONDS CHECKS_SECONDS RUN.json [RUN.json …]

prints the 25 slowest tests of all the runs, the set-up, the checks before the tests (lint,
types, layers), the test time and the total, and a warning naming the slowest tests if the total
exceeds the budget."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHOWN = 25
NAMED_IN_WARNING = 10


def report(budget: float, setup: float, checks: float, runs: list[Path]) -> list[str]:
    tests: dict[str, float] = {}
    wall = 0.0
    for run in runs:
        if not run.exists():  # that run never reached its end
            continue
        recorded = json.loads(run.read_text())
        wall += recorded["wall"]
        for node, seconds in recorded["tests"].items():
            tests[node] = tests.get(node, 0.0) + seconds
    slowest = sorted(tests.items(), key=lambda item: -item[1])
    lines = [f"{len(tests)} tests; the {min(SHOWN, len(tests))} slowest (setup + call + teardown):"]
    lines += [f"  {seconds:6.1f}s  {node}" for node, seconds in slowest[:SHOWN]]
    total = setup + checks + wall
    lines.append(
        f"set-up {setup:.0f}s, checks {checks:.0f}s, tests {wall:.0f}s, total {total:.0f}s"
        f" (budget {budget:.0f}s)"
    )
    if total > budget:
        lines.append(
            f"WARNING: this tier took {total:.0f}s, {total - budget:.0f}s over its budget of"
            f" {budget:.0f}s. Its slowest tests: "
            + ", ".join(f"{node} ({seconds:.0f}s)" for node, seconds in slowest[:NAMED_IN_WARNING])
        )
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    budget, setup, checks = (float(a) for a in argv[:3])
    print("\n".join(report(budget, setup, checks, [Path(p) for p in argv[3:]])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
