"""The test tiers: the full run (`deploy/dev test`, what CI runs) and the fast one
(`deploy/dev test --fast`, OUTBOX_TEST_TIER=fast), whose property tests try fewer examples.

A test that draws examples asks `examples(n)` for its count: n in the full tier, a tenth of it
 (at least 5) in the fast one. Its own variable (OUTBOX_INTERLEAVINGS, OUTBOX_FUZZ_EXAMPLES) wins
over both, for a long run on purpose."""

from __future__ import annotations

import os

FAST = os.environ.get("OUTBOX_TEST_TIER", "full") == "fast"


def examples(full: int, variable: str | None = None) -> int:
    """How many examples a property test tries in this tier."""
    if variable is not None and (given := os.environ.get(variable)):
        return int(given)
    return max(5, full // 10) if FAST else full
