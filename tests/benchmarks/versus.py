"""The project's benchmark against a control in one run: this checkout's perf.py and another
revision's, in turn, pair after pair (the order alternates), each on its own code and its own
migrations; then each figure pair by pair, its ratio to the control, and the median and spread of
the ratios. A gain is a gain only where the median ratio is outside the pairs' spread.

    .venv/bin/python tests/benchmarks/versus.py --against 4f029f9 --pairs 3 -- --only drain
        [--keep-logs DIR]

Everything after `--` goes to both perf.py runs (e.g. `--only pinned --rates 500 --phases 60 240
60 60`). The control is checked out with `git worktree` into a temporary folder (removed after)
and run with the same interpreter, its own `relay` first on the path. Figures read: each drain's
rate and PostgreSQL CPU per 1,000 messages, each steady run's and pinned phase's p50/p99, and the
pinned scenario's p99 ratio of pinned to clean.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]

#: (pattern, [(figure name, group)]): what perf.py prints that is compared.
FIGURES: list[tuple[re.Pattern[str], list[tuple[str, str]]]] = [
    (
        re.compile(
            r"^(?P<label>[^:]+): [\d,]+ messages.*?= (?P<rate>[\d,]+) msg/s; "
            r"CPU per 1,000: relay (?P<relay>[\d.]+)s, postgres (?P<pg>[\d.]+)s"
        ),
        [("msg/s", "rate"), ("PostgreSQL CPU s per 1,000", "pg"), ("relay CPU s/1,000", "relay")],
    ),
    (
        re.compile(
            r"^(?P<label>steady [\d,]+/s) for .*?p50 (?P<p50>[\d.]+) ms.*?p99 (?P<p99>[\d.]+)"
        ),
        [("p50 ms", "p50"), ("p99 ms", "p99")],
    ),
    (
        re.compile(
            r"^(?P<label>.+?) \(\d+s\): p50 (?P<p50>[\d.]+) ms, p95 [\d.]+ ms, p99 (?P<p99>[\d.]+)"
        ),
        [("p50 ms", "p50"), ("p99 ms", "p99")],
    ),
    (
        re.compile(r"^(?P<label>.+?): p99 pinned / clean (?P<ratio>[\d.]+)x"),
        [("p99 pinned / clean", "ratio")],
    ),
]


def figures(output: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in output.splitlines():
        for pattern, names in FIGURES:
            match = pattern.search(line)
            if match:
                for name, group in names:
                    found[f"{match['label']}: {name}"] = float(match[group].replace(",", ""))
                break
    return found


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """`rev` in a worktree of its own, for as long as the block runs."""
    folder = Path(tempfile.mkdtemp(prefix="outbox-control-"))
    subprocess.run(
        ["git", "-C", str(HERE), "worktree", "add", "--detach", str(folder), rev],
        check=True,
        capture_output=True,
    )
    perf = folder / "tests" / "benchmarks" / "perf.py"
    # CPU per 1,000 messages with three decimals, as this checkout's perf.py prints it (older
    # ones print two: 0.08 s against 0.10 s hides a difference of a fifth).
    perf.write_text(perf.read_text().replace(':.2f}s"', ':.3f}s"'))
    try:
        yield folder
    finally:
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "remove", "--force", str(folder)],
            check=False,
            capture_output=True,
        )


def run(tree: Path, args: list[str], log: Path) -> dict[str, float]:
    """perf.py of `tree`, on its own code (its folder first on the path, and as the working
    folder: relays it starts with `-m relay` import theirs); the figures it printed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(tree / "tests" / "benchmarks" / "perf.py"), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"perf.py in {tree} failed ({done.returncode}); see {log}")
    return figures(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the control's git revision")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--keep-logs", type=Path, help="each run's output, kept here")
    parser.add_argument("perf", nargs=argparse.REMAINDER, help="-- and perf.py's arguments")
    args = parser.parse_args()
    perf = [a for a in args.perf if a != "--"]
    logs = args.keep_logs or Path(tempfile.mkdtemp(prefix="outbox-versus-"))
    logs.mkdir(parents=True, exist_ok=True)
    seen: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with checkout(args.against) as control:
        trees = {"this": HERE, args.against: control}
        for pair in range(args.pairs):
            order = ["this", args.against] if pair % 2 == 0 else [args.against, "this"]
            for who in order:
                label = re.sub(r"[^\w.-]", "_", who)  # a branch's "/" is no file name
                got = run(trees[who], perf, logs / f"pair{pair + 1}-{label}.txt")
                print(f"pair {pair + 1}, {who}: {len(got)} figures", flush=True)
                for name, value in got.items():
                    seen[name][who].append(value)
    print(f"\nthis checkout against {args.against}, {args.pairs} pairs (logs in {logs}):")
    for name, by in seen.items():
        ours, theirs = by.get("this", []), by.get(args.against, [])
        if not ours or not theirs:
            print(f"  {name}: only in {'this' if ours else args.against}")
            continue
        ratios = [a / b for a, b in zip(ours, theirs, strict=False) if b]
        cells = "; ".join(f"{a:,.2f} vs {b:,.2f}" for a, b in zip(ours, theirs, strict=False))
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"
        middle = f"{statistics.median(ratios):.2f}" if ratios else "n/a"
        print(f"  {name}: {cells}; ratio median {middle} (pairs {spread})")


if __name__ == "__main__":
    main()
