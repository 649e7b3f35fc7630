"""The replay's pacer on a clock the test moves: the ceiling (no second holds more than the rate
and one batch) whatever the batches take, the rate kept on average when they take less than
their share, and no burst to make up for a batch that waited."""

from __future__ import annotations

import bisect
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core import errors
from relay.pipeline.pace import Pacer
from tests.support.tier import examples

RATE, BATCH = 200.0, 50
SHARE = BATCH / RATE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


def commits(sends: list[tuple[float, float]], sizes: list[int] | None = None) -> list[float]:
    """When each batch commits, given (reading, sending) seconds for each: the rows are read
    (from Spark) before the pacer is asked, then sent in one transaction."""
    clock = Clock()
    pacer = Pacer(RATE, clock=clock, sleep=clock.sleep)
    done = []
    for i, (reading, sending) in enumerate(sends):
        clock.now += reading
        began = pacer.wait()
        clock.now += sending
        pacer.sent(BATCH if sizes is None else sizes[i], began, clock())
        done.append(clock())
    return done


def busiest_second(times: list[float], sizes: list[int]) -> int:
    """The most rows committed in any one second [t, t + 1)."""
    before = [0]
    for size in sizes:
        before.append(before[-1] + size)
    return max(before[bisect.bisect_left(times, t + 1.0)] - before[i] for i, t in enumerate(times))


durations = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)


@settings(max_examples=examples(500, "OUTBOX_PACE_EXAMPLES"), deadline=None)
@given(st.lists(st.tuples(durations, durations), min_size=2, max_size=60), st.data())
def test_no_second_holds_more_than_the_rate_and_one_batch(
    sends: list[tuple[float, float]], data: st.DataObject
) -> None:
    sizes = data.draw(st.lists(st.integers(1, BATCH), min_size=len(sends), max_size=len(sends)))
    done = commits(sends, sizes)
    assert busiest_second(done, sizes) <= RATE + BATCH


@settings(max_examples=examples(200, "OUTBOX_PACE_EXAMPLES"), deadline=None)
@given(st.lists(st.floats(0.0, SHARE / 2, allow_nan=False), min_size=10, max_size=60))
def test_batches_that_take_less_than_half_their_share_keep_the_rate(sending: list[float]) -> None:
    done = commits([(0.0, s) for s in sending])
    # From the first batch's start (its commit less its send) to the last commit.
    took = done[-1] - (done[0] - sending[0])
    assert len(done) * BATCH / took >= 0.95 * RATE
    assert len(done) * BATCH / took <= RATE + BATCH


def test_a_batch_that_waited_earns_no_burst() -> None:
    # The fifth batch waits 1.5 s for a lock; the ones after it go out a share apart again.
    sends = [(0.0, 0.01)] * 4 + [(0.0, 1.5)] + [(0.0, 0.0)] * 8
    done = commits(sends)
    after = [b - a for a, b in itertools.pairwise(done[4:])]
    assert after[0] >= SHARE / 2  # the stalled batch's own credit is half a share at most
    assert all(gap == pytest.approx(SHARE) for gap in after[1:])


def test_reading_counts_towards_the_share() -> None:
    # Spark delivering a batch's rows late (0.2 s of a 0.25 s share) is not waited on again.
    done = commits([(0.2, 0.0)] * 10)
    assert [b - a for a, b in itertools.pairwise(done)] == pytest.approx([SHARE] * 9)


def test_a_rate_of_zero_is_refused() -> None:
    with pytest.raises(errors.InvalidArgument, match="rate must be positive"):
        Pacer(0)
